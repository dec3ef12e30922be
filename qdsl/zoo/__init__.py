"""Small reference models and shipped data for tests, examples, benchmarks and the demo.

Nothing here downloads anything: data comes from scikit-learn's bundled ``digits`` set or
is generated deterministically.
"""

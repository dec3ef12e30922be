"""End-to-end workflows built on the public API: sweeps and the demo.

This layer sits on top of everything (spec → … → export → runtime → lint) and is what
the ``qdsl sweep`` and ``qdsl demo`` commands run.
"""

"""The model zoo: small reference models (digits CNNs, torchvision-shaped ResNet-18/50,
MobileNetV2, MobileNetV3-small and EfficientNet-B0, a small U-Net), shipped data, training
helpers and trained-model factories, for the demo, sweeps, examples, benchmarks and tests
(it was ``qdsl.testing``; workflows use it, so it is named for what it is).

Nothing here downloads anything: data comes from scikit-learn's bundled ``digits`` set or
is generated deterministically.
"""

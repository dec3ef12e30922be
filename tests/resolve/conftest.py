"""Reference models for the resolver tests (built once: resolving never mutates them)."""

import pytest

from qdsl.zoo.models import conv1d_net, conv_bn_relu_net, digits_resnet, mlp


@pytest.fixture(scope="session")
def resnet():
    return digits_resnet()


@pytest.fixture(scope="session")
def conv1d():
    return conv1d_net()


@pytest.fixture(scope="session")
def cbr():
    return conv_bn_relu_net()


@pytest.fixture(scope="session")
def mlp_model():
    return mlp()

"""Trained reference models and their data, as zero-argument factories for the CLI.

``qdsl sweep specs/w4a8-per-channel.qspec --model qdsl.zoo.trained:digits_resnet
--data qdsl.zoo.trained:digits`` quantizes a *trained* network: the factories here train
(or load from the on-disk cache of :mod:`qdsl.zoo.train`) and return the model;
the data factories return ``(x_train, y_train, x_test, y_test)``, the data-reference
contract of ``--data`` (see :mod:`qdsl.workflows.refs`).
"""

from __future__ import annotations

__all__ = ["digits_resnet", "digits", "conv1d_net", "keywords"]


def digits_resnet():
    """DigitsResNet trained on sklearn digits (float test accuracy ≈ 99%)."""
    from qdsl.zoo.train import trained_digits_resnet

    return trained_digits_resnet()[0]


def digits():
    """``(x_train, y_train, x_test, y_test)`` of sklearn digits, as 1×8×8 tensors."""
    from qdsl.zoo.data import digits as _digits

    return _digits(seed=0)


def conv1d_net():
    """Conv1dNet trained on the synthetic keyword task."""
    from qdsl.zoo.train import trained_conv1d_net

    return trained_conv1d_net()[0]


def keywords():
    """``(x_train, y_train, x_test, y_test)`` of the synthetic keyword task."""
    from qdsl.zoo.train import trained_conv1d_net

    return trained_conv1d_net()[1]

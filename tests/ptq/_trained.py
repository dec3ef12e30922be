"""The trained test models and their calibration sets, shared by the slow PTQ accuracy tests
(imported by the test modules: pytest puts this directory on sys.path)."""

from pathlib import Path

import pytest
import torch

from qdsl.zoo.train import trained_conv1d_net, trained_digits_resnet

SPEC = Path(__file__).resolve().parent.parent.parent / "specs" / "low-bit.qspec"


def calib(x, n=256, seed=0):
    return x[torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:n]]


def bits(b):
    return [f"weight.bits={b}", f"input.bits={b}"]


@pytest.fixture(scope="module")
def digits():
    model, (xtr, _ytr, xte, yte) = trained_digits_resnet()
    return model, calib(xtr), xte, yte


@pytest.fixture(scope="module")
def keywords():
    model, (xtr, _ytr, xte, yte) = trained_conv1d_net()
    return model, calib(xtr), xte, yte

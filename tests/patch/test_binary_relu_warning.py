"""apply's located warning: a signed binary input without a threshold after a ReLU is always +1."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdsl
from qdsl.patch.binary_relu import BinaryAfterReluWarning

SPEC = "specs/xnor-binary.qspec"


class FunctionalRelu(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.a = nn.Conv2d(1, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.c = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = self.a(x)
        x = {"F.relu": F.relu, "torch.relu": torch.relu, "method": lambda v: v.relu(),
             "relu_": lambda v: v.relu_()}[self.how](x)
        x = self.c(F.max_pool2d(self.b(x).clamp(-1, 1), 1))  # c reads a clamp: not warned
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _warnings(model, threshold="none"):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        qdsl.apply(model, SPEC, overrides=[f"input.threshold={threshold}"] if threshold else None)
    return [w.message for w in got if isinstance(w.message, BinaryAfterReluWarning)]


def _tv_style():
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU6(), nn.Dropout(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def test_relu_modules_through_pools_and_dropout_warn_with_a_location():
    (w,) = _warnings(_tv_style())
    (d,) = w.diagnostics
    assert d.code == "W319" and "layers 4, 7" in d.message
    text = str(w)
    assert "xnor-binary.qspec:" in text and "^" in text and "threshold=learned" in text


@pytest.mark.parametrize("how", ["F.relu", "torch.relu", "method", "relu_"])
def test_functional_relu_warns_only_its_reader(how):
    (w,) = _warnings(FunctionalRelu(how))
    assert "layer b " in w.diagnostics[0].message


def test_learned_threshold_or_hardtanh_is_not_warned():
    assert not _warnings(_tv_style(), threshold=None)  # the bundled spec: threshold = learned
    hardtanh = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Hardtanh(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(16, 2))
    assert not _warnings(hardtanh)

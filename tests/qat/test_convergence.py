"""QAT convergence on sklearn's digits (slow set, seeded, minutes at most).

* ``xnor-binary``: a small binary-friendly CNN (conv-BN-hardtanh: sign() of a ReLU output
  would be constantly +1) reaches >= 85 % test accuracy once frozen.
* ``w4a8-per-channel`` and ``pot-asic``: the digits ResNet ends within 1.5 points of its
  float accuracy after QAT (frozen, i.e. the numerics export uses).
"""

from pathlib import Path

import pytest
import torch
from torch import nn

import qdsl.patch
import qdsl.qat
from qdsl import calibrate, freeze
from qdsl.patch import apply
from qdsl.zoo.data import digits
from qdsl.zoo.train import evaluate, train_float, trained_digits_resnet

SPECS = Path(__file__).resolve().parents[2] / "specs"


class BinaryDigitsNet(nn.Module):
    """conv-BN-hardtanh ×3 (+ max pool), GAP, linear; names match xnor-binary's first/last-layer rules."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.Hardtanh(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.Hardtanh(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.Hardtanh(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(2 * width, 10)

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


@pytest.mark.slow
def test_xnor_binary_cnn_reaches_85_percent():
    xtr, ytr, xte, yte = digits()
    torch.manual_seed(0)
    model = train_float(BinaryDigitsNet(), xtr, ytr, epochs=4, lr=0.01, seed=0)
    apply(model, SPECS / "xnor-binary.qspec")
    handle = qdsl.patch.get_handle(model)
    assert handle.quantizer("features.3", "weight").kind.value == "binary"
    calibrate(model, [xtr[i : i + 128] for i in range(0, 512, 128)])
    ptq = evaluate(model, xte, yte)
    qdsl.qat.fit(model, xtr, ytr, epochs=3, lr=0.005)
    freeze(model)
    acc = evaluate(model, xte, yte)
    assert acc >= 0.85, (ptq, acc)
    assert acc > ptq


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["w4a8-per-channel.qspec", "pot-asic.qspec"])
def test_qat_within_1p5_points_of_float(spec):
    model, (xtr, ytr, xte, yte) = trained_digits_resnet()
    float_acc = evaluate(model, xte, yte)
    apply(model, SPECS / spec)
    calibrate(model, [xtr[i : i + 128] for i in range(0, 512, 128)])
    qdsl.qat.fit(model, xtr, ytr, epochs=1, lr=5e-4)
    freeze(model)
    acc = evaluate(model, xte, yte)
    assert acc >= float_acc - 0.015, (float_acc, acc)

"""xnor-binary (learned thresholds) on unmodified ReLU CNNs reaches >= 90 % on digits after
15 epochs of QAT (issue 23); benchmarks/binary_threshold_digits.py prints the figures,
with and without thresholds (without: chance, every binary input is +1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import qdsl
from qdsl.export import export
from qdsl.graph import execute
from qdsl.qat import fit
from qdsl.zoo.data import digits
from qdsl.zoo.models import conv_bn_relu_net, tv_style_net
from qdsl.zoo.train import evaluate, train_float

SPEC = Path(__file__).resolve().parents[2] / "specs" / "xnor-binary.qspec"


@pytest.mark.slow
@pytest.mark.parametrize("make", [lambda: conv_bn_relu_net(in_ch=1), tv_style_net], ids=["conv_bn_relu", "tv_style"])
def test_xnor_with_learned_thresholds_reaches_90_percent_on_relu_cnns(make):
    xtr, ytr, xte, yte = digits()
    model = train_float(make(), xtr, ytr, epochs=20)
    qdsl.apply(model, SPEC)  # as shipped: binary(signed, threshold=learned)
    qdsl.calibrate(model, [xtr[i:i + 256] for i in range(0, 512, 256)])
    fit(model, xtr, ytr, epochs=15, lr=1e-3)
    qdsl.freeze(model)
    acc = evaluate(model, xte, yte)
    assert acc >= 0.90, acc
    # the frozen model exports, and the integer graph agrees with it
    x = xte[:200]
    with torch.no_grad():
        fq = model(x).numpy()
    res = execute(export(model, x[:2]), x.numpy())
    assert (res.outputs[0].argmax(1) == fq.argmax(1)).mean() >= 0.99
    assert np.abs(res.outputs[0] - fq).max() < 1e-3

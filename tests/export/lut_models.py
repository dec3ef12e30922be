"""Shared by tests/export/test_lut.py and tests/runtime/test_lut.py: conv -> activation ->
conv -> linear models for every construct that lowers to a LUT, and two specs (the bundled
int8-default: uint8 asymmetric activations; and a signed symmetric int8 one)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import qdsl
from qdsl.export import export
from qdsl.parse import parse_text

ROOT = Path(__file__).resolve().parents[2]

# the activation reads conv1's quantized output (its lookup table indexes 8-bit codes)
_LAYER_OUTPUTS = "\nrule c1 {\n  output = a8\n}\nrule fc {\n  output = a8\n}\n"

SIGNED = """
version 1
fold_bn
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, signed, symmetric, per_tensor, observer=minmax)
defaults {
  weight = w8
  input = a8
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
"""


def spec_text(name: str) -> str:
    base = (ROOT / "specs" / "int8-default.qspec").read_text() if name == "int8-default" else SIGNED
    return base + _LAYER_OUTPUTS


SPECS = ("int8-default", "signed-int8")

ACTS = {
    "Hardswish": nn.Hardswish,
    "Hardsigmoid": nn.Hardsigmoid,
    "SiLU": nn.SiLU,
    "Sigmoid": nn.Sigmoid,
    "Tanh": nn.Tanh,
    "GELU": nn.GELU,
    "GELU-tanh": lambda: nn.GELU(approximate="tanh"),
    "LeakyReLU": lambda: nn.LeakyReLU(0.1),
    "F.hardswish": lambda: F.hardswish,
    "F.hardsigmoid": lambda: F.hardsigmoid,
    "F.silu": lambda: F.silu,
    "torch.sigmoid": lambda: torch.sigmoid,
    "torch.tanh": lambda: torch.tanh,
    "F.gelu": lambda: F.gelu,
    "F.leaky_relu": lambda: (lambda x: F.leaky_relu(x, 0.2)),
}


class ActNet(nn.Module):
    """conv -> act -> conv -> flatten -> linear; ``act`` a module or a function."""

    def __init__(self, act):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        if isinstance(act, nn.Module):
            self.act = act
        else:
            self.fn = act
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        y = self.c1(x)
        y = self.act(y) if hasattr(self, "act") else self.fn(y)
        return self.fc(self.flat(self.c2(y)))


def exported(act: str, spec: str):
    """``(model, graph, x)``: the calibrated, frozen fake-quant model, its graph and test inputs."""
    torch.manual_seed(0)
    model = ActNet(ACTS[act]()).eval()
    calib, x = torch.randn(256, 3, 6, 6) * 1.5, torch.randn(128, 3, 6, 6) * 1.5
    qdsl.apply(model, parse_text(spec_text(spec), "test.qspec"))
    qdsl.calibrate(model, [calib[:128], calib[128:]])
    qdsl.freeze(model)
    return model, export(model, x[:2]), x

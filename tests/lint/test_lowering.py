"""W321 agrees with export construct by construct: on a small linear model with one construct
between two quantized layers, lint reports W321 exactly when ``qdsl.export`` refuses the
model, both read from the construct table (qdsl/graph/catalog.py)."""

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdsl
from qdsl.export.values import ExportError
from qdsl.lint import lint

SPEC = "specs/int8-default.qspec"

CONSTRUCTS = {
    # refused by export: no lowering in the table (even no-ops), or indexing a tensor
    "mul by a constant": lambda x: operator.mul(x, 0.5),
    "Tensor.mul by a constant": lambda x: x.mul(2),
    "mean": lambda x: torch.mean(x, dim=1, keepdim=True).repeat(1, 16),
    "clamp": lambda x: torch.clamp(x, 0, 1),
    "dropout": lambda x: F.dropout(x, 0.1, training=False),
    "AlphaDropout": nn.AlphaDropout(0.1),
    "getitem": lambda x: x[:, :8].repeat(1, 2),
    # lowered
    "relu": F.relu,
    "Hardswish": nn.Hardswish(),
    "view of size": lambda x: x.view(x.size()[0], -1),
    "flatten": lambda x: torch.flatten(x, 1),
    "add": lambda x: x + x,
    "mul": lambda x: operator.mul(x, x),
    "softmax": nn.Softmax(dim=1),
}
REFUSED = {"mul by a constant", "Tensor.mul by a constant", "mean", "clamp", "dropout", "AlphaDropout", "getitem"}


class Between(nn.Module):
    def __init__(self, construct):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 4)
        self.c = construct if isinstance(construct, nn.Module) else None
        self.f = None if self.c is not None else construct

    def forward(self, x):
        y = torch.relu(self.fc1(x))
        return self.fc2(self.c(y) if self.c is not None else self.f(y))


@pytest.mark.parametrize("name", list(CONSTRUCTS))
def test_w321_exactly_when_export_refuses(name):
    torch.manual_seed(0)
    model = Between(CONSTRUCTS[name]).eval()
    found = [d for d in lint(SPEC, "specs/hw/tflite-int8.toml", model) if d.code == "W321"]
    qdsl.apply(model, SPEC)
    x = torch.randn(8, 16)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    try:
        qdsl.export(model, x[:1])
        refused = False
    except ExportError:
        refused = True
    assert refused == (name in REFUSED)
    assert bool(found) == refused, [d.message for d in found]

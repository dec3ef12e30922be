"""Bare-layer models (a model that IS one nn.Conv1d / nn.Conv2d / nn.Linear, or an
nn.Sequential of one such layer) with specs/int8-default.qspec unedited: apply -> a training
forward/backward -> calibrate -> freeze -> export; C++ == reference, and the graph's float
output (the layer's int32 accumulator, dequantized: the spec quantizes no output) is within
one accumulator step of the fake-quant model's (the integer bias is the float bias rounded
at that step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import qdsl
import qdsl.runtime as rt
from qdsl.graph import execute
from qdsl.graph.ir import OpType

BUILDS = {
    "Linear": (lambda: nn.Linear(24, 5), (6, 24), OpType.LINEAR),
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), (4, 3, 16), OpType.CONV1D),
    "Conv2d": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (4, 3, 9, 9), OpType.CONV2D),
    "Sequential(Linear)": (lambda: nn.Sequential(nn.Linear(24, 5)), (6, 24), OpType.LINEAR),
    "Sequential(Conv2d)": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1)), (4, 3, 9, 9), OpType.CONV2D),
    "Sequential(Conv2d, BN)": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)), (4, 3, 9, 9),
                               OpType.CONV2D),
}


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_bare_layer_flow_with_int8_default(name):
    build, shape, op_type = BUILDS[name]
    torch.manual_seed(0)
    model = build()
    handle = qdsl.apply(model, "specs/int8-default.qspec")
    model.train()
    model(torch.randn(*shape)).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.eval()
    qdsl.calibrate(model, [torch.randn(*shape) for _ in range(4)])
    qdsl.freeze(model)
    x = torch.randn(*shape)
    graph = qdsl.export(model, x)
    assert [op.type for op in graph.ops] == [OpType.QUANTIZE, op_type, OpType.DEQUANTIZE]
    got = execute(graph, x.numpy()).outputs[0]
    if rt.available():
        np.testing.assert_array_equal(rt.CompiledGraph(graph).run(x.numpy()), got)
    with torch.no_grad():
        fq = model(x).numpy()
    layer = next(op for op in graph.ops if op.type is op_type)
    fqn = "" if layer.name == "<model>" else layer.name  # the model itself, or its one child
    s_in = float(handle.quantizer(fqn, "input").scale)
    s_w = np.asarray(handle.quantizer(fqn, "weight").scale, dtype=np.float64).reshape(-1)
    step = (s_in * s_w).reshape((1, -1) + (1,) * (got.ndim - 2))
    assert np.all(np.abs(got - fq) <= step * 1.01)

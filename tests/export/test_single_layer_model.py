"""A model that IS one quantized layer (a bare nn.Linear / Conv1d / Conv2d) exports, runs on
both backends like the fake-quant model, and lints with the layer as first and last layer.

fx traces a root module's forward, never the root as a call, so these models used to fail
with "the forward reads the tensor attribute 'weight' directly"."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import qdsl
import qdsl.runtime as rt
from qdsl.graph.ir import OpType
from qdsl.graph.reference import execute
from qdsl.lint import lint
from qdsl.lint.graph import model_graph
from qdsl.parse import parse_text

SPEC = """version 1
quantizer w = int(bits=8, signed, narrow, symmetric, {scale} per_channel, observer=minmax)
quantizer a = int(bits=8, signed, {zp}, {scale} per_tensor, observer=minmax)
defaults {{
  weight = w
  input = a
  output = a
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}}
"""

LAYERS = {
    "Linear": (lambda: nn.Linear(24, 5), (6, 24), OpType.LINEAR),
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), (4, 3, 16), OpType.CONV1D),
    "Conv2d": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (4, 3, 9, 9), OpType.CONV2D),
}


@pytest.mark.parametrize("pot", [True, False], ids=["pot", "float"])
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_bare_layer_exports_and_runs(layer, pot):
    build, shape, op_type = LAYERS[layer]
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(*shape)
    text = SPEC.format(scale="scale=pot," if pot else "", zp="symmetric" if pot else "asymmetric")
    qdsl.apply(model, parse_text(text, "bare.qspec"))
    qdsl.calibrate(model, [torch.randn(*shape) for _ in range(3)] + [x])
    qdsl.freeze(model)
    graph = qdsl.export(model, x[:2])
    assert [op.type for op in graph.ops] == [OpType.QUANTIZE, op_type, OpType.DEQUANTIZE]
    with torch.no_grad():
        fq = model(x).numpy()
    got = execute(graph, x.numpy()).outputs[0]
    step = float(qdsl.patch.get_handle(model).quantizer("", "output").scale)
    lsb = np.rint(np.abs(got.astype(np.float64) - fq) / step)
    if pot:
        np.testing.assert_array_equal(got, fq)  # power-of-two scales: bit-exact
    else:
        assert lsb.max() <= 1  # one layer, one rounding (FIXED_SINGLE): float32 ties at most
    if rt.available():
        np.testing.assert_array_equal(rt.CompiledGraph(graph).run(x.numpy()), got)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_bare_layer_is_first_and_last_for_lint(layer):
    model = LAYERS[layer][0]()
    g = model_graph(model)
    assert g.traced and g.first == g.last == frozenset({""})
    # xnor-fpga allows 8-bit weights and inputs only on the first and last layers
    text = ('version = 1\n[defaults]\nweight = { kind = "int", bits = 8, granularity = "channel" }\n'
            'input = { kind = "int", bits = 8 }\n')
    assert [d.code for d in lint(parse_text(text, "t.qspec.toml"), "xnor-fpga", model)] == []

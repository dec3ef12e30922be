"""Frozen fake quantization computes the integer graph's LAYERNORM and SOFTMAX(_MASKED)
(qdsl.patch.int_sim): on hypothesis-generated input codes the fake-quant model's output equals
the exported graph's, run by the reference executor, bit for bit; the gradient is the float
formula's (straight-through); calibration still runs the float ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qdsl
from qdsl.graph import execute
from qdsl.graph.ir import OpType
from qdsl.graph.ops.softmax_masked import softmax_masked
from qdsl.parse import parse_text
from qdsl.patch.handle import get_handle
from qdsl.patch.int_sim import grid_of
from qdsl.patch.softmax_roles import quantized_softmax

from tests.export.attn_models import TEL_SPEC

SPEC = """
version 1
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
defaults { input = a8 }
rule type:LayerNorm optional { input = a8 }
rule type:Softmax optional { input = a8  output = a8 }
"""
N = 24


def _frozen(model: nn.Module, scale: float = 3.0):
    torch.manual_seed(0)
    qdsl.apply(model, parse_text(SPEC, "t.qspec"))
    qdsl.calibrate(model, [torch.randn(16, 5, N) * scale])
    qdsl.freeze(model)
    graph = qdsl.export(model, torch.zeros(1, 5, N))
    return graph, grid_of(get_handle(model).layers["0"].iq)


@pytest.fixture(scope="module")
def norm():
    torch.manual_seed(3)
    model = nn.Sequential(nn.LayerNorm(N, eps=1e-3))
    with torch.no_grad():
        model[0].weight.normal_()
        model[0].bias.normal_()
    graph, grid = _frozen(model)
    assert [op.type for op in graph.ops] == [OpType.QUANTIZE, OpType.LAYERNORM, OpType.DEQUANTIZE]
    return model, graph, grid


@pytest.fixture(scope="module")
def soft():
    model = nn.Sequential(nn.Softmax(dim=-1))
    graph, grid = _frozen(model)
    assert OpType.SOFTMAX in [op.type for op in graph.ops]
    return model, graph, grid


def _on_grid(codes: np.ndarray, grid) -> torch.Tensor:
    s, zp = grid[0], grid[1]
    return torch.from_numpy(((codes - zp) * s).astype(np.float32))


row = st.lists(st.integers(0, 255), min_size=N, max_size=N)
rows = st.lists(st.lists(row, min_size=5, max_size=5), min_size=1, max_size=3)  # (batch, 5, N) codes


@settings(max_examples=40, deadline=None)
@given(rows)
def test_layernorm_equals_the_graph_bit_for_bit(norm, codes):
    model, graph, grid = norm
    x = _on_grid(np.asarray(codes, dtype=np.int64), grid)
    with torch.no_grad():
        fq = model(x).numpy()
    np.testing.assert_array_equal(fq, execute(graph, x.numpy()).outputs[0])


@settings(max_examples=40, deadline=None)
@given(rows)
def test_softmax_equals_the_graph_bit_for_bit(soft, codes):
    model, graph, grid = soft
    x = _on_grid(np.asarray(codes, dtype=np.int64), grid)
    with torch.no_grad():
        fq = model(x).numpy()
    np.testing.assert_array_equal(fq, execute(graph, x.numpy()).outputs[0])


@settings(max_examples=40, deadline=None)
@given(rows, st.data())
def test_masked_softmax_equals_softmax_masked(soft, codes, data):
    # the scores/probs roles' softmax (Hugging Face attention: masked entries at finfo.min)
    # against the reference SOFTMAX_MASKED with the exporter's table and output stage
    model, graph, grid = soft
    handle = get_handle(model)
    sq, pq = handle.layers["0"].iq, handle.layers["0"].oq
    codes = np.asarray(codes, dtype=np.int64)
    keep = np.asarray(data.draw(st.lists(st.booleans(), min_size=N, max_size=N)))  # a key mask
    x = _on_grid(codes, grid).masked_fill(torch.from_numpy(~keep), torch.finfo(torch.float32).min)
    with torch.no_grad():
        p = quantized_softmax(x, -1, sq, pq, "t").numpy()
    op = next(op for op in graph.ops if op.type is OpType.SOFTMAX)
    a = dict(op.attrs, mask_dims=(-1, -1, 0), mask_attend=(1,))
    want = softmax_masked(codes, [keep.astype(np.int32)], a)
    s_p, zp_p = grid_of(pq)[:2]
    np.testing.assert_array_equal(np.rint(p / s_p).astype(np.int64) + zp_p, want)


def test_simulation_differs_from_float_and_keeps_the_float_gradient(norm):
    model, graph, grid = norm
    ln = model[0]
    torch.manual_seed(5)
    x = _on_grid(torch.randint(0, 256, (4, 5, N)).numpy(), grid).requires_grad_()
    y = model(x)
    y.square().sum().backward()
    g_sim = x.grad.clone()
    # the float formula on the same (fake-quantized: on-grid) input, without qdsl's hooks
    x2 = x.detach().clone().requires_grad_()
    y_float = torch.nn.functional.layer_norm(x2, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
    assert not torch.equal(y.detach(), y_float.detach())  # the integer result, not the float one
    (y_float + (y.detach() - y_float).detach()).square().sum().backward()
    torch.testing.assert_close(g_sim, x2.grad)


def test_calibration_runs_the_float_layernorm():
    torch.manual_seed(3)
    model = nn.Sequential(nn.LayerNorm(N))
    x = torch.randn(4, 5, N)
    qdsl.apply(model, parse_text(SPEC, "t.qspec"))
    qdsl.calibrate(model, [x])
    handle = get_handle(model)
    with torch.no_grad():
        before = model(x)
        want = torch.nn.functional.layer_norm(handle.layers["0"].iq(x), (N,))
    torch.testing.assert_close(before, want, rtol=0, atol=0)  # not frozen: float
    qdsl.freeze(model)
    with torch.no_grad():
        assert not torch.equal(model(x), before)


PRE_NORM_SPEC = TEL_SPEC


class _PreNormStack(nn.Module):
    """embed -> two pre-norm nn.TransformerEncoderLayers -> head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_pre_norm_encoder_layers_add_the_first_residual_sum_as_the_graph_does():
    """A frozen pre-norm layer's output is norm2's input codes plus ff (PreNormResidualSim), the
    graph's second ADD: every output code equal (adding the float first sum: ~65% in
    tests/export/test_mha.py's encoder); the gradient still flows (straight-through)."""
    torch.manual_seed(2)
    model = _PreNormStack().eval()
    qdsl.apply(model, parse_text(PRE_NORM_SPEC, "t.qspec"))
    qdsl.calibrate(model, [torch.randn(32, 6, 8)])
    qdsl.freeze(model)
    x = torch.randn(4, 6, 8)
    graph = qdsl.export(model, x[:1])
    with torch.no_grad():
        fq = model(x).numpy()
    s = float(get_handle(model).quantizer("head", "output").scale)
    np.testing.assert_array_equal(np.rint(fq / s), np.rint(execute(graph, x.numpy()).outputs[0] / s))
    xg = x.clone().requires_grad_()
    model(xg).sum().backward()
    assert xg.grad is not None and float(xg.grad.abs().sum()) > 0

"""Learned binarisation thresholds in the integer graph (qdsl/export/lower_threshold.py).

Bit-exact: the fake-quant model's binary codes (``int_repr`` of each thresholded input)
equal the reference executor's BIN tensors, and the C++ runtime equals the reference on
every path; odd channel counts, thresholds anywhere (beyond the value range: always/never;
on an actual value: the tie, +1), max pools between, and both producers: a layer's
accumulator (its bias becomes -k[c]) and an 8-bit output quantizer (BINARIZE_CHANNEL).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from torch import nn

import qdsl
import qdsl.runtime as rt
from qdsl.export import export
from qdsl.export.onnx import export_onnx
from qdsl.export.values import ExportError
from qdsl.graph import execute, graph_from_bytes, graph_to_bytes
from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Tensor
from qdsl.parse import parse_text
from qdsl.patch.handle import get_handle
from tests.runtime.test_graph import _check

SPEC = """version 1
fold_bn
quantizer wbin = binary(signed, per_channel, observer=mean_abs)
quantizer abin = binary(signed, per_tensor, observer=mean_abs, threshold=learned)
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, signed, asymmetric, per_tensor, observer=minmax)
defaults {
  weight = wbin
  input = abin
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
rule @first { weight = w8  input = a8 }
rule @last { weight = w8  input = a8 }
rule type:AdaptiveAvgPool2d { output = a8 }
"""
OUTPUT_A8 = "\nrule b1 { output = a8 }\n"


class Net(nn.Module):
    """int8 stem -> ReLU -> max pool -> binary conv (c1) -> ReLU -> max pool (3, padded) ->
    binary conv (c2) -> ReLU -> GAP -> int8 linear; odd channel counts."""

    def __init__(self, c0: int, c1: int, c2: int):
        super().__init__()
        self.stem = nn.Conv2d(1, c0, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(c0)
        self.b1 = nn.Conv2d(c0, c1, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c1)
        self.b2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c2, 3)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.bn0(self.stem(x))), 2)
        x = nn.functional.max_pool2d(torch.relu(self.bn1(self.b1(x))), 3, 1, 1)
        x = nn.functional.relu(self.b2(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def _frozen(seed: int, chans, output_a8: bool, spread: float, ties: bool):
    torch.manual_seed(seed)
    m = Net(*chans)
    for bn in (m.bn0, m.bn1):  # non-trivial folded biases
        bn.running_mean.uniform_(-0.3, 0.3)
        bn.running_var.uniform_(0.5, 2.0)
        bn.bias.data.uniform_(-0.5, 0.5)
    m.eval()
    qdsl.apply(m, parse_text(SPEC + (OUTPUT_A8 if output_a8 else ""), "t.qspec"))
    x = torch.rand(16, 1, 8, 8)
    qdsl.calibrate(m, [x])
    h = get_handle(m)
    g = torch.Generator().manual_seed(seed)
    outs = {}
    hooks = [getattr(m, n).register_forward_hook(lambda mod, a, y, n=n: outs.__setitem__(n, y.detach()))
             for n in ("b1", "b2")]
    with torch.no_grad():
        m(x)
    for hk in hooks:
        hk.remove()
    for reader, producer in (("b1", None), ("b2", "b1")):
        q = h.layers[reader].iq
        c = q.sign_threshold.numel()
        with torch.no_grad():
            t = q.sign_threshold + spread * torch.randn(c, generator=g)
            if ties and producer is not None:
                # a threshold exactly on a value the reader sees (after the ReLU): the tie is +1
                seen = outs[producer].relu()
                t = torch.where(torch.arange(c) % 2 == 0, seen[0, :, 1, 1].float(), t)
            q.sign_threshold.copy_(t)
    qdsl.freeze(m)
    return m


def _fake_codes(m, x):
    h, codes, hooks = get_handle(m), {}, []
    for name in ("b1", "b2"):
        iq = h.layers[name].iq
        hooks.append(getattr(m, name).register_forward_pre_hook(
            lambda mod, a, n=name, q=iq: codes.__setitem__(n, q.int_repr(a[0]).numpy()), prepend=True))
    with torch.no_grad():
        out = m(x).numpy()
    for hk in hooks:
        hk.remove()
    return codes, out


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**20), chans=st.sampled_from([(3, 5, 7), (5, 3, 9), (7, 7, 3), (1, 3, 5)]),
       output_a8=st.booleans(), spread=st.sampled_from([0.0, 0.3, 3.0]), ties=st.booleans())
def test_fake_quant_codes_equal_graph_and_cpp(seed, chans, output_a8, spread, ties):
    m = _frozen(seed, chans, output_a8, spread, ties)
    x = torch.rand(6, 1, 8, 8)
    codes, out = _fake_codes(m, x)
    try:
        graph = graph_from_bytes(graph_to_bytes(export(m, x[:2])))
    except ExportError as e:  # a random BN that kills every b1 output: mean|x| ~ 0 leaves no int32 bias
        assume("does not fit int32" not in str(e))
        raise
    types = {op.type for op in graph.ops}
    assert OpType.BCONV2D in types and (OpType.BINARIZE_CHANNEL in types) == output_a8
    res = execute(graph, x.numpy(), keep_values=True)
    for op in graph.ops:
        if op.type is OpType.BCONV2D:
            name = op.name.split(":")[0]
            np.testing.assert_array_equal(res.values[op.inputs[0]], codes[name], err_msg=name)
    np.testing.assert_allclose(res.outputs[0], out, atol=1e-4)
    if rt.available():
        _check(graph, x.numpy())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), c=st.sampled_from([1, 3, 5, 7, 9]), u8=st.booleans())
def test_binarize_channel_reference_equals_cpp(seed, c, u8):
    rng = np.random.default_rng(seed)
    dt = DType.U8 if u8 else DType.I8
    lo, hi = dt.range
    t = tuple(int(v) for v in rng.integers(lo, hi + 2, size=c))  # lo: always +1, hi + 1: always -1
    shape = (-1, c, 3, 2)
    graph = IntegerGraph([Tensor("x", dt, shape), Tensor("y", DType.BIN, shape)], ["x"], ["y"],
                         [Op(OpType.BINARIZE_CHANNEL, "thr", ["x"], ["y"], {"thresholds": t})]).validate()
    x = rng.integers(lo, hi + 1, size=(2, c, 3, 2)).astype(np.uint8 if u8 else np.int8)
    x[0, :, 0, 0] = t[:c] if max(t) <= hi else np.minimum(t, hi)  # the tie
    got = execute(graph, [x]).outputs[0]
    want = np.where(x.astype(np.int64) < np.asarray(t).reshape(1, c, 1, 1), -1, 1)
    np.testing.assert_array_equal(got, want)
    if rt.available():
        _check(graph, x)


def test_out_of_range_thresholds_are_refused_by_validation():
    graph = IntegerGraph([Tensor("x", DType.I8, (-1, 2)), Tensor("y", DType.BIN, (-1, 2))], ["x"], ["y"],
                         [Op(OpType.BINARIZE_CHANNEL, "thr", ["x"], ["y"], {"thresholds": (0, 300)})])
    with pytest.raises(Exception, match="out of range"):
        graph.validate()


def test_threshold_on_the_float_input_is_refused_with_its_location():
    m = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Flatten(), nn.Linear(3 * 36, 2))
    spec = SPEC.replace("rule @first { weight = w8  input = a8 }", "").replace(
        "rule type:AdaptiveAvgPool2d { output = a8 }", "")
    qdsl.apply(m, parse_text(spec, "t.qspec"))
    qdsl.calibrate(m, [torch.rand(4, 1, 8, 8)])
    qdsl.freeze(m)
    with pytest.raises(ExportError, match="'0:input'.*float graph input") as info:
        export(m, torch.rand(2, 1, 8, 8))
    assert "quantize the model input to 8 bits" in str(info.value)


def test_threshold_across_a_flatten_is_refused():
    m = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 5), nn.ReLU(), nn.Linear(5, 2))
    qdsl.apply(m, parse_text(SPEC.replace("rule type:AdaptiveAvgPool2d { output = a8 }", ""), "t.qspec"))
    qdsl.calibrate(m, [torch.rand(4, 1, 8, 8)])
    qdsl.freeze(m)
    with pytest.raises(ExportError, match="3:input.*144 channels"):
        export(m, torch.rand(2, 1, 8, 8))


def test_onnx_refuses_a_learned_threshold():
    pytest.importorskip("onnx")  # without it, export_onnx says to install qdsl[onnx] first
    m = _frozen(0, (3, 5, 7), True, 0.3, False)
    with pytest.raises(ExportError, match="learned binarisation threshold|BIN activations"):
        export_onnx(m, torch.rand(2, 1, 8, 8))

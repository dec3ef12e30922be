"""QUANTIZE_DYNAMIC and LINEAR_DYNAMIC (docs/qgraph.md §4.4): the C++ runtime equals the
reference executor bit for bit (random shapes, per tensor and per row, signed/unsigned,
symmetric/affine, non-finite inputs), the reference's scales, zero points and codes are
the fake-quant dynamic quantizer's, an exported dynamic MLP agrees with its fake-quant
model, and malformed graphs and unlowerable specs are refused with a located error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qdsl
import qdsl.runtime as rt
from qdsl.export.values import ExportError
from qdsl.parse import parse_text
from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, Tensor
from qdsl.graph.ops.dynamic import f32_bits, quantize_dynamic
from qdsl.graph.reference import execute
from qdsl.spec.diagnostics import SpecError

from tests.runtime.test_graph import _check

needs_cpp = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")


def _qd_attrs(signed: bool, symmetric: bool, per_row: bool, rounding: int = 1) -> dict:
    qmin, qmax = (-128, 127) if signed else (0, 255)
    return dict(qmin=qmin, qmax=qmax, symmetric=int(symmetric), per_row=int(per_row), rounding=rounding)


def _dyn_graph(shape, qd: dict, w: np.ndarray, wdtype=DType.I8, w_scale=None, bias=None, relu=False,
               validate=True) -> IntegerGraph:
    qdt = DType.I8 if qd["qmin"] < 0 else DType.U8
    cout = w.shape[0]
    w_scale = np.full(cout, 0.01, np.float32) if w_scale is None else w_scale
    tensors = [Tensor("x", DType.F32, shape), Tensor("q", qdt, shape), Tensor("qp", DType.F32, shape[:-1] + (2,)),
               Tensor("w", wdtype, w.shape, w), Tensor("y", DType.F32, shape[:-1] + (cout,))]
    ops = [Op(OpType.QUANTIZE_DYNAMIC, "fc", ["x"], ["q", "qp"], qd),
           Op(OpType.LINEAR_DYNAMIC, "fc", ["q", "qp", "w"], ["y"],
              {"w_scale": f32_bits(w_scale), "bias": () if bias is None else f32_bits(bias), "relu": int(relu)})]
    g = IntegerGraph(tensors, ["x"], ["y", "q", "qp"], ops)
    return g.validate() if validate else g


def _data(rng, shape, nonfinite: bool) -> np.ndarray:
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)
    if rng.random() < 0.3:
        x = np.abs(x) * rng.choice([-1, 1])  # one-sided data (unsigned symmetric grids take -lo)
    if x.ndim and rng.random() < 0.3:
        x[(0,) * (x.ndim - 1)] = 0.0  # an all-zero row: the tiny scale
    if nonfinite:
        flat = x.reshape(-1)
        idx = rng.choice(flat.size, size=min(3, flat.size), replace=False)
        flat[idx] = rng.choice([np.nan, np.inf, -np.inf], size=idx.size)
    return x


@needs_cpp
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), signed=st.booleans(), symmetric=st.booleans(), per_row=st.booleans(),
       rank=st.sampled_from([2, 3]), wdtype=st.sampled_from([DType.I8, DType.I4, DType.I2]),
       rounding=st.sampled_from([0, 1, 2]), relu=st.booleans(), with_bias=st.booleans(), nonfinite=st.booleans())
def test_cpp_matches_reference(seed, signed, symmetric, per_row, rank, wdtype, rounding, relu, with_bias, nonfinite):
    rng = np.random.default_rng(seed)
    k, cout = int(rng.choice([1, 3, 16, 33, 64])), int(rng.choice([1, 5, 16, 17]))
    shape = (-1,) + ((int(rng.integers(1, 4)),) if rank == 3 else ()) + (k,)
    lo, hi = wdtype.range
    w = rng.integers(lo, hi + 1, (cout, k))
    w_scale = rng.uniform(1e-4, 0.1, cout).astype(np.float32)
    bias = rng.standard_normal(cout).astype(np.float32) if with_bias else None
    g = _dyn_graph(shape, _qd_attrs(signed, symmetric, per_row, rounding), w, wdtype, w_scale, bias, relu)
    x = _data(rng, (int(rng.integers(1, 9)),) + shape[1:], nonfinite)
    _check(g, x)


def test_reference_linear_is_the_scaled_integer_product():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    w = rng.integers(-127, 128, (3, 6))
    s_w = np.array([0.02, 0.01, 0.005], np.float32)
    b = np.array([0.5, -1.0, 0.0], np.float32)
    g = _dyn_graph((-1, 6), _qd_attrs(False, False, True), w, w_scale=s_w, bias=b)
    y, q, qp = execute(g, x).outputs
    acc = (q.astype(np.int64) - qp[:, 1:2].astype(np.int64)) @ w.T
    want = (acc.astype(np.float32) * (qp[:, 0:1] * s_w[None, :])) + b
    np.testing.assert_array_equal(y, want.astype(np.float32))
    # and it approximates the float product within the quantization error
    np.testing.assert_allclose(y, x @ (w * s_w[:, None]).T + b, atol=4 * float(qp[:, 0].max()) * np.abs(w * s_w[:, None]).sum(1).max())


_GRANULARITY = {False: "per_tensor", True: "granularity=channel(0)"}


def _spec(signed: bool, symmetric: bool, per_row: bool, rounding: str = "half_even"):
    return parse_text(_spec_text(signed, symmetric, per_row, rounding), "dynamic.qspec")


def _spec_text(signed: bool, symmetric: bool, per_row: bool, rounding: str = "half_even") -> str:
    sign = "signed" if signed else "unsigned"
    sym = "symmetric" if symmetric else "asymmetric"
    return f"""version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer d8 = int(bits=8, {sign}, {sym}, {_GRANULARITY[per_row]}, observer=minmax, rounding={rounding}, dynamic)
rule type:Linear {{
  weight = w8
  input = d8
  bias = float
}}
"""


def _mlp(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).eval()


@pytest.mark.parametrize("signed,symmetric,per_row", [(False, False, False), (True, True, False),
                                                      (False, True, True), (True, False, True)])
def test_quantize_dynamic_equals_the_fake_quantizer(signed, symmetric, per_row):
    m = _mlp()
    handle = qdsl.apply(m, _spec(signed, symmetric, per_row))
    qdsl.freeze(m)
    x = torch.randn(7, 24) * 3
    x[2] = 0.0  # a zero row
    q = handle.quantizer("0", "input")
    scale, zp, _ = q.qparams(x)
    codes = q.int_repr(x).numpy().astype(np.int64)
    got_q, got_qp = quantize_dynamic(x.numpy(), _qd_attrs(signed, symmetric, per_row))
    rows = x.shape[0]
    np.testing.assert_array_equal(got_qp[:, 0], np.broadcast_to(scale.float().reshape(-1).numpy(), (rows,)))
    np.testing.assert_array_equal(got_qp[:, 1], np.broadcast_to(zp.float().reshape(-1).numpy(), (rows,)))
    np.testing.assert_array_equal(got_q, codes)


@pytest.mark.parametrize("signed,symmetric,per_row", [(False, False, False), (True, True, True)])
def test_exported_mlp_equals_fake_quant(signed, symmetric, per_row):
    m = _mlp(3)
    qdsl.apply(m, _spec(signed, symmetric, per_row))
    qdsl.freeze(m)
    x = torch.randn(16, 24)
    g = qdsl.export(m, x)
    assert [op.type for op in g.ops] == [OpType.QUANTIZE_DYNAMIC, OpType.LINEAR_DYNAMIC] * 3
    assert [op.attrs["relu"] for op in g.ops[1::2]] == [1, 1, 0]  # the ReLUs fused
    for xb in (x, x * 50, torch.randn(3, 24)):  # the scales follow each batch
        y = execute(g, xb.numpy()).outputs[0]
        with torch.no_grad():
            yf = m(xb).numpy()
        # the float operation order differs (F.linear of dequantized values vs the scaled
        # int32 accumulator), the codes do not: equal to binary32 rounding
        np.testing.assert_allclose(y, yf, rtol=1e-4, atol=1e-5 * float(np.abs(yf).max()))
        if rt.available():
            got = rt.CompiledGraph(g).run(xb.numpy())
            np.testing.assert_array_equal(got, y)


def test_dynamic_spec_example_exports():
    m = _mlp(4)
    qdsl.apply(m, "specs/int8-dynamic.qspec")
    qdsl.freeze(m)
    g = qdsl.export(m, torch.randn(2, 24))
    assert OpType.LINEAR_DYNAMIC in {op.type for op in g.ops}


# ---------------------------------------------------------------- refusals
def _bad_graphs():
    w = np.ones((4, 8), np.int64)
    qd = _qd_attrs(True, True, False)
    good = _dyn_graph((-1, 8), qd, w, validate=False)
    t = list(good.tensors)
    yield "expected F32", IntegerGraph([*t[:2], Tensor("qp", DType.I32, (-1, 2)), *t[3:]], good.inputs,
                                       good.outputs, good.ops)
    yield "shape", IntegerGraph([*t[:2], Tensor("qp", DType.F32, (-1, 3)), *t[3:]], good.inputs, good.outputs, good.ops)
    ops = list(good.ops)
    yield "output", IntegerGraph(t, good.inputs, ["y"], [Op(OpType.QUANTIZE_DYNAMIC, "fc", ["x"], ["q"], qd), ops[1]])
    yield "w_scale", IntegerGraph(t, good.inputs, good.outputs, [ops[0], Op(
        OpType.LINEAR_DYNAMIC, "fc", ["q", "qp", "w"], ["y"], {**ops[1].attrs, "w_scale": f32_bits(np.ones(3))})])
    yield "w_scale", IntegerGraph(t, good.inputs, good.outputs, [ops[0], Op(
        OpType.LINEAR_DYNAMIC, "fc", ["q", "qp", "w"], ["y"], {**ops[1].attrs, "w_scale": f32_bits([1, 1, -1, 1])})])
    yield "qmin", IntegerGraph(t, good.inputs, good.outputs, [Op(OpType.QUANTIZE_DYNAMIC, "fc", ["x"], ["q", "qp"],
                                                                 {**qd, "qmin": 5, "qmax": 5}), ops[1]])


@pytest.mark.parametrize("i", range(6))
def test_bad_graphs_refused_by_both_loaders(i):
    what, g = list(_bad_graphs())[i]
    with pytest.raises(GraphFormatError) as e:
        g.validate()
    assert "op " in str(e.value) and "fc" in str(e.value), str(e.value)
    if rt.available():
        with pytest.raises(GraphFormatError) as e:
            rt.CompiledGraph(g)
        assert "fc" in str(e.value) or "qp" in str(e.value), str(e.value)


def test_unlowerable_dynamic_specs_name_the_module():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()
    qdsl.apply(m, parse_text("""version 1
rule type:Conv2d {
  weight = int(bits=8, signed, symmetric, per_channel, observer=minmax)
  input = int(bits=8, signed, symmetric, per_tensor, observer=minmax, dynamic)
}
""", "conv.qspec"))
    qdsl.freeze(m)
    with pytest.raises(ExportError) as e:
        qdsl.export(m, torch.randn(1, 3, 8, 8))
    assert "'0'" in str(e.value) and "dynamic input" in str(e.value) and "Conv2d" in str(e.value)

    m = _mlp()
    qdsl.apply(m, parse_text(_spec_text(True, True, False).replace("observer=minmax, rounding", "observer=histogram, rounding"), "d.qspec"))
    qdsl.freeze(m)
    with pytest.raises(ExportError) as e:
        qdsl.export(m, torch.randn(2, 24))
    assert "'0:input'" in str(e.value) and "minmax" in str(e.value)

    m = _mlp()
    qdsl.apply(m, parse_text(_spec_text(True, True, False).replace("bias = float", "bias = int(bits=32, signed, scale=input*weight)"), "d.qspec"))
    qdsl.freeze(m)
    with pytest.raises(ExportError) as e:
        qdsl.export(m, torch.randn(2, 24))
    assert "'0'" in str(e.value) and "bias" in str(e.value)


def test_onnx_export_dynamic_quantize_linear_and_matmul_integer():
    ort = pytest.importorskip("onnxruntime")
    from qdsl.export.onnx import export_onnx

    m = _mlp(5)
    qdsl.apply(m, _spec(False, False, False))
    qdsl.freeze(m)
    x = torch.randn(6, 24)
    proto = export_onnx(m, x)
    kinds = [n.op_type for n in proto.graph.node]
    assert kinds.count("DynamicQuantizeLinear") == 3 and kinds.count("MatMulInteger") == 3
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"input": x.numpy()})[0]
    g = qdsl.export(m, x)
    want = execute(g, x.numpy()).outputs[0]
    # ONNX divides by the scale where the graph multiplies by its f32 reciprocal: a code may
    # move by 1 where the quotient sits on a rounding boundary; otherwise the same integers
    np.testing.assert_allclose(y, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max()))

    m = _mlp(5)
    qdsl.apply(m, _spec(True, True, True))
    qdsl.freeze(m)
    with pytest.raises(ExportError) as e:
        export_onnx(m, x)
    assert "'0'" in str(e.value) and "DynamicQuantizeLinear" in str(e.value)


def test_qgraph_file_round_trips_two_outputs(tmp_path):
    from qdsl.graph.qgraph import graph_from_bytes, graph_to_bytes

    w = np.arange(-12, 12).reshape(3, 8)
    g = _dyn_graph((-1, 4, 8), _qd_attrs(True, False, True), w, bias=np.array([1.5, -2.0, 0.25], np.float32),
                   relu=True)
    back = graph_from_bytes(graph_to_bytes(g))
    assert back == g and back.ops[0].outputs == ("q", "qp")
    x = np.random.default_rng(3).standard_normal((2, 4, 8)).astype(np.float32)
    for a, b in zip(execute(back, x).outputs, execute(g, x).outputs):
        np.testing.assert_array_equal(a, b)


def test_static_and_dynamic_layers_mix():
    # a static Linear without an output quantizer feeds a dynamic one (its int32 result is
    # dequantized), whose float result feeds a static QUANTIZE of the next layer's input
    m = _mlp(6)
    qdsl.apply(m, parse_text("""version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
quantizer d8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax, dynamic)
defaults {
  weight = w8
  input = a8
  bias = float
}
rule "2" {
  input = d8
}
""", "mix.qspec"))
    xs = [torch.randn(16, 24) for _ in range(4)]
    qdsl.calibrate(m, xs)
    qdsl.freeze(m)
    g = qdsl.export(m, xs[0])
    types = [op.type for op in g.ops]
    assert OpType.QUANTIZE_DYNAMIC in types and OpType.LINEAR in types
    assert types.index(OpType.DEQUANTIZE) < types.index(OpType.QUANTIZE_DYNAMIC) < types.index(OpType.LINEAR_DYNAMIC)
    y = execute(g, xs[1].numpy()).outputs[0]
    with torch.no_grad():
        yf = m(xs[1]).numpy()
    # the static layers round their int32 sums to the output grid as the fake-quant model does
    # (within 1 LSB on a few codes): compare at the output's scale
    assert np.abs(y - yf).max() <= 0.05 * np.abs(yf).max()
    if rt.available():
        np.testing.assert_array_equal(rt.CompiledGraph(g).run(xs[1].numpy()), y)


@pytest.mark.parametrize("dynamic_conv", [True, False])
def test_lint_reports_what_export_refuses(dynamic_conv):
    # lint's W321 (no integer lowering) for a dynamic quantizer outside a Linear's input,
    # exactly where export refuses (tests/export/test_lint_agrees.py's rule)
    text = f"""version 1
quantizer d8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax, dynamic)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
defaults {{
  weight = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
  input = {'d8' if dynamic_conv else 'a8'}
  bias = float
}}
rule type:Linear {{
  input = d8
}}
"""

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.Linear(6, 5)).eval()  # Linear over L

    spec = parse_text(text, "dyn.qspec")
    found = [d for d in qdsl.lint(spec, "specs/hw/tflite-int8.toml", model()) if d.code == "W321"]
    m = model()
    qdsl.apply(m, spec)
    x = torch.randn(4, 3, 8)
    qdsl.calibrate(m, [x])
    qdsl.freeze(m)
    if dynamic_conv:
        with pytest.raises(ExportError) as e:
            qdsl.export(m, x[:1])
        assert len(found) == 1 and "dynamic input of conv1d" in found[0].message and "'0'" in str(e.value)
    else:
        assert found == []
        g = qdsl.export(m, x[:1])
        assert OpType.LINEAR_DYNAMIC in {op.type for op in g.ops}



# ---------------------------------------------------------------- per-token dynamic scales
_TOKEN_SPEC = """version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer t8 = int(bits=8, SIGN, SYM, per_token, observer=minmax, dynamic)
rule type:Linear {
  weight = w8
  input = t8
  bias = float
}
"""


@pytest.mark.parametrize("signed,symmetric", [(False, False), (True, True)])
def test_per_token_scales_on_rank3_inputs_equal_quantize_dynamic_and_the_graph(signed, symmetric):
    """`per_token`: one run-time scale per row of the last axis of a (batch, tokens, features)
    input; the fake quantizer's codes and scales equal QUANTIZE_DYNAMIC's per_row on the same
    tensor, and an exported Linear stack (rank-3 input) equals the fake-quant model, C++ too.
    Before: granularity 'token' was unknown (and channel(0) on a rank-3 input, one scale per
    sample, was refused at export)."""
    torch.manual_seed(5)
    m = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    text = _TOKEN_SPEC.replace("SIGN", "signed" if signed else "unsigned").replace(
        "SYM", "symmetric" if symmetric else "asymmetric")
    handle = qdsl.apply(m, parse_text(text, "token.qspec"))
    qdsl.freeze(m)
    x = torch.randn(3, 7, 24) * torch.logspace(-2, 1, 7)[None, :, None]  # tokens of very different ranges
    x[1, 2] = 0.0  # a zero token
    q = handle.quantizer("0", "input")
    codes = q.int_repr(x.reshape(-1, 24)).numpy().astype(np.int64)
    scale, zp, _ = q.qparams(x.reshape(-1, 24))
    got_q, got_qp = quantize_dynamic(x.numpy(), _qd_attrs(signed, symmetric, True))
    np.testing.assert_array_equal(got_q.reshape(-1, 24), codes)
    np.testing.assert_array_equal(got_qp.reshape(-1, 2)[:, 0], scale.float().reshape(-1).numpy())
    np.testing.assert_array_equal(got_qp.reshape(-1, 2)[:, 1], zp.float().reshape(-1).numpy())
    assert len(set(got_qp.reshape(-1, 2)[:, 0].tolist())) > 3  # one scale per token, not per sample
    with torch.no_grad():
        fq = m(x).numpy()
        fq_flat = m(x.reshape(-1, 24)).numpy()  # the same rows seen as a (rows, features) batch
    np.testing.assert_array_equal(fq.reshape(-1, 8), fq_flat)
    g = qdsl.export(m, x[:1])
    qd = [op for op in g.ops if op.type is OpType.QUANTIZE_DYNAMIC]
    assert len(qd) == 2 and all(op.attrs["per_row"] == 1 for op in qd)
    y = execute(g, x.numpy()).outputs[0]
    np.testing.assert_allclose(y, fq, rtol=1e-4, atol=1e-5 * float(np.abs(fq).max()))
    if rt.available():
        np.testing.assert_array_equal(rt.CompiledGraph(g).run(x.numpy()), y)


@pytest.mark.parametrize("line,what", [
    ("quantizer t8 = int(bits=8, unsigned, per_token, observer=minmax)", "input"),  # not dynamic
    ("quantizer t8 = int(bits=8, signed, per_token, dynamic)", "weight"),  # a weight
])
def test_per_token_outside_dynamic_activations_is_a_located_error(line, what):
    text = f"""version 1
{line}
rule type:Linear {{
  {what} = t8
}}
"""
    m = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(SpecError) as e:
        qdsl.apply(m, parse_text(text, "token.qspec"))
    msg = str(e.value)
    assert "token.qspec:" in msg and ("E212" in msg or "E219" in msg)

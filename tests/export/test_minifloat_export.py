"""Minifloat and microscaling weights in the integer graph and in ONNX (issue 22).

* The integer graph takes a minifloat weight when each output channel's values are exact
  int8 codes times one scale (qdsl/export/exact_weights.py): FP4 per channel always, MXFP4
  while a row's block exponents span few binades.  With power-of-two scales the graph
  (reference and C++) then equals the fake-quant model bit for bit.  Otherwise export
  refuses, naming the layer, the format and the channel.
* ONNX: FP8 weights become DequantizeLinear of FLOAT8E4M3FN / FLOAT8E5M2 tensors (opset 19),
  which onnxruntime runs; the result agrees with the fake-quant model (below).  Weights ONNX
  has no runnable type for (FP6, FP4, MX) are written as int8 only through the same exact
  decode, else refused like the integer graph.
* Minifloat activations have no integer lowering: export refuses naming the place.
"""

import numpy as np
import pytest
import torch
from torch import nn

import qdsl
from qdsl.export.values import ExportError
from qdsl.graph.ir import DType
from qdsl.patch.handle import get_handle
from qdsl.runtime.run import run_graph

A8POT = "int(bits=8, signed, symmetric, scale=pot, per_tensor)"


def _spec(weight: str, act: str = A8POT) -> str:
    return f"version 1\ndefaults {{\n  weight = {weight}\n  input = {act}\n  output = {act}\n}}\n"


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32, bias=False), nn.ReLU(), nn.Linear(32, 10, bias=False))


def _convnet(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 3 * 3, 10))


def _prepared(model, spec, x):
    qdsl.apply(model, qdsl.parse_spec(spec))
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    return model


def _cpp_equals_reference(g, x):
    ref = run_graph(g, x, backend="reference")
    try:
        cpp = run_graph(g, x, backend="cpp")
    except Exception as e:  # pragma: no cover - the native runtime is optional
        pytest.skip(f"no C++ runtime: {e}")
    assert np.array_equal(cpp, ref)
    return ref


@pytest.mark.parametrize("weight", [
    "fp4_e2m1(per_channel, scale=pot)",
    "fp4_e2m1(granularity=group(32), scale=pot)",        # MXFP4
    "fp6_e2m3(granularity=group(32), scale=pot)",        # MXFP6 (E2M3)
    # NVFP4 (fp8 block scales under a pot tensor scale) on rows of one block: the block
    # scale is the row's; rows of several blocks need the blocks' e4m3 scales to share a grid
    "fp4_e2m1(granularity=group(16), scale=fp8_e4m3)",
])
def test_decodable_minifloat_weights_run_bit_exact(weight):
    width, hidden = (16, 16) if "group(16)" in weight else (64, 32)
    x = torch.randn(128, width)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, hidden, bias=False), nn.ReLU(), nn.Linear(hidden, 16, bias=False))
    m = _prepared(model, _spec(weight), x)
    g = qdsl.export(m, x[:2])
    assert {t.dtype for t in g.tensors if t.name.endswith(".weight")} <= {DType.I8, DType.I4}
    ref = _cpp_equals_reference(g, x.numpy())
    with torch.no_grad():
        fq = m(x).numpy()
    assert np.array_equal(ref, fq)


def test_fp4_per_channel_float_scales_agree_like_int8():
    x = torch.randn(128, 64)
    m = _prepared(_mlp(), _spec("fp4_e2m1(per_channel)", "int(bits=8, signed, symmetric, per_tensor)"), x)
    g = qdsl.export(m, x[:2])
    ref = _cpp_equals_reference(g, x.numpy())
    with torch.no_grad():
        fq = m(x).numpy()
    # float scales: the graph's fixed-point rescale vs the float product, as for int8 (docs/qgraph.md §6)
    step = float(get_handle(m).layers["2"].oq.scale)
    assert np.abs(ref - fq).max() <= step * 1.001
    assert (ref == fq).mean() > 0.97


def test_mx_weights_spanning_too_many_binades_are_refused_with_layer_and_format():
    x = torch.randn(64, 64)
    model = _mlp()
    with torch.no_grad():
        model[0].weight[3, 32:] *= 2.0**-10  # row 3: its second block is 10 binades below its first
    m = _prepared(model, _spec("fp4_e2m1(granularity=group(32), scale=pot)"), x)
    with pytest.raises(ExportError, match=r"cannot export '0'.*fp4_e2m1.*output channel 3") as info:
        qdsl.export(m, x[:2])
    assert "int8" in str(info.value)


def test_fp8_weights_are_refused_by_the_integer_graph():
    x = torch.randn(64, 64)
    m = _prepared(_mlp(), _spec("fp8_e4m3(per_channel)"), x)
    with pytest.raises(ExportError, match=r"cannot export '0': fp8_e4m3 weights have no exact int8 form: output "
                                          r"channel \d+") as info:
        qdsl.export(m, x[:2])
    # located at the spec's weight line; the ONNX route named
    assert "export_onnx writes them as FLOAT8" in str(info.value)
    assert "the weight's kind is written at <input>:3:" in str(info.value)


def test_minifloat_activations_are_refused_where_they_are():
    x = torch.randn(64, 64)
    m = _prepared(_mlp(), _spec("fp4_e2m1(per_channel, scale=pot)", "fp8_e4m3(scale=pot)"), x)
    # the place lint's W321 names (tests/lint/test_minifloat_profiles.py)
    with pytest.raises(ExportError, match=r"cannot export '0:input': fp8_e4m3 activations have no integer lowering"):
        qdsl.export(m, x[:2])


# ---------------------------------------------------------------- ONNX
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from qdsl.export.onnx import BLOCK_OPSET, FLOAT8_OPSET, export_onnx  # noqa: E402


def _ort(proto, x):
    basic = ort.SessionOptions()
    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(proto.SerializeToString(), basic).run(None, {"input": x})[0]


@pytest.mark.parametrize("fmt,onnx_type", [("fp8_e4m3", "FLOAT8E4M3FN"), ("fp8_e5m2", "FLOAT8E5M2")])
def test_fp8_weights_export_as_float8_qdq_and_run_in_onnxruntime(fmt, onnx_type):
    x = torch.randn(96, 3, 8, 8)
    m = _prepared(_convnet(), _spec(f"{fmt}(per_channel)"), x)
    proto = export_onnx(m, x[:2])
    assert proto.opset_import[0].version == FLOAT8_OPSET
    f8 = [i for i in proto.graph.initializer if i.data_type == getattr(onnx.TensorProto, onnx_type)]
    assert {i.name.split("__")[0] for i in f8} >= {"0.weight", "2.weight", "5.weight"}
    dq_inputs = {n.input[0].split("__")[0] for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    assert {"0.weight", "2.weight", "5.weight"} <= dq_inputs
    # the float8 weights decode to the fake-quant model's weights exactly
    from onnx.numpy_helper import to_array

    w0 = next(i for i in f8 if i.name.startswith("0.weight__"))
    scale = next(to_array(i) for i in proto.graph.initializer if i.name.startswith("0.weight_scale"))
    with torch.no_grad():
        fq_w = m[0].weight  # the parametrized (fake-quant) weight
    decoded = to_array(w0).astype(np.float32) * scale.reshape(-1, 1, 1, 1)
    assert np.array_equal(decoded, fq_w.numpy())
    y = _ort(proto, x.numpy())
    with torch.no_grad():
        fq = m(x).numpy()
    # the same float products in another summation order: an output code can flip by one
    # step where the sum lies at a rounding boundary (measured: printed below)
    lsb = float(get_handle(m).layers["5"].oq.scale)
    err, flips = float(np.abs(y - fq).max()), float((y != fq).mean())
    print(f"\n{fmt}: onnxruntime vs fake-quant max |diff| {err / lsb:.3g} output steps, {flips:.2%} of outputs differ")
    assert err <= lsb and flips <= 0.02


def test_fp4_weights_reach_onnx_as_exact_int8():
    x = torch.randn(64, 64)
    m = _prepared(_mlp(), _spec("fp4_e2m1(granularity=group(32), scale=pot)"), x)
    proto = export_onnx(m, x[:2])
    assert all(i.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.FLOAT, onnx.TensorProto.INT32)
               for i in proto.graph.initializer)
    y = _ort(proto, x.numpy())
    with torch.no_grad():
        assert np.array_equal(y, m(x).numpy())


def test_mx_weights_onnx_refusal_is_located():
    # MXFP6 E3M2 spans 8 binades inside a block: Gaussian weights need codes beyond int8
    x = torch.randn(64, 64)
    m = _prepared(_mlp(), _spec("fp6_e3m2(granularity=group(32), scale=pot)"), x)
    with pytest.raises(ExportError, match=r"cannot export '0': fp6_e3m2 weights with group\(32\) scales have no exact "
                                          r"int8 form: output channel \d+ needs codes up to \d+"):
        export_onnx(m, x[:2])


def test_mxfp8_weights_export_as_blocked_float8_qdq():
    """MXFP8: fp8 elements with a power-of-two scale per 32 along the flattened row, as
    DequantizeLinear with block_size (opset 21); a conv's [C, in·k·k] rows are reshaped back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 2), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 4 * 4, 32))
    x = torch.randn(96, 8, 5, 5)
    m = _prepared(model, _spec("fp8_e4m3(granularity=group(32), scale=pot)"), x)
    proto = export_onnx(m, x[:2])
    assert proto.opset_import[0].version == BLOCK_OPSET
    blocked = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"
               and any(a.name == "block_size" and a.i == 32 for a in n.attribute)]
    assert {n.input[0].split("__")[0] for n in blocked} == {"0.weight", "3.weight"}
    y = _ort(proto, x.numpy())
    with torch.no_grad():
        fq = m(x).numpy()
    lsb = float(get_handle(m).layers["3"].oq.scale)
    err, flips = float(np.abs(y - fq).max()), float((y != fq).mean())
    print(f"\nMXFP8: onnxruntime vs fake-quant max |diff| {err / lsb:.3g} output steps, {flips:.2%} of outputs differ")
    assert err <= lsb and flips <= 0.02


@pytest.mark.parametrize("act", ["fp8_e4m3(per_tensor)", "fp8_e5m2(per_tensor, scale=pot)"])
def test_fp8_activations_export_as_float8_quantize_linear(act):
    """W8A8 FP8: every activation quantizer is QuantizeLinear -> DequantizeLinear with a
    float8 zero point; onnxruntime's cast of x / s is the fake quantizer's rounding."""
    x = torch.randn(96, 3, 8, 8)
    m = _prepared(_convnet(), _spec("fp8_e4m3(per_channel)", act), x)
    proto = export_onnx(m, x[:2])
    f8 = {onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E5M2}
    inits = {i.name: i.data_type for i in proto.graph.initializer}
    q = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    assert q and all(inits[n.input[2]] in f8 for n in q)
    y = _ort(proto, x.numpy())
    with torch.no_grad():
        fq = m(x).numpy()
    lsb_rel = 2.0 ** -(2 if "e5m2" in act else 3)  # one step of the format's mantissa, relative
    rel = np.abs(y - fq) / np.maximum(np.abs(fq), 1e-30)
    flips = float((y != fq).mean())
    print(f"\n{act}: {flips:.2%} of outputs differ from fake-quant, max relative {rel.max():.3g}")
    assert flips <= 0.02 and float(rel[y != fq].max(initial=0)) <= lsb_rel * 1.001


def test_fp8_activation_before_a_lookup_table_is_refused_in_onnx():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(64, 16)
    m = _prepared(model, _spec("fp8_e4m3(per_channel)", "fp8_e4m3(per_tensor)"), x)
    with pytest.raises(ExportError, match=r"LUT reads or writes an FP8 activation"):
        export_onnx(m, x[:2])


def test_fp8_residual_net_exports_to_onnx():
    """A ResNet (folded BN, residual adds read by two consumers) in W8A8 FP8: the layer a
    residual reads twice writes its float8 weight twice, under unique names (fails before:
    'initializer name is not unique')."""
    from qdsl.zoo.data import digits
    from qdsl.zoo.models import digits_resnet

    data = digits()
    m = digits_resnet(seed=0, width=8).eval()
    spec = ("version 1\nfold_bn\ndefaults {\n  weight = fp8_e4m3(per_channel)\n  input = fp8_e4m3(per_tensor)\n}\n"
            "rule type:BasicBlock optional { output = fp8_e4m3(per_tensor) }\n")
    m = _prepared(m, spec, data[0][:256])
    x = data[2][:200]
    y = _ort(export_onnx(m, x[:2]), x.numpy())
    with torch.no_grad():
        fq = m(x).numpy()
    # the classifier's output is float (summation order: ~1e-7 everywhere); an inner FP8 code
    # flipped at a rounding boundary moves a value by one step (1/8 relative for e4m3)
    rel = np.abs(y - fq) / np.abs(fq).max()
    print(f"\ndigits ResNet W8A8 FP8: outputs within 1e-4 of max |y|: {(rel <= 1e-4).mean():.2%}, "
          f"max |diff| {rel.max():.2%} of max |y|")
    assert (y.argmax(1) == fq.argmax(1)).all()
    assert (rel <= 1e-4).mean() >= 0.95 and rel.max() <= 0.05


def test_mxfp4_spec_weights_on_a_resnet_run_in_the_integer_graph():
    """specs/mxfp4.qspec's MXFP4 weights (rows of 9·C end in a shorter block) with int8 inputs
    instead of its fp8 ones: every layer decodes to int8, the C++ runtime equals the
    reference, and top-1 matches the fake-quant model (folded BN biases are float, rounded
    to int32 at s_x·s_w: not bit-exact)."""
    from qdsl.zoo.data import digits
    from qdsl.zoo.models import digits_resnet

    data = digits()
    m = digits_resnet(seed=0, width=8).eval()
    qdsl.apply(m, "specs/mxfp4.qspec", overrides=["input=int(bits=8, signed, symmetric, scale=pot, per_tensor)"])
    qdsl.calibrate(m, [data[0][:256]])
    qdsl.freeze(m)
    x = data[2][:200]
    g = qdsl.export(m, x[:2])
    ref = _cpp_equals_reference(g, x.numpy())
    with torch.no_grad():
        fq = m(x).numpy()
    assert (ref.argmax(1) == fq.argmax(1)).mean() >= 0.99


def test_lint_on_the_frozen_model_reports_what_export_refuses(tmp_path):
    """With a frozen model lint runs export's decode on the actual weights: W320 at the spec's
    weight line naming layer, format and channel exactly when export refuses."""
    spec = tmp_path / "m.qspec"
    x = torch.randn(64, 64)
    for weight, refused in (("fp8_e4m3(per_channel)", True), ("fp4_e2m1(granularity=group(32), scale=pot)", False)):
        spec.write_text(_spec(weight))
        m = _prepared(_mlp(), _spec(weight), x)
        found = [d for d in qdsl.lint(str(spec), "ocp-mx", m) if d.code == "W320"]
        try:
            qdsl.export(m, x[:2])
            err = None
        except ExportError as e:
            err = str(e)
        assert (err is not None) == refused == bool(found), (weight, err, [d.message for d in found])
        if refused:
            assert "cannot export '0'" in err and any(d.message.startswith("'0': fp8_e4m3 weights") for d in found)
            assert {d.span.line for d in found} == {3} and found[0].span.file == str(spec)

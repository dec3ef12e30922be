"""ONNX QDQ export checked with onnxruntime (skipped without the ``qdsl[onnx]`` extra).

Tolerance (stated): power-of-two specs agree with the fake-quant model exactly; float-scale
8-bit specs to within 1 % of the largest output magnitude, with identical top-1. The
residue comes from onnxruntime dividing by the scale in QuantizeLinear where torch's
fake quantization multiplies by the float32 reciprocal (a rare one-code flip), and from
float summation order.

The agreement is checked with onnxruntime's graph optimizations at the basic level, which
runs QuantizeLinear/DequantizeLinear and float Conv/Gemm as written. At the full level
onnxruntime fuses them into QLinearConv/MatMulInteger; on CPUs without VNNI its u8·s8
kernel (``vpmaddubsw``) saturates pairs of products at int16 (onnxruntime's documented
limit, fixed by ``reduce_range`` 7-bit weights), which on an AVX2 machine moved this
model's outputs by 6 % of their maximum: there only top-1 agreement is required.
"""

import numpy as np
import pytest
import torch

import qdsl
from qdsl.export.values import ExportError
from qdsl.zoo.data import digits
from qdsl.zoo.models import conv1d_net, digits_resnet

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from qdsl.export.onnx import export_onnx  # noqa: E402


@pytest.fixture(scope="module")
def data():
    return digits()


@pytest.mark.parametrize("spec", ["int8-default", "pot-asic"])
def test_qdq_model_runs_in_onnxruntime_and_agrees(spec, data, tmp_path):
    model = digits_resnet(seed=0, width=8).eval()
    qdsl.apply(model, qdsl.load_spec(f"specs/{spec}.qspec"))
    qdsl.calibrate(model, [data[0][:256]])
    qdsl.freeze(model)
    path = tmp_path / "m.onnx"
    proto = export_onnx(model, data[2][:2], path)
    ops = {n.op_type for n in proto.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv", "Add", "Gemm", "GlobalAveragePool"} <= ops
    x = data[2][:200]
    basic = ort.SessionOptions()
    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    y = ort.InferenceSession(str(path), basic).run(None, {"input": x.numpy()})[0]
    fused = ort.InferenceSession(str(path)).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        fq = model(x).numpy()
    assert (fused.argmax(1) == fq.argmax(1)).mean() >= 0.99
    err = float(np.abs(y - fq).max())
    print(f"\n{spec}: onnxruntime vs fake-quant max |diff| {err:.3g} ({err / np.abs(fq).max():.3%} of max |y|)")
    if spec == "pot-asic":
        assert err == 0.0
    else:
        assert err <= 0.01 * np.abs(fq).max()
    assert (y.argmax(1) == fq.argmax(1)).all()


def test_conv1d_net_exports(tmp_path):
    from qdsl.zoo.data import synthetic_keywords

    x = synthetic_keywords(n=300)[0]
    model = conv1d_net(seed=0).eval()
    qdsl.apply(model, qdsl.load_spec("specs/int8-default.qspec"))
    qdsl.calibrate(model, [x[:200]])
    qdsl.freeze(model)
    proto = export_onnx(model, x[:2])
    basic = ort.SessionOptions()
    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(proto.SerializeToString(), basic)
    y = sess.run(None, {"input": x[200:].numpy()})[0]
    with torch.no_grad():
        fq = model(x[200:]).numpy()
    assert np.abs(y - fq).max() <= 0.01 * np.abs(fq).max()


def test_binary_layers_are_rejected(data):
    from .test_agreement import BINARY, BinaryCNN, _prepare

    torch.manual_seed(0)
    model = _prepare(BinaryCNN(), BINARY, data[0][:128])
    with pytest.raises(ExportError, match="BIN activations have no ONNX QDQ form"):
        export_onnx(model, data[2][:2])

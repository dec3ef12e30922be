"""ONNX export of MATMUL (MatMulInteger + QuantizeLinear at 1/factor) and SOFTMAX /
SOFTMAX_MASKED (float Softmax between DequantizeLinear and QuantizeLinear, masks as an
additive 0/-inf tensor), checked with onnxruntime at its basic optimization level (skipped
without onnx/onnxruntime): a masked or unmasked MultiheadAttention runs and agrees with the
integer graph; per op, the share of codes that differ from the graph's is measured (`-s`
prints it) and bounded by 1 LSB."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qdsl.export.lower_attn import softmax_table
from qdsl.graph import execute
from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Tensor
from qdsl.graph.requant import make_rescale
from qdsl.graph.schema import OutputStage, Rounding

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from qdsl.export.lower import export  # noqa: E402
from qdsl.export.onnx import graph_to_onnx  # noqa: E402
from qdsl.patch.handle import get_handle  # noqa: E402

from tests.export.attn_models import cos  # noqa: E402
from tests.export.test_mha_masks import _pipeline  # noqa: E402


def _session(proto):
    basic = ort.SessionOptions()
    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(proto.SerializeToString(), basic)


def _feed(graph, inputs):
    return {n: (t.numpy().astype(np.int32) if t.dtype == torch.bool else t.numpy()) for n, t in zip(graph.inputs, inputs)}


@pytest.mark.parametrize("case", ["kpm-bool", "kpm-float", "kpm+attn", "attn-float-buffer-causal", "attn-3d-input",
                                  "unmasked"])
def test_attention_runs_in_onnxruntime_and_agrees_with_the_graph(case):
    if case == "unmasked":
        from tests.export.test_mha import Model, _pipeline as plain

        torch.manual_seed(1)
        model = Model("mha", need_weights=False)
        _, xt, want, _ = plain(model)
        inputs = (xt,)
    else:
        model, _, inputs, want, _ = _pipeline(case)
    graph, info = export(model, tuple(inputs), with_info=True)
    proto = graph_to_onnx(graph, info)
    assert {"MatMulInteger", "Softmax"} <= {n.op_type for n in proto.graph.node}
    y = _session(proto).run(None, _feed(graph, inputs))[0]
    ref = execute(graph, [t.numpy() for t in inputs]).outputs[0]
    lsb = np.abs(y - ref) / float(get_handle(model).quantizer("head", "output").scale)
    print(f"{case}: onnxruntime vs graph output codes equal {np.mean(lsb < 0.5):.4f}, max {lsb.max():.0f} LSB, "
          f"cos(onnxruntime, float) {cos(y, want):.5f}")
    assert np.mean(lsb < 0.5) >= 0.99 and lsb.max() <= 1.5 and cos(y, want) >= 0.99


def _one_op(op_type, x_shapes, attrs, out_scale, out_zp, out_dtype=DType.U8, masks=(), out_shape=None):
    """F32 inputs -> QUANTIZE (i8, scale 0.05) -> op -> DEQUANTIZE, with its grids."""
    ts, ops, info, names = [], [], {}, []
    for i, shape in enumerate(x_shapes):
        ts += [Tensor(f"x{i}", DType.F32, shape), Tensor(f"q{i}", DType.I8, shape)]
        ops.append(Op(OpType.QUANTIZE, f"q{i}", [f"x{i}"], [f"q{i}"],
                      dict(scale=0.05, zero_point=0, qmin=-128, qmax=127, rounding=int(Rounding.HALF_EVEN))))
        info[f"q{i}"] = (0.05, 0)
        names.append(f"q{i}")
    inputs = [f"x{i}" for i in range(len(x_shapes))]
    for name, dtype, shape in masks:
        ts.append(Tensor(name, dtype, shape))
        inputs.append(name)
        names.append(name)
    out_shape = out_shape or x_shapes[0]
    ts += [Tensor("y", out_dtype, out_shape), Tensor("out", DType.F32, out_shape)]
    ops += [Op(op_type, "op", names, ["y"], attrs),
            Op(OpType.DEQUANTIZE, "dq", ["y"], ["out"], dict(scale=out_scale, zero_point=out_zp))]
    info["y"] = (out_scale, out_zp)
    return IntegerGraph(ts, inputs, ["out"], ops).validate(), info


def _codes_differ(graph, info, feeds, out_scale):
    y = _session(graph_to_onnx(graph, info)).run(None, dict(zip(graph.inputs, feeds)))[0]
    ref = execute(graph, feeds).outputs[0]
    lsb = np.abs(y - ref) / out_scale
    return float(np.mean(lsb > 0.5)), float(lsb.max())


@pytest.mark.parametrize("masked", [False, True])
def test_softmax_codes_differ_from_the_graph_by_at_most_one_lsb(masked):
    rng = np.random.default_rng(0)
    shape = (-1, 4, 64)
    rs = OutputStage(make_rescale(2.0**-30 * 256, Rounding.HALF_EVEN, single=True), 0, 0, 255)
    attrs = {"table": list(softmax_table(0.05)), **rs.attrs()}
    masks = ()
    feeds = [rng.normal(0, 3, (256, 4, 64)).astype(np.float32)]
    op_type = OpType.SOFTMAX
    if masked:
        op_type = OpType.SOFTMAX_MASKED
        attrs.update(mask_dims=(0, -1, 1), mask_attend=(1,))
        masks = (("mask", DType.I32, (-1, 64)),)
        keep = (rng.random((256, 64)) < 0.7).astype(np.int32)
        keep[0] = 0  # a fully masked sample
        feeds.append(keep)
    graph, info = _one_op(op_type, [shape], attrs, 1 / 256, 0, masks=masks)
    share, worst = _codes_differ(graph, info, feeds, 1 / 256)
    print(f"{op_type.name}: {share:.4%} of {256 * 4 * 64} codes differ from the graph's, max {worst:.0f} LSB")
    assert share <= 0.01 and worst <= 1.0


def test_matmul_codes_differ_from_the_graph_by_at_most_one_lsb():
    rng = np.random.default_rng(1)
    a_shape, b_shape = (-1, 4, 10, 32), (-1, 4, 32, 10)
    out_scale = 0.0613
    # a calibrated-looking output scale and attention's 1/sqrt(d) folded in (a decimal factor
    # such as exactly 1/20 would make exact ties, which the graph's fixed-point multiplier
    # breaks one way and onnxruntime's division the other)
    rq = make_rescale(0.05 * 0.05 / 32**0.5 / out_scale, Rounding.HALF_EVEN, single=True)
    attrs = dict(in_zp=(0, 0), a_perm=(0, 1, 2, 3), b_perm=(0, 1, 2, 3), out_perm=(0, 2, 1, 3), **rq.attrs(),
                 out_zp=-3, out_min=-128, out_max=127)
    graph, info = _one_op(OpType.MATMUL, [a_shape, b_shape], attrs, out_scale, -3, DType.I8, out_shape=(-1, 10, 4, 10))
    feeds = [rng.normal(0, 2, (64, 4, 10, 32)).astype(np.float32), rng.normal(0, 2, (64, 4, 32, 10)).astype(np.float32)]
    share, worst = _codes_differ(graph, info, feeds, out_scale)
    print(f"MATMUL: {share:.4%} of {64 * 400} codes differ from the graph's, max {worst:.0f} LSB")
    assert share <= 0.01 and worst <= 1.0

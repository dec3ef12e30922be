"""CONV_TRANSPOSE1D/2D (issue 17): the reference semantics equal PyTorch's transposed
convolution on integers, the C++ op equals the reference bit for bit (strides 1-3,
padding, output_padding, groups, dilation, I8/U8 inputs, zero points, narrow and wrapping
accumulators), and malformed ops are refused on both sides."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt
from qdsl.graph.ir import DType, GraphFormatError, OpType, Tensor
from qdsl.graph.ops.conv_transpose import conv_transpose
from tests.runtime.test_graph import _graph, _rand, _stage

_WDTYPES = [DType.I8, DType.U8, DType.I4, DType.U4, DType.I2]


def _geometry(draw_rng, rank):
    rng = draw_rng
    while True:
        k = [int(rng.integers(1, 5)) for _ in range(rank)]
        s = [int(rng.integers(1, 4)) for _ in range(rank)]
        d = [int(rng.integers(1, 3)) for _ in range(rank)]
        op = [int(rng.integers(0, max(a, b))) for a, b in zip(s, d)]
        p = [int(rng.integers(0, 3)) for _ in range(rank)]
        sp = [int(rng.integers(1, 7)) for _ in range(rank)]
        out = [(sp[i] - 1) * s[i] - 2 * p[i] + d[i] * (k[i] - 1) + op[i] + 1 for i in range(rank)]
        if min(out) >= 1:
            return k, s, d, op, p, sp


def _case(rng, rank, xdtype, wdtype, out, groups, bias, acc_bits):
    k, s, d, op, p, sp = _geometry(rng, rank)
    cg, og = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    cin, cout = cg * groups, og * groups
    w = _rand(rng, wdtype, (cin, og, *k))
    w_zp = [int(v) for v in rng.integers(*wdtype.range, size=cout if rng.random() < 0.5 else 1)] \
        if rng.random() < 0.5 else [0]
    attrs = {"stride": s, "padding": p, "output_padding": op, "dilation": d, "groups": groups,
             "in_zp": int(rng.integers(*xdtype.range)), "w_zp": w_zp, "acc_bits": acc_bits,
             "overflow": int(rng.integers(0, 2))}
    lo, hi = (-(2**31), 2**31 - 1) if out is DType.I32 else out.range
    attrs.update(_stage(rng, cout, lo, hi, pot=False if out is DType.I32 else None))
    consts = [Tensor("w", wdtype, w.shape, w)]
    if bias:
        consts.append(Tensor("b", DType.I32, (cout,), rng.integers(-3000, 3000, cout)))
    op_type = OpType.CONV_TRANSPOSE1D if rank == 1 else OpType.CONV_TRANSPOSE2D
    graph = _graph(op_type, [("x", xdtype, (-1, cin, *sp))], attrs, out, consts)
    x = _rand(rng, xdtype, (int(rng.integers(1, 3)), cin, *sp))
    return graph, x, attrs


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), rank=st.sampled_from([1, 2]))
def test_reference_accumulator_is_torch_conv_transpose(seed, rank):
    # the reference's exact sum, with an identity output stage read back as I32, is PyTorch's
    # transposed conv of (x - in_zp) and (w - w_zp) in float64 (exact for these magnitudes)
    rng = np.random.default_rng(seed)
    groups = int(rng.integers(1, 4))
    graph, x, a = _case(rng, rank, DType.I8, DType.I8, DType.I32, groups, False, 64)
    w = graph.tensor("w")
    a = dict(a, rq_kind=1, rq_multiplier=[1], rq_shift=[0], rq_rounding=0, out_zp=0, out_min=-(2**31), out_max=2**31 - 1)
    got = conv_transpose(x.astype(np.int64), w, None, a, graph.tensor("y"), {}, "layer")
    cout = w.shape[1] * groups
    zp = np.broadcast_to(np.asarray(a["w_zp"], dtype=np.int64), (cout,))
    cg = w.shape[0] // groups
    # weight row ic belongs to group ic // cg; its column o feeds output channel (ic // cg)·og + o
    zrows = zp.reshape(groups, -1).repeat(cg, axis=0).reshape((w.shape[0], w.shape[1]) + (1,) * rank)
    wt = torch.tensor(w.data.astype(np.int64) - zrows, dtype=torch.float64)
    fn = torch.nn.functional.conv_transpose1d if rank == 1 else torch.nn.functional.conv_transpose2d
    want = fn(torch.tensor(x.astype(np.int64) - a["in_zp"], dtype=torch.float64), wt, stride=a["stride"],
              padding=a["padding"], output_padding=a["output_padding"], dilation=a["dilation"], groups=groups)
    want = np.clip(want.numpy(), -(2**31), 2**31 - 1).astype(np.int64)
    np.testing.assert_array_equal(got, want)



needs_cpp = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")


@needs_cpp
@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), rank=st.sampled_from([1, 2]), xdtype=st.sampled_from([DType.I8, DType.U8]),
       wdtype=st.sampled_from(_WDTYPES), out=st.sampled_from([DType.I8, DType.U8, DType.I32]),
       groups=st.sampled_from([1, 1, 2, 3]), bias=st.booleans(), acc_bits=st.sampled_from([32, 32, 16, 12, 64]))
def test_cpp_equals_reference(seed, rank, xdtype, wdtype, out, groups, bias, acc_bits):
    from tests.runtime.test_graph import _check

    rng = np.random.default_rng(seed)
    graph, x, _ = _case(rng, rank, xdtype, wdtype, out, groups, bias, acc_bits)
    _check(graph, x)


@needs_cpp
def test_cpp_equals_reference_on_a_wide_layer():
    # more output channels than one task's block (64) and a U-Net-like up step (k=2, s=2)
    from tests.runtime.test_graph import _check

    rng = np.random.default_rng(7)
    w = _rand(rng, DType.I8, (40, 70, 2, 2))
    attrs = {"stride": [2, 2], "padding": [0, 0], "output_padding": [0, 0], "dilation": [1, 1], "groups": 1,
             "in_zp": 3, "w_zp": [0], "acc_bits": 32, "overflow": 0, **_stage(rng, 70, 0, 255)}
    graph = _graph(OpType.CONV_TRANSPOSE2D, [("x", DType.U8, (-1, 40, 5, 6))], attrs, DType.U8,
                   [Tensor("w", DType.I8, w.shape, w)])
    _check(graph, _rand(rng, DType.U8, (2, 40, 5, 6)))


@pytest.mark.parametrize("change, message", [
    ({"output_padding": [2, 0]}, "output_padding 2 must be smaller"),
    ({"groups": 4}, "groups=4 must divide"),
    ({"padding": [9, 9]}, "leaves no output"),
])
def test_malformed_ops_are_refused(change, message):
    rng = np.random.default_rng(1)
    w = _rand(rng, DType.I8, (6, 2, 3, 3))
    attrs = {"stride": [2, 2], "padding": [1, 1], "output_padding": [1, 1], "dilation": [1, 1], "groups": 2,
             "in_zp": 0, "w_zp": [0], "acc_bits": 32, "overflow": 0, **_stage(rng, 4, -128, 127)}
    _graph(OpType.CONV_TRANSPOSE2D, [("x", DType.I8, (-1, 6, 4, 4))], attrs, DType.I8, [Tensor("w", DType.I8, w.shape, w)])
    with pytest.raises(GraphFormatError, match=message):
        _graph(OpType.CONV_TRANSPOSE2D, [("x", DType.I8, (-1, 6, 4, 4))], {**attrs, **change}, DType.I8,
               [Tensor("w", DType.I8, w.shape, w)])


@needs_cpp
def test_cpp_refuses_what_validation_refuses():
    # the C++ Prepare checks the op itself (a graph built without Python validation)
    rng = np.random.default_rng(2)
    w = _rand(rng, DType.I8, (4, 2, 3, 3))
    attrs = {"stride": [1, 1], "padding": [0, 0], "output_padding": [1, 1], "dilation": [1, 1], "groups": 1,
             "in_zp": 0, "w_zp": [0], "acc_bits": 32, "overflow": 0, **_stage(rng, 2, -128, 127)}
    from qdsl.graph.ir import IntegerGraph, Op

    tensors = [Tensor("x", DType.I8, (-1, 4, 4, 4)), Tensor("w", DType.I8, w.shape, w), Tensor("y", DType.I8, (-1, 2, 7, 7))]
    graph = IntegerGraph(tensors, ["x"], ["y"], [Op(OpType.CONV_TRANSPOSE2D, "layer", ["x", "w"], ["y"], attrs)])
    with pytest.raises(Exception, match="output_padding"):
        rt.CompiledGraph(graph)


@needs_cpp
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), rank=st.sampled_from([1, 2]), out=st.sampled_from([DType.I8, DType.I32, DType.BIN]),
       groups=st.sampled_from([1, 2, 3]), bias=st.booleans())
def test_cpp_equals_reference_on_binary_transposed_convs(seed, rank, out, groups, bias):
    # a binary transposed conv: BIN input (±1, in_zp 0), ±1 weights held as I8; a BIN output
    # is the accumulator's sign (the C++ op refused a BIN input and output before)
    from tests.runtime.test_graph import _check

    rng = np.random.default_rng(seed)
    k, s, d, op, p, sp = _geometry(rng, rank)
    cg, og = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    cin, cout = cg * groups, og * groups
    w = rng.choice([-1, 1], size=(cin, og, *k)).astype(np.int8)
    attrs = {"stride": s, "padding": p, "output_padding": op, "dilation": d, "groups": groups, "in_zp": 0,
             "w_zp": [0], "acc_bits": 32, "overflow": 0}
    if out is not DType.BIN:
        lo, hi = (-(2**31), 2**31 - 1) if out is DType.I32 else out.range
        attrs.update(_stage(rng, cout, lo, hi, pot=False if out is DType.I32 else None))
    consts = [Tensor("w", DType.I8, w.shape, w)]
    if bias:
        consts.append(Tensor("b", DType.I32, (cout,), rng.integers(-8, 8, cout)))
    from qdsl.graph.ir import IntegerGraph, Op
    from qdsl.graph.validate import infer_output

    op_type = OpType.CONV_TRANSPOSE1D if rank == 1 else OpType.CONV_TRANSPOSE2D
    # a graph input is never BIN: BINARIZE an int8 input first (the sign of x - 0)
    x, xb = Tensor("x", DType.I8, (-1, cin, *sp)), Tensor("xb", DType.BIN, (-1, cin, *sp))
    conv = Op(op_type, "layer", ["xb"] + [t.name for t in consts], ["y"], attrs)
    _, shape = infer_output(1, conv, [xb] + consts, Tensor("y", out, (1,)))
    graph = IntegerGraph([x, xb] + consts + [Tensor("y", out, shape)], ["x"], ["y"],
                         [Op(OpType.BINARIZE, "bin", ["x"], ["xb"], {"zero_point": 0}), conv]).validate()
    _check(graph, _rand(rng, DType.I8, (int(rng.integers(1, 3)), cin, *sp)))

"""Int8 convs on images large enough that IntConvFast (csrc/runtime/ops/conv_fast.cc) cuts
one image's columns into several tiles, each run through the GEMM and the output stage
before the next (the last tile partial, panels ending mid-row), at one and two threads
(two: the tiles of each thread's piece), with a twin conv whose stage reads the same
accumulators: equal to the Python reference executor bit for bit on every kernel path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph import execute  # noqa: E402
from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Tensor  # noqa: E402
from tests.runtime.test_graph import PATHS, _check, _rand, _stage  # noqa: E402


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 2**31), k=st.sampled_from([1, 1, 3]), stride=st.sampled_from([1, 2]),
       out2=st.sampled_from([DType.I8, DType.I32]), wmag=st.sampled_from([128, 16]), threads=st.sampled_from([1, 2]),
       xdtype=st.sampled_from([DType.U8, DType.I8]))
def test_column_tiles_match_reference(seed, k, stride, out2, wmag, threads, xdtype):
    # wmag 16: weights clipped so that AVX2 runs the vpmaddubsw (u8 quad panel) form
    rng = np.random.default_rng(seed)
    cin = int(rng.choice([3, 16, 24]))
    cout = int(rng.choice([40, 96, 150]))
    oh, ow = [(37, 45), (48, 48), (26, 61)][int(rng.integers(0, 3))]
    pad = k // 2
    h, w_ = (oh - 1) * stride + k - 2 * pad, (ow - 1) * stride + k - 2 * pad
    w = np.clip(_rand(rng, DType.I8, (cout, cin, k, k)), -wmag, wmag)
    b = rng.integers(-5000, 5000, cout)
    base = {"stride": [stride, stride], "padding": [pad, pad], "dilation": [1, 1], "groups": 1,
            "in_zp": int(rng.integers(*xdtype.range)), "w_zp": [0], "acc_bits": 32, "overflow": 0}
    a1 = dict(base, **_stage(rng, cout, 0, 255))
    lo, hi = (-(2**31), 2**31 - 1) if out2 is DType.I32 else out2.range
    a2 = dict(base, **_stage(rng, cout, lo, hi, pot=False if out2 is DType.I32 else None))
    consts = [Tensor("w", DType.I8, w.shape, w), Tensor("b", DType.I32, (cout,), b)]
    ops = [Op(OpType.CONV2D, "c1", ["x", "w", "b"], ["y1"], a1), Op(OpType.CONV2D, "c2", ["x", "w", "b"], ["y2"], a2)]
    tensors = [Tensor("x", xdtype, (-1, cin, h, w_)), *consts, Tensor("y1", DType.U8, (-1, cout, oh, ow)),
               Tensor("y2", out2, (-1, cout, oh, ow))]
    graph = IntegerGraph(tensors, ["x"], ["y1", "y2"], ops).validate()
    cg = rt.CompiledGraph(graph)
    before = rt.get_num_threads()
    rt.set_num_threads(threads)
    try:
        for path in PATHS:  # a fresh input per run: a skipped tile would leave the last run's output
            x = _rand(rng, xdtype, (1, cin, h, w_))
            want = execute(graph, [x]).outputs
            got = cg.run(x, path=path)
            for g, wnt in zip(got, want):
                np.testing.assert_array_equal(g, wnt, err_msg=f"path {path}")
    finally:
        rt.set_num_threads(before)


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 2**31), order=st.sampled_from(["input", "conv_first"]), large=st.booleans(),
       k=st.sampled_from([1, 3]), threads=st.sampled_from([1, 2]), out=st.sampled_from([DType.U8, DType.I8]),
       swap=st.booleans())
def test_residual_add_fused_into_gathered_conv_matches_reference(seed, order, large, k, threads, out, swap):
    """A conv whose I32 output feeds only an ADD (ConvParams::fused_add) computes the ADD
    after each column tile's stage on the gathered-panel path too (the executor skips it):
    small images several per GEMM (whole-image blocks) and a large one cut into tiles (row
    pieces), the ADD's other input the graph input or an earlier conv, the conv as either
    ADD input; every path equals the reference."""
    rng = np.random.default_rng(seed)
    cin, cout, (h, w_), batch = (16, 96, (48, 48), 1) if large else (24, 24, (7, 9), 3)
    shape = (-1, cout, h, w_)
    pad = k // 2
    base = {"stride": [1, 1], "padding": [pad, pad], "dilation": [1, 1], "groups": 1, "in_zp": 3, "w_zp": [0],
            "acc_bits": 32, "overflow": 0}
    w1, w2 = (rng.integers(-127, 128, (cout, cin, k, k)).astype(np.int8) for _ in range(2))
    i32 = (-(2**31), 2**31 - 1)
    conv_a = Op(OpType.CONV2D, "a", ["x", "w1"], ["a"], dict(base, **_stage(rng, cout, *i32, pot=False)))
    conv_b = Op(OpType.CONV2D, "b", ["x", "w2"], ["b"], dict(base, **_stage(rng, cout, *i32, pot=False)))
    tensors = [Tensor("x", DType.U8, (-1, cin, h, w_)), Tensor("w1", DType.I8, w1.shape, w1),
               Tensor("w2", DType.I8, w2.shape, w2), Tensor("a", DType.I32, shape), Tensor("y", out, shape)]
    in_rq = {"in_zp": [0, 0], "in_kind": [2, 2], "in_multiplier": [int(v) for v in rng.integers(1 << 30, 1 << 31, 2)],
             "in_shift": [-2, 0], "in_rounding": [int(v) for v in rng.integers(0, 4, 2)]}
    if order == "input":  # the graph input itself (cin == cout channels) as the other ADD input
        tensors[0] = Tensor("x", DType.U8, (-1, cout, h, w_))
        w1 = rng.integers(-127, 128, (cout, cout, k, k)).astype(np.int8)
        tensors[1] = Tensor("w1", DType.I8, w1.shape, w1)
        tensors = [t for t in tensors if t.name != "w2"]
        in_rq["in_zp"] = [0, 3]
        cin = cout
    else:
        tensors.append(Tensor("b", DType.I32, shape))
    other = "x" if order == "input" else "b"
    inputs = ["a", other]
    if swap:  # the conv as the second ADD input, rescales swapped with it
        inputs = [other, "a"]
        in_rq = {key: list(reversed(v)) for key, v in in_rq.items()}
    lo, hi = out.range
    add = Op(OpType.ADD, "add", inputs, ["y"], {**in_rq, "pre_shift": 0, **_stage(rng, 1, lo, hi)})
    ops = [conv_a, add] if order == "input" else [conv_b, conv_a, add]
    graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
    before = rt.get_num_threads()
    rt.set_num_threads(threads)
    try:
        _check(graph, _rand(rng, DType.U8, (batch, cin, h, w_)))
    finally:
        rt.set_num_threads(before)

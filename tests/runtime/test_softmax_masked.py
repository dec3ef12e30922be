"""SOFTMAX_MASKED (docs/qgraph.md §4.4): the C++ runtime equals the Python reference on
random scores, mask placements (key masks, attention masks, a (N·H, L, S) mask, size-1
broadcasts), mask dtypes and polarities, with fully masked rows; the reference is SOFTMAX
of the kept codes; float masks are 0/-inf only; malformed placements are refused by both loaders."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt
from qdsl.export.lower_attn import softmax_table
from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, Tensor
from qdsl.graph.ops.softmax import softmax
from qdsl.graph.ops.softmax_masked import MaskError, softmax_masked
from qdsl.graph.reference import execute

from tests.runtime.test_graph import PATHS, _rand, _stage

needs_cpp = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

_PLAIN = {"rq_kind": 1, "rq_multiplier": [1], "rq_shift": [22], "rq_rounding": 1, "out_zp": -128, "out_min": -128,
          "out_max": 127}


def _graph(x_dtype, x_shape, masks, attrs, out=DType.I8):
    """``masks``: (name, dtype, shape, data or None for a graph input)."""
    ts = [Tensor("x", x_dtype, x_shape)]
    inputs = ["x"]
    for name, d, shape, data in masks:
        ts.append(Tensor(name, d, shape, data))
        if data is None:
            inputs.append(name)
    ts.append(Tensor("y", out, x_shape))
    op = Op(OpType.SOFTMAX_MASKED, "attn.softmax", ["x"] + [m[0] for m in masks], ["y"], attrs)
    return IntegerGraph(ts, inputs, ["y"], [op]).validate()


def _run_both(graph, xs):
    want = execute(graph, xs).outputs[0]
    cg = rt.CompiledGraph(graph)
    for path in PATHS:
        np.testing.assert_array_equal(cg.run(*xs, path=path), want, err_msg=f"path {path}")
    return want


def _mask(rng, dtype, shape, p_masked, attend):
    masked = rng.random(shape) < p_masked
    if dtype is DType.F32:
        return np.where(masked, -np.inf, 0.0).astype(np.float32)
    on = ~masked if attend else masked
    v = rng.integers(1, 3, shape) * (-1 if dtype is DType.I8 else 1)  # any nonzero value counts
    return np.where(on, v, 0).astype(dtype.numpy)


@needs_cpp
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), d=st.sampled_from([DType.I8, DType.U8]), out=st.sampled_from([DType.I8, DType.U8]),
       kinds=st.lists(st.sampled_from(["key", "attn", "attn3", "bcast"]), min_size=1, max_size=2),
       mdt=st.sampled_from([DType.I32, DType.U8, DType.I8, DType.F32]))
def test_softmax_masked_matches_reference(seed, d, out, kinds, mdt):
    rng = np.random.default_rng(seed)
    b, h, length, s = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 6)), \
        int(rng.choice([1, 2, 7, 16, 33]))
    x_shape = (-1, h, length, s)
    p = float(rng.choice([0.0, 0.3, 0.7, 1.0]))
    masks, xs = [], [_rand(rng, d, (b, h, length, s))]
    dims, attend = [], []
    for j, kind in enumerate(kinds):
        a = 0 if mdt is DType.F32 else int(rng.integers(0, 2))
        name = f"m{j}"
        if kind == "key":  # (N, S): a graph input, broadcast over heads and queries
            data = _mask(rng, mdt, (b, s), p, a)
            masks.append((name, mdt, (-1, s), None))
            xs.append(data)
            dims += [0, -1, -1, 1]
        elif kind == "attn":  # (L, S): a constant
            data = _mask(rng, DType.I32, (length, s), p, a)
            masks.append((name, DType.I32, (length, s), data))
            dims += [-1, -1, 0, 1]
        elif kind == "attn3":  # (N·H, L, S): a constant for this batch, one dim over two axes
            data = _mask(rng, DType.U8, (b * h, length, s), p, a)
            masks.append((name, DType.U8, (b * h, length, s), data))
            dims += [0, 0, 1, 2]
        else:  # (N, 1, S) on (N, H, L, S): a size-1 dim broadcasts over its axes
            data = _mask(rng, mdt, (b, 1, s), p, a)
            masks.append((name, mdt, (-1, 1, s), None))
            xs.append(data)
            dims += [0, 1, 1, 2]
        attend.append(a)
    lo, hi = out.range
    attrs = {"table": list(softmax_table(float(rng.choice([0.01, 0.1, 0.5])))), "mask_dims": dims,
             "mask_attend": attend, **_stage(rng, lo=lo, hi=hi)}
    _run_both(_graph(d, x_shape, masks, attrs, out), xs)


@needs_cpp
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("s", [5, 37, 128, 200])
@pytest.mark.parametrize("d,out", [(DType.I8, DType.I8), (DType.U8, DType.U8), (DType.I8, DType.U8)])
def test_many_rows_match_reference(threads, s, d, out):
    """The optimized rows (portable, avx2, ...): 81 rows (several ranges of 16 across the
    threads), row lengths with vector tails, a key mask with a fully masked batch and a batch
    that keeps every key, and an attention mask with single-kept, fully masked and all-kept
    rows (with batch 2's key mask: rows that keep every position, the unmasked row's loops,
    between masked ones), at 1 and 2 threads."""
    rng = np.random.default_rng(s * 7 + threads)
    b, h, length = 3, 3, 9
    key = (rng.random((b, s)) < 0.8).astype(np.int32)
    key[0, 0] = 1
    key[1] = 0  # batch 1: every row fully masked
    key[2] = 1  # batch 2: no padding
    attn = (rng.random((length, s)) < 0.5).astype(np.int32)  # attend 0: nonzero masks
    attn[0] = 1
    attn[0, 0] = 0  # row 0: only position 0 kept (key[0, 0] = 1)
    attn[1] = 1  # row 1: fully masked
    attn[2] = 0  # row 2: the key mask alone
    lo, hi = out.range
    attrs = {"table": list(softmax_table(float(rng.choice([0.01, 0.1])))),
             "mask_dims": [0, -1, -1, 1, -1, -1, 0, 1], "mask_attend": [1, 0], **_stage(rng, lo=lo, hi=hi)}
    g = _graph(d, (-1, h, length, s), [("key", DType.I32, (-1, s), None), ("attn", DType.I32, (length, s), attn)],
               attrs, out)
    rt.set_num_threads(threads)
    try:
        want = _run_both(g, [_rand(rng, d, (b, h, length, s)), key])
    finally:
        rt.set_num_threads(0)
    zp = min(max(attrs["out_zp"], lo), hi)
    assert (want[1] == zp).all() and (want[0, :, 1] == zp).all()
    assert (want[0, :, 0, 1:] == zp).all()


def test_reference_is_softmax_of_the_kept_codes():
    rng = np.random.default_rng(0)
    x = rng.integers(-128, 128, (2, 3, 4, 9))
    key = (rng.random((2, 9)) < 0.6).astype(np.int32)
    key[1] = 0  # batch 1: every row fully masked
    causal = np.triu(np.ones((4, 9), dtype=bool), 1)
    attrs = {"table": list(softmax_table(0.05)), "mask_dims": [0, -1, -1, 1, -1, -1, 0, 1], "mask_attend": [1, 0],
             **_PLAIN}
    got = softmax_masked(x, [key, causal], attrs)
    plain = {"table": attrs["table"], **_PLAIN}
    for n in range(2):
        for h in range(3):
            for i in range(4):
                keep = (key[n] != 0) & ~causal[i]
                row = got[n, h, i]
                assert (row[~keep] == -128).all()  # probability 0: the zero point
                if keep.any():
                    want = softmax(x[n, h, i][keep][None], plain)[0]
                    np.testing.assert_array_equal(row[keep], want)
    assert (got[1] == -128).all()


def test_float_mask_is_zero_or_minus_inf():
    x = np.zeros((1, 2, 3), dtype=np.int64)
    attrs = {"table": list(softmax_table(0.1)), "mask_dims": [0, -1, 1], "mask_attend": [0], **_PLAIN}
    ok = np.array([[0.0, -np.inf, 0.0]], dtype=np.float32)
    y = softmax_masked(x, [ok], attrs)
    assert (y[..., 1] == -128).all() and (y[..., 0] == y[..., 2]).all()
    with pytest.raises(MaskError, match=r"holds -1e\+09 at index \[0, 1\].*0 \(attend\) or -inf"):
        softmax_masked(x, [np.array([[0.0, -1e9, 0.0]], dtype=np.float32)], attrs, "enc.attn")


@needs_cpp
def test_cpp_refuses_a_float_mask_value_and_a_misfit_mask():
    attrs = {"table": list(softmax_table(0.1)), "mask_dims": [0, -1, 1], "mask_attend": [0], **_PLAIN}
    g = _graph(DType.I8, (-1, 2, 3), [("mask", DType.F32, (-1, 3), None)], attrs)
    x = np.zeros((1, 2, 3), dtype=np.int8)
    with pytest.raises(Exception, match="SOFTMAX_MASKED 'attn.softmax': mask 'mask' holds -5 at flat index 2"):
        rt.CompiledGraph(g).run(x, np.array([[0, 0, -5]], dtype=np.float32))
    with pytest.raises(MaskError, match="'attn.softmax': mask 'mask' holds -5 at index \\[0, 2\\]"):
        execute(g, [x, np.array([[0, 0, -5]], dtype=np.float32)])
    # a (N·H, S) constant mask built for batch 2 run at batch 1
    c = np.ones((4, 3), dtype=np.int32)
    attrs = {**attrs, "mask_dims": [0, 0, 1], "mask_attend": [1]}
    g = _graph(DType.I8, (-1, 2, 3), [("mask", DType.I32, (4, 3), c)], attrs)
    with pytest.raises(Exception, match="mask 'mask' dim 0 has size 4, expected 2"):
        rt.CompiledGraph(g).run(x)
    with pytest.raises(MaskError, match="mask 'mask' dim 0 has size 4, expected 2"):
        execute(g, [x])


@pytest.mark.parametrize("dims, attend, mdt, mshape, msg", [
    ([1, -1, 0], [1], DType.I32, (-1, 3), "in order"),
    ([0, -1, 0], [1], DType.I32, (-1,), "consecutive"),
    ([0, -1, -1], [1], DType.I32, (-1, 3), "in order, each at least once"),
    ([0, -1, 2], [1], DType.I32, (-1, 3), "entries must be -1"),
    ([0, -1, 1], [1], DType.F32, (-1, 3), "mask_attend must be 0"),
    ([0, -1, 1], [2], DType.I32, (-1, 3), "out of range"),
    ([0, -1, 1], [1], DType.I32, (-1, 4), "dim 1 has size 4, expected 3"),
    ([0, -1, 1, 0, -1, 1], [1], DType.I32, (-1, 3), "length"),
])
def test_bad_placements_are_refused(dims, attend, mdt, mshape, msg):
    attrs = {"table": list(softmax_table(0.1)), "mask_dims": dims, "mask_attend": attend, **_PLAIN}
    with pytest.raises(GraphFormatError, match=msg):
        _graph(DType.I8, (-1, 2, 3), [("mask", mdt, mshape, None)], attrs)


@needs_cpp
@pytest.mark.parametrize("dims, msg", [([1, -1, 0], "in order"), ([0, -1, 0], "in order"),
                                       ([0, -1, -1], "indexes no axis")])
def test_cpp_loader_refuses_bad_placements(dims, msg, monkeypatch):
    monkeypatch.setattr("qdsl.graph.qgraph.validate_graph", lambda graph: None)  # write it unchecked
    attrs = {"table": list(softmax_table(0.1)), "mask_dims": dims, "mask_attend": [1], **_PLAIN}
    bad = IntegerGraph([Tensor("x", DType.I8, (-1, 2, 3)), Tensor("m", DType.I32, (-1, 3)),
                        Tensor("y", DType.I8, (-1, 2, 3))], ["x", "m"], ["y"],
                       [Op(OpType.SOFTMAX_MASKED, "sm", ["x", "m"], ["y"], attrs)])
    with pytest.raises(Exception, match=msg):
        rt.CompiledGraph(bad)


def test_an_i32_mask_input_is_read_only_as_a_mask():
    attrs = {"table": list(softmax_table(0.1)), "mask_dims": [0, -1, 1], "mask_attend": [1], **_PLAIN}
    bad = IntegerGraph([Tensor("x", DType.I8, (-1, 2, 3)), Tensor("m", DType.I32, (-1, 2, 3)),
                        Tensor("y", DType.I8, (-1, 2, 3))], ["x", "m"], ["y"],
                       [Op(OpType.SOFTMAX_MASKED, "sm", ["m", "x"], ["y"], attrs)])
    with pytest.raises(GraphFormatError, match="only SOFTMAX_MASKED reads \\(after its first input\\)"):
        bad.validate()

"""MATMUL, SOFTMAX and LAYERNORM (docs/qgraph.md §4.4) with random shapes, permutations,
zero points, tables and output stages: the C++ runtime equals the Python reference
executor bit for bit on every kernel path, the reference equals a direct float64 /
Python-integer model of each formula, and malformed attributes are refused by both loaders."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt
from qdsl.export.lower_attn import softmax_table
from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, OutputStage, Rescale, Tensor
from qdsl.graph.requant import make_rescale
from qdsl.graph.ops.layernorm import isqrt, layernorm
from qdsl.graph.ops.matmul import matmul_shape
from qdsl.graph.ops.softmax import softmax

from tests.runtime.test_graph import _check, _graph, _rand, _stage

needs_cpp = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")


def _perm(rng, rank):
    rest = list(range(1, rank))
    rng.shuffle(rest)
    return [0] + rest


@needs_cpp
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), d0=st.sampled_from([DType.I8, DType.U8]), d1=st.sampled_from([DType.I8, DType.U8]),
       out=st.sampled_from([DType.I8, DType.U8]), rank=st.sampled_from([3, 4]))
def test_matmul_matches_reference(seed, d0, d1, out, rank):
    rng = np.random.default_rng(seed)
    m, k, n = (int(rng.choice([1, 2, 3, 7, 8, 9, 16, 17])) for _ in range(3))
    lead = [int(rng.integers(1, 4)) for _ in range(rank - 3)]
    # operands' permuted views (B, lead.., M, K) and (B, lead.., K, N), a leading dim broadcast now and then
    va = [-1] + [1 if rng.random() < 0.3 else d for d in lead] + [m, k]
    vb = [-1] + [1 if rng.random() < 0.3 else d for d in lead] + [k, n]
    pa, pb, po = _perm(rng, rank), _perm(rng, rank), _perm(rng, rank)
    # the stored operand has shape s with s[pa[i]] = va[i]
    sa, sb = [0] * rank, [0] * rank
    for i in range(rank):
        sa[pa[i]], sb[pb[i]] = va[i], vb[i]
    lo, hi = out.range
    zps = [int(rng.integers(*d.range, endpoint=True)) for d in (d0, d1)]
    attrs = {"in_zp": zps, "a_perm": pa, "b_perm": pb, "out_perm": po, **_stage(rng, lo=lo, hi=hi)}
    graph = _graph(OpType.MATMUL, [("a", d0, tuple(sa)), ("b", d1, tuple(sb))], attrs, out_dtype=out)
    batch = int(rng.integers(1, 4))
    xa, xb = _rand(rng, d0, (batch, *sa[1:])), _rand(rng, d1, (batch, *sb[1:]))
    _check(graph, xa, xb)


@needs_cpp
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape_a, shape_b, pa, pb, po", [
    # attention scores: q (B, T, H, d) as (B, H, T, d) times k as (B, H, d, T)
    ((-1, 100, 3, 33), (-1, 100, 3, 33), [0, 2, 1, 3], [0, 2, 3, 1], [0, 1, 2, 3]),
    # context: probs (B, H, T, T) times v (B, T, H, d) as (B, H, T, d), result as (B, T, H, d)
    ((-1, 3, 130, 97), (-1, 97, 3, 20), [0, 1, 2, 3], [0, 2, 1, 3], [0, 2, 1, 3]),
    # a transposed (columns strided), b broadcast over dim 1, result columns strided
    ((-1, 2, 37, 98), (-1, 1, 37, 17), [0, 1, 3, 2], [0, 1, 2, 3], [0, 1, 3, 2]),
    ((-1, 7, 5), (-1, 5, 40), [0, 1, 2], [0, 1, 2], [0, 1, 2]),
])
def test_matmul_blocked_path_matches_reference(threads, shape_a, shape_b, pa, pb, po):
    """The packed-panel path on shapes with row blocks past 96 rows, K not a multiple of 4,
    N not a multiple of 16, strided operands and results, at 1 and 2 threads."""
    rng = np.random.default_rng(threads)
    for d0, d1, out in [(DType.U8, DType.U8, DType.U8), (DType.I8, DType.U8, DType.I8), (DType.U8, DType.I8, DType.U8)]:
        zps = [int(rng.integers(*d.range, endpoint=True)) for d in (d0, d1)]
        lo, hi = out.range
        attrs = {"in_zp": zps, "a_perm": pa, "b_perm": pb, "out_perm": po, **_stage(rng, lo=lo, hi=hi)}
        graph = _graph(OpType.MATMUL, [("a", d0, shape_a), ("b", d1, shape_b)], attrs, out_dtype=out)
        xa, xb = _rand(rng, d0, (2, *shape_a[1:])), _rand(rng, d1, (2, *shape_b[1:]))
        xa[0, ...] = d0.range[1]  # extreme differences: |a - zp| and |b - zp| up to 255
        xb[0, ...] = d1.range[0]
        rt.set_num_threads(threads)
        try:
            _check(graph, xa, xb)
        finally:
            rt.set_num_threads(0)


def test_matmul_reference_is_the_integer_product():
    rng = np.random.default_rng(0)
    a = rng.integers(-128, 128, (2, 3, 5, 4))
    b = rng.integers(0, 256, (2, 1, 6, 4))  # (B, 1, N, K): transposed and broadcast over dim 1
    attrs = {"in_zp": [3, 128], "a_perm": [0, 1, 2, 3], "b_perm": [0, 1, 3, 2], "out_perm": [0, 2, 1, 3],
             "rq_kind": 1, "rq_multiplier": [1], "rq_shift": [0], "rq_rounding": 0, "out_zp": 0,
             "out_min": -2**31, "out_max": 2**31 - 1}
    from qdsl.graph.ops.matmul import matmul
    got = matmul([a, b], attrs)
    want = np.einsum("bhmk,bxnk->bmhn", a - 3, b - 128)
    np.testing.assert_array_equal(got, want)
    assert matmul_shape((-1, 3, 5, 4), (-1, 1, 6, 4), [0, 1, 2, 3], [0, 1, 3, 2], [0, 2, 1, 3])[0] == (-1, 5, 3, 6)


@pytest.mark.parametrize("a, b, pa, pb, msg", [
    ((-1, 2, 3), (-1, 4, 5), [0, 1, 2], [0, 1, 2], "inner dims differ"),
    ((-1, 2, 3), (-1, 3, 5), [1, 0, 2], [0, 1, 2], "batch first"),
    ((-1, 2, 3, 4), (-1, 3, 4, 5), [0, 1, 2, 3], [0, 1, 2, 3], "do not broadcast"),
])
def test_matmul_bad_operands_are_refused(a, b, pa, pb, msg):
    attrs = {"in_zp": [0, 0], "a_perm": pa, "b_perm": pb, "out_perm": list(range(len(a))),
             "rq_kind": 1, "rq_multiplier": [1], "rq_shift": [4], "rq_rounding": 0, "out_zp": 0, "out_min": -128,
             "out_max": 127}
    with pytest.raises(GraphFormatError, match=msg):
        _graph(OpType.MATMUL, [("a", DType.I8, a), ("b", DType.I8, b)], attrs)


def _softmax_attrs(rng, scale, out):
    lo, hi = out.range
    return {"table": list(softmax_table(scale)), **_stage(rng, lo=lo, hi=hi)}


@needs_cpp
@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31), d=st.sampled_from([DType.I8, DType.U8]), out=st.sampled_from([DType.I8, DType.U8]),
       n=st.sampled_from([1, 2, 7, 8, 16, 33, 128]))
def test_softmax_matches_reference(seed, d, out, n):
    rng = np.random.default_rng(seed)
    scale = float(rng.choice([1e-3, 0.01, 0.05, 0.2, 1.0]))
    shape = (-1, int(rng.integers(1, 4)), n)
    graph = _graph(OpType.SOFTMAX, [("x", d, shape)], _softmax_attrs(rng, scale, out), out_dtype=out)
    _check(graph, _rand(rng, d, (int(rng.integers(1, 4)), *shape[1:])))


def test_softmax_reference_is_the_formula():
    rng = np.random.default_rng(1)
    x = rng.integers(-128, 128, (3, 5, 40))
    scale = 0.07
    attrs = {"table": list(softmax_table(scale)), "rq_kind": 1, "rq_multiplier": [1], "rq_shift": [22],
             "rq_rounding": 1, "out_zp": 0, "out_min": 0, "out_max": 255}
    got = softmax(x, attrs)
    for row, y in zip(x.reshape(-1, 40), got.reshape(-1, 40)):
        e = [attrs["table"][int(v) - int(row.max()) + 255] for v in row]
        s = sum(e)
        q = [(ei << 30) // s for ei in e]
        assert [min(255, round(qi / 2**22)) for qi in q] == [int(v) for v in y]  # POT, half even: exact
        p = np.exp(scale * (row - row.max()))
        assert np.abs(y / 256 - p / p.sum()).max() < 1.5 / 256


_IDENTITY_IN = {"in_zp": [0], "in_kind": [1], "in_multiplier": [1], "in_shift": [0], "in_rounding": [0]}


def _ln_attrs(rng, n, out, eps=None, zp=0):
    lo, hi = out.range
    return {**_IDENTITY_IN, "in_zp": [zp], "gamma": [int(v) for v in rng.integers(-(2**14) + 1, 2**14, n)],
            "beta": [int(v) for v in rng.integers(-(2**20), 2**20, n)],
            "eps": int(rng.choice([0, 1, 1000, 10**9])) if eps is None else eps,
            **_stage(rng, lo=lo, hi=hi)}


@needs_cpp
@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31), d=st.sampled_from([DType.I8, DType.U8]), out=st.sampled_from([DType.I8, DType.U8]),
       n=st.sampled_from([1, 2, 3, 8, 17, 64, 384]))
def test_layernorm_matches_reference(seed, d, out, n):
    rng = np.random.default_rng(seed)
    shape = (-1, int(rng.integers(1, 4)), n)
    zp = int(rng.integers(*d.range, endpoint=True))  # cancels in D_i
    graph = _graph(OpType.LAYERNORM, [("x", d, shape)], _ln_attrs(rng, n, out, zp=zp), out_dtype=out)
    x = _rand(rng, d, (int(rng.integers(1, 4)), *shape[1:]))
    x[0, 0] = x[0, 0, 0]  # a constant row: zero variance (eps only, or R = 0)
    _check(graph, x)


@needs_cpp
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), d=st.sampled_from([DType.U8, DType.I8]), out=st.sampled_from([DType.I8, DType.U8]),
       n=st.sampled_from([1, 3, 17, 384]), pot=st.booleans())
def test_wide_output_layernorm_matches_reference(seed, d, out, n, pot):
    # the wide output: LAYERNORM writes I32 (the accumulator itself, or a random int32-range
    # stage), an 8-bit consumer reads it through REQUANTIZE (I32 input, zero point 0; rows of
    # >= 16 elements take the paths' vector stage) and a LAYERNORM reads it as a residual term
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 40))
    shape = (-1, rows, n)
    one = OutputStage(Rescale(1, (1,), (0,), 0), 0, -(2**31), 2**31 - 1).attrs()
    wide_stage = one if rng.random() < 0.5 else _stage(rng, lo=-(2**31), hi=2**31 - 1, pot=pot)
    ln1 = {**_ln_attrs(rng, n, DType.I32, zp=int(rng.integers(*d.range, endpoint=True))), **wide_stage}
    lo, hi = out.range
    rq = {"in_zp": 0, **_stage(rng, lo=lo, hi=hi, pot=pot)}
    rq_scale = {"rq_kind": 2, "rq_multiplier": [int(rng.integers(2**30, 2**31))], "rq_shift": [int(rng.integers(12, 24))],
                "rq_rounding": int(rng.integers(0, 4))}
    rq.update(rq_scale if not pot and rng.random() < 0.5 else {})
    ln2 = {**_ln_attrs(rng, n, out), **_in_rescales(rng, [DType.I32, out])}
    tensors = [Tensor("x", d, shape), Tensor("w", DType.I32, shape), Tensor("q", out, shape), Tensor("y", out, shape)]
    ops = [Op(OpType.LAYERNORM, "ln1", ["x"], ["w"], ln1), Op(OpType.REQUANTIZE, "rq", ["w"], ["q"], rq),
           Op(OpType.LAYERNORM, "ln2", ["w", "q"], ["y"], ln2)]
    graph = IntegerGraph(tensors, ["x"], ["w", "q", "y"], ops).validate()
    x = _rand(rng, d, (int(rng.integers(1, 3)), rows, n))
    x[0, 0] = x[0, 0, 0]  # a constant row
    _check(graph, x)


def test_requantize_of_i32_needs_zero_point_0():
    # x - in_zp of an int32 value must stay int32: an I32 input is read at zero point 0
    # (the op's own rule; an I32 graph input is token ids, so the graph check is not the point)
    with pytest.raises(GraphFormatError, match="in_zp"):
        _graph(OpType.REQUANTIZE, [("x", DType.I32, (-1, 4))], {"in_zp": 1, **_stage(np.random.default_rng(0))},
               validate=False)
    _graph(OpType.REQUANTIZE, [("x", DType.I32, (-1, 4))], {"in_zp": 0, **_stage(np.random.default_rng(0))},
           validate=False)


def test_layernorm_reference_is_the_formula():
    rng = np.random.default_rng(2)
    n = 24
    x = rng.integers(0, 256, (4, n))
    x[0] = 7
    attrs = {**_IDENTITY_IN, "gamma": [int(v) for v in rng.integers(-(2**14) + 1, 2**14, n)],
             "beta": [int(v) for v in rng.integers(-1000, 1000, n)], "eps": 5,
             "rq_kind": 1, "rq_multiplier": [1], "rq_shift": [0], "rq_rounding": 0, "out_zp": 0,
             "out_min": -2**31, "out_max": 2**31 - 1}
    got = layernorm(x, attrs)
    for row, y in zip(x, got):
        r = [int(v) for v in row]
        d = [n * v - sum(r) for v in r]
        w = sum(v * v for v in d) + 5
        g = (62 - w.bit_length()) // 2
        root = math.isqrt(w << (2 * g))
        z = [0 if root == 0 else int(math.copysign((2 * (abs(v) << (g + 16)) + root) // (2 * root), v)) for v in d]
        want = [zi * gi + bi for zi, gi, bi in zip(z, attrs["gamma"], attrs["beta"])]
        assert [int(v) for v in y] == want
        # Z is 2^16 · (x - mean) / (sqrt(N) · sqrt(var + eps / N^3)) to within one unit
        var = np.var(row) + 5 / n**3
        np.testing.assert_allclose(z, 2**16 * (row - row.mean()) / math.sqrt(n * var), atol=1.01)


def _in_rescales(rng, dtypes):
    """Per-input rescales to a common grid: 8-bit inputs scaled up by 2^4..2^14, I32 inputs by
    2^-1..2^10, POT or fixed-point."""
    attrs = {k: [] for k in ("in_zp", "in_kind", "in_multiplier", "in_shift", "in_rounding")}
    for d in dtypes:
        big = d is not DType.I32
        factor = float(2.0 ** rng.uniform(4, 14)) if big else float(2.0 ** rng.uniform(-1, 10))
        if rng.random() < 0.4:
            r = Rescale(1, (1,), (-int(round(math.log2(factor))),), int(rng.integers(0, 4)))
        else:
            r = make_rescale(factor, int(rng.integers(0, 4)), allow_pot=False, single=True)
        zp = int(rng.integers(*d.range, endpoint=True)) if big else 0
        for k, v in (("in_zp", zp), ("in_kind", int(r.kind)), ("in_multiplier", int(r.multiplier[0])),
                     ("in_shift", int(r.shift[0])), ("in_rounding", int(r.rounding))):
            attrs[k].append(v)
    return attrs


@needs_cpp
@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31), d0=st.sampled_from([DType.I8, DType.U8, DType.I32]),
       d1=st.sampled_from([None, DType.I8, DType.U8, DType.I32]), const1=st.booleans(),
       out=st.sampled_from([DType.I8, DType.U8]), n=st.sampled_from([1, 3, 17, 64, 384]))
def test_wide_layernorm_matches_reference(seed, d0, d1, const1, out, n):
    # the wide form: an I32 residual sum (a LINEAR's wide result plus a rescaled 8-bit
    # residual, or two I32 results), or a value plus a (1, ...) constant over the batch;
    # I32 terms scaled up to ~2^30 exercise the row shift k > 0
    rng = np.random.default_rng(seed)
    rows, k_in, batch = int(rng.integers(1, 4)), 16, int(rng.integers(1, 4))
    shape = (-1, rows, n)
    i32 = OutputStage(Rescale(1, (1,), (0,), 0), 0, -(2**31), 2**31 - 1).attrs()
    tensors = [Tensor("x", DType.F32, (-1, rows, k_in)), Tensor("qx", DType.U8, (-1, rows, k_in))]
    ops = [Op(OpType.QUANTIZE, "q", ["x"], ["qx"], {"scale": 0.05, "zero_point": 128, "qmin": 0, "qmax": 255,
                                                    "rounding": 1})]
    feeds = {"x": rng.standard_normal((batch, rows, k_in)).astype(np.float32) * 3}

    def operand(name, d, const):
        if const:
            data = rng.integers(-(2**20), 2**20, (1, rows, n)) if d is DType.I32 else _rand(rng, d, (1, rows, n))
            tensors.append(Tensor(name, d, (1, rows, n), data))
        elif d is DType.I32:
            w = _rand(rng, DType.I8, (n, k_in))
            tensors.extend([Tensor(f"{name}.w", DType.I8, w.shape, w), Tensor(name, DType.I32, shape)])
            ops.append(Op(OpType.LINEAR, name, ["qx", f"{name}.w"], [name],
                          {"in_zp": 128, "w_zp": [0], "acc_bits": 32, "overflow": 0, **i32}))
        else:
            tensors.append(Tensor(name, d, shape))
            feeds[name] = _rand(rng, d, (batch, rows, n))
            if name == "x0":
                feeds[name][0, 0] = feeds[name][0, 0, 0]  # a constant row
        return name

    dtypes = [d0] + ([d1] if d1 is not None else [])
    names = [operand("x0", d0, False)] + ([operand("x1", d1, const1)] if d1 is not None else [])
    attrs = {**_ln_attrs(rng, n, out, eps=int(rng.choice([0, 7, 10**12]))), **_in_rescales(rng, dtypes)}
    tensors.append(Tensor("y", out, shape))
    ops.append(Op(OpType.LAYERNORM, "ln", names, ["y"], attrs))
    graph_inputs = [t.name for t in tensors if t.name in feeds]
    graph = IntegerGraph(tensors, graph_inputs, ["y"], ops).validate()
    _check(graph, *[feeds[k] for k in graph_inputs])


@needs_cpp
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [5, 37, 384])
def test_wide_layernorm_many_rows_match_reference(threads, n):
    """The wide form's optimized rows (typed loads, row shift, exact division, vector stage)
    over 210 rows split across threads: I32 inputs (LINEAR results, or a (1, ...) constant up
    to ±2^30: k = 0 and k > 0), a second activation, a rescaled 8-bit pair, a constant row;
    I8, U8 and I32 outputs."""
    rng = np.random.default_rng(10 * n + threads)
    rows, batch, k_in = 70, 3, 16
    shape = (-1, rows, n)
    i32 = OutputStage(Rescale(1, (1,), (0,), 0), 0, -(2**31), 2**31 - 1).attrs()
    forms = [(DType.I32, DType.I32, False), (DType.I32, DType.I32, True), (DType.I32, None, False),
             (DType.U8, DType.I8, False), (DType.I8, DType.U8, True), (DType.I32, DType.U8, False)]
    for (d0, d1, const1), out in itertools.product(forms, [DType.I8, DType.U8, DType.I32]):
        dtypes = [d0] + ([d1] if d1 is not None else [])
        tensors = [Tensor("f", DType.F32, (-1, rows, k_in)), Tensor("qf", DType.U8, (-1, rows, k_in))]
        ops = [Op(OpType.QUANTIZE, "q", ["f"], ["qf"], {"scale": 0.05, "zero_point": 128, "qmin": 0, "qmax": 255,
                                                        "rounding": 1})]
        feeds = {"f": rng.standard_normal((batch, rows, k_in)).astype(np.float32) * 3}

        def operand(name, d, const):
            if const:
                data = rng.integers(-(2**30), 2**30, (1, rows, n)) if d is DType.I32 else _rand(rng, d, (1, rows, n))
                tensors.append(Tensor(name, d, (1, rows, n), data))
            elif d is DType.I32:
                w = _rand(rng, DType.I8, (n, k_in))
                tensors.extend([Tensor(f"{name}.w", DType.I8, w.shape, w), Tensor(name, DType.I32, shape)])
                ops.append(Op(OpType.LINEAR, name, ["qf", f"{name}.w"], [name],
                              {"in_zp": 128, "w_zp": [0], "acc_bits": 32, "overflow": 0, **i32}))
            else:
                tensors.append(Tensor(name, d, shape))
                feeds[name] = _rand(rng, d, (batch, rows, n))
                feeds[name][0, 0] = feeds[name][0, 0, 0]  # a constant row
            return name

        names = [operand("x0", d0, False)] + ([operand("x1", d1, const1)] if d1 is not None else [])
        attrs = {**_ln_attrs(rng, n, out, eps=int(rng.choice([0, 7, 10**12]))), **_in_rescales(rng, dtypes)}
        if d0 is DType.I32 and d1 is None:  # an I32 input off zero point 0: x - zp may pass int32 (the scalar rescale)
            attrs["in_zp"] = [int(rng.choice([-(2**31), 12345]))]
        tensors.append(Tensor("y", out, shape))
        ops.append(Op(OpType.LAYERNORM, "ln", names, ["y"], attrs))
        inputs = [t.name for t in tensors if t.name in feeds]
        graph = IntegerGraph(tensors, inputs, ["y"], ops).validate()
        rt.set_num_threads(threads)
        try:
            _check(graph, *[feeds[k] for k in inputs])
        finally:
            rt.set_num_threads(0)


def test_wide_layernorm_reference_is_the_formula():
    # two inputs brought to one grid, the row shift k, eps shifted by 2k: Python integers
    rng = np.random.default_rng(5)
    n = 16
    x0 = rng.integers(-(2**30), 2**30, (3, n))
    x1 = rng.integers(0, 256, (1, n))  # a constant row over the batch, zero point 100, x 2^6
    attrs = {"in_zp": [0, 100], "in_kind": [1, 1], "in_multiplier": [1, 1], "in_shift": [0, -6],
             "in_rounding": [0, 0], "gamma": [1] * n, "beta": [0] * n, "eps": 10**15,
             "rq_kind": 1, "rq_multiplier": [1], "rq_shift": [0], "rq_rounding": 0, "out_zp": 0,
             "out_min": -2**31, "out_max": 2**31 - 1}
    got = layernorm([x0, x1], attrs)
    half_away = lambda v, k: v if k == 0 else int(math.copysign((abs(v) + (1 << (k - 1))) >> k, v))  # noqa: E731
    for row, y in zip(x0, got):
        v = [max(-2**31, min(2**31 - 1, int(a) + ((int(b) - 100) << 6))) for a, b in zip(row, x1[0])]
        d = [n * a - sum(v) for a in v]
        k = max(0, max(abs(a) for a in d).bit_length() - 24)
        assert k > 0
        d = [half_away(a, k) for a in d]
        w = sum(a * a for a in d) + half_away(10**15, 2 * k)
        g = (62 - w.bit_length()) // 2
        root = math.isqrt(w << (2 * g))
        z = [int(math.copysign((2 * (abs(a) << (g + 16)) + root) // (2 * root), a)) for a in d]
        assert [int(t) for t in y] == z


def test_isqrt_is_exact():
    vals = np.array([0, 1, 2, 3, 4, 15, 16, 17, 2**52 - 1, 2**52, 2**62, 2**62 - 1, (2**31 - 1) ** 2,
                     (2**31 - 1) ** 2 - 1] + list(np.random.default_rng(3).integers(0, 2**62, 200)), dtype=np.int64)
    assert [int(r) for r in isqrt(vals)] == [math.isqrt(int(v)) for v in vals]


@needs_cpp
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("op", [OpType.SOFTMAX, OpType.LAYERNORM])
@pytest.mark.parametrize("n", [5, 37, 128, 384])
def test_row_ops_many_rows_match_reference(threads, op, n):
    """SOFTMAX and LAYERNORM rows (ForEachLastAxisRow) split across threads, every path, with
    extreme rows: constant (softmax: all at the max; layernorm: zero variance), one code at
    each end of the dtype, and table scales from flat to steep."""
    rng = np.random.default_rng(n + threads)
    for d, out in [(DType.U8, DType.U8), (DType.I8, DType.I8), (DType.U8, DType.I8)]:
        shape = (-1, 70, n)
        if op is OpType.SOFTMAX:
            attrs = _softmax_attrs(rng, float(rng.choice([1e-3, 0.05, 1.0])), out)
        else:
            attrs = _ln_attrs(rng, n, out, eps=int(rng.choice([0, 1000])))
        graph = _graph(op, [("x", d, shape)], attrs, out_dtype=out)
        x = _rand(rng, d, (3, *shape[1:]))
        lo, hi = d.range
        x[0, 0] = lo
        x[0, 1] = hi
        x[0, 2] = lo
        x[0, 2, n // 2] = hi
        x[1, 3] = hi
        x[1, 3, 0] = lo
        rt.set_num_threads(threads)
        try:
            _check(graph, x)
        finally:
            rt.set_num_threads(0)


@pytest.mark.parametrize("op, attrs, msg", [
    (OpType.SOFTMAX, {"table": [0] * 256}, "table\\[255\\]"),
    (OpType.SOFTMAX, {"table": [2**25] * 256}, "out of range"),
    (OpType.LAYERNORM, {**_IDENTITY_IN, "gamma": [2**14] * 4, "beta": [0] * 4, "eps": 0}, "out of range"),
    (OpType.LAYERNORM, {**_IDENTITY_IN, "gamma": [1] * 3, "beta": [0] * 4, "eps": 0}, "length"),
    (OpType.LAYERNORM, {**_IDENTITY_IN, "in_shift": [-3], "gamma": [1] * 4, "beta": [0] * 4, "eps": 2**61},
     "below 2\\^61"),
])
def test_bad_attributes_are_refused(op, attrs, msg):
    stage = {"rq_kind": 1, "rq_multiplier": [1], "rq_shift": [4], "rq_rounding": 0, "out_zp": 0, "out_min": -128,
             "out_max": 127}
    with pytest.raises(GraphFormatError, match=msg):
        _graph(op, [("x", DType.I8, (-1, 2, 4))], {**attrs, **stage})


@needs_cpp
def test_cpp_loader_refuses_what_python_refuses():
    from qdsl.graph.ir import IntegerGraph, Op, Tensor
    stage = {"rq_kind": 1, "rq_multiplier": [1], "rq_shift": [4], "rq_rounding": 0, "out_zp": 0, "out_min": -128,
             "out_max": 127}
    bad = IntegerGraph([Tensor("x", DType.I8, (-1, 2, 4)), Tensor("y", DType.I8, (-1, 2, 4))], ["x"], ["y"],
                       [Op(OpType.SOFTMAX, "sm", ["x"], ["y"], {"table": [0] * 256, **stage})])
    with pytest.raises(Exception, match="table\\[255\\]"):
        rt.CompiledGraph(bad)

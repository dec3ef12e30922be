"""LAYERNORM's optimized rows (LayernormKernels: csrc/dispatch.h, csrc/runtime/ops/layernorm.cc)
at their edges: the C++ runtime equals the Python reference executor bit for bit on every
kernel path, at 1 and 2 threads, for rows built to sit on each side of the row shift's edge
(max |D| = 2^24 - 1 runs the int32 centering, k = 0; 2^24 and 2^25 - 1 the binary64 one,
k = 1, the latter reaching |D| = 2^24 after the shift), a wide spread (k up to 16), int32
pair sums that saturate, constant rows (W = 0), row lengths around the vector width, and
the extreme gamma and beta."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt
from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Rescale, Tensor
from qdsl.graph.requant import apply_rescale, make_rescale

from tests.runtime.test_graph import _check, _stage

needs_cpp = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def _row_k(v: list[int]) -> int:
    """The row shift k of a row of summed values (the header formula, Python integers)."""
    n = len(v)
    most = max(abs(n * x - sum(v)) for x in v)
    return max(0, most.bit_length() - 24)


def _row_with_spread(n: int, t: int, offset: int) -> list[int]:
    """A row whose max |D| is exactly t (n >= 2): v_0 = a, v_1 = b, the rest 0, with
    (n - 1)·a - b = t, all shifted by `offset` (D does not change)."""
    a = -(-t // (n - 1))
    b = (n - 1) * a - t
    return [x + offset for x in [a, b] + [0] * (n - 2)]


def _rescale_attrs(rescales):
    return {"in_zp": [zp for zp, _ in rescales], "in_kind": [int(r.kind) for _, r in rescales],
            "in_multiplier": [int(r.multiplier[0]) for _, r in rescales],
            "in_shift": [int(r.shift[0]) for _, r in rescales], "in_rounding": [int(r.rounding) for _, r in rescales]}


@needs_cpp
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.sampled_from([2, 7, 8, 9, 15, 16, 17, 32, 383, 384, 385]),
       first=st.sampled_from(["i32", "i32_rescaled", "u8", "i8"]), out=st.sampled_from(["i32", "i32_stage", "i8", "u8"]),
       threads=st.sampled_from([1, 2]))
def test_wide_layernorm_row_edges_match_reference(seed, n, first, out, threads):
    """Input 1 is an I32 constant (1, rows, n) holding the rows minus input 0's rescaled term,
    so the summed rows are exactly the ones built.  Input 0: a LINEAR's I32 result (zero
    weights: its bias row) read in place (identity rescale) or rescaled (FIXED_SINGLE, as
    MiniLM's residual), or 8-bit codes under a POT rescale (at the zero point in the edge
    rows, random elsewhere)."""
    rng = np.random.default_rng(seed)
    nrows, batch, k_in = 40, 2, 4  # 40 rows: more than two of ParallelRanges' 16-row chunks
    edges = {2**24 - 1: 0, 2**24: 1, 2**25 - 1: 1}
    rows = [_row_with_spread(n, t, int(rng.integers(-(2**29), 2**29))) for t in edges]
    lo, hi = I32_MIN + 2**30, I32_MAX - 2**30  # wide rows whose constant still fits int32
    rows.append([lo, hi] * (n // 2) + [hi] * (n % 2))  # a wide spread: k from 7 (n = 2) to 16
    rows.append([int(rng.integers(lo, hi))] * n)  # constant: D = 0
    rows.append([int(v) for v in rng.integers(-(2**12), 2**12, n)])  # small: k = 0
    # rows with k = 1 or 2 whose D is one large value and many small ones: W is near its least
    # (2^48), so a small D off by one unit (a half rounded the wrong way) moves Z by about
    # 2^-8 and shows in the output now and then (a large k hits a half at 2^-k per element)
    for j in range(16):
        off = int(rng.integers(-(2**29), 2**29))
        row = off + rng.integers(-(2**11), 2**11, n)
        row[0] = off + int(1.5 * 2 ** (24 + j % 2)) // max(1, n - 1)
        rows.append([int(x) for x in row])
    v = np.array(rows, dtype=np.int64)
    shape = (-1, nrows, n)
    tensors, ops, feeds = [], [], []
    if first.startswith("i32"):
        bias = rng.integers(-(2**30), 2**30, n, endpoint=True)
        r0 = (make_rescale(float(2.0 ** rng.uniform(-9, -1)), int(rng.integers(0, 4)), allow_pot=False, single=True)
              if first == "i32_rescaled" else Rescale(1, (1,), (0,), 0))
        term0 = np.broadcast_to(apply_rescale(bias, r0, None), (nrows, n))
        i32 = OutputStage(Rescale(1, (1,), (0,), 0), 0, I32_MIN, I32_MAX).attrs()
        tensors += [Tensor("f", DType.F32, (-1, nrows, k_in)), Tensor("qf", DType.U8, (-1, nrows, k_in)),
                    Tensor("w", DType.I8, (n, k_in), np.zeros((n, k_in), np.int8)),
                    Tensor("b", DType.I32, (n,), bias), Tensor("x0", DType.I32, shape)]
        ops += [Op(OpType.QUANTIZE, "q", ["f"], ["qf"], {"scale": 0.05, "zero_point": 128, "qmin": 0, "qmax": 255,
                                                         "rounding": 1}),
                Op(OpType.LINEAR, "lin", ["qf", "w", "b"], ["x0"],
                   {"in_zp": 128, "w_zp": [0], "acc_bits": 32, "overflow": 0, **i32})]
        feeds.append(rng.standard_normal((batch, nrows, k_in)).astype(np.float32))
        zp0 = 0
    else:
        d = DType.U8 if first == "u8" else DType.I8
        zp0 = int(rng.integers(*d.range, endpoint=True))
        r0 = Rescale(1, (1,), (-int(rng.integers(0, 24)),), int(rng.integers(0, 4)))
        x = rng.integers(*d.range, (batch, nrows, n), endpoint=True)
        x[:, : len(rows)] = zp0  # the edge rows' term is 0
        term0 = apply_rescale(x[0] - zp0, r0, None)
        assert (apply_rescale(x[1] - zp0, r0, None)[: len(rows)] == 0).all()
        tensors.append(Tensor("x0", d, shape))
        feeds.append(x.astype(d.numpy))
    # the constant: the built rows minus input 0's term, then random int32 rows (the pair
    # sums saturate now and then, k is large)
    const = rng.integers(I32_MIN, I32_MAX, (1, nrows, n), endpoint=True)
    const[0, : len(rows)] = v - term0[: len(rows)]
    assert (np.abs(const) <= 2**31).all() and (const[0, : len(rows)] + term0[: len(rows)] == v).all()
    assert [_row_k(r) for r in rows[:3]] == list(edges.values())  # both centering forms, at the edge
    assert _row_k(rows[3]) >= 7 and _row_k(rows[5]) == 0
    assert n < 8 or {_row_k(r) for r in rows[6:22]} == {1, 2}
    tensors.append(Tensor("c", DType.I32, (1, nrows, n), const))
    attrs = _rescale_attrs([(zp0, r0), (0, Rescale(1, (1,), (0,), 0))])
    gamma = rng.integers(-(2**14) + 1, 2**14, n)
    beta = rng.integers(-(2**30), 2**30, n, endpoint=True)
    gamma[: n // 2] = rng.choice([-(2**14) + 1, 2**14 - 1], n // 2)  # extremes: acc near the int32 ends
    beta[: n // 2] = rng.choice([-(2**30), 2**30], n // 2)
    attrs.update(gamma=[int(g) for g in gamma], beta=[int(b) for b in beta],
                 eps=int(rng.choice([0, 7, 2**40, 2**61 - 1])))
    ydt = DType.I32 if out.startswith("i32") else (DType.I8 if out == "i8" else DType.U8)
    if out == "i32":  # the identity stage: rows written in place
        attrs.update(OutputStage(Rescale(1, (1,), (0,), 0), 0, I32_MIN, I32_MAX).attrs())
    elif out == "i32_stage":
        attrs.update(OutputStage(Rescale(1, (1,), (int(rng.integers(0, 8)),), int(rng.integers(0, 4))),
                                 int(rng.integers(-100, 100)), -(2**20), 2**20).attrs())
    else:
        attrs.update(_stage(rng, lo=ydt.range[0], hi=ydt.range[1]))
    tensors.append(Tensor("y", ydt, shape))
    ops.append(Op(OpType.LAYERNORM, "ln", ["x0", "c"], ["y"], attrs))
    inputs = ["f"] if first.startswith("i32") else ["x0"]
    graph = IntegerGraph(tensors, inputs, ["y"], ops).validate()
    rt.set_num_threads(threads)
    try:
        _check(graph, *feeds)
    finally:
        rt.set_num_threads(0)

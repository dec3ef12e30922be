"""The vector output stages (AVX2: 8 lanes + scalar tail; AVX-512: 16 lanes + masked
tail) equal the exact formulas of qdsl/graph/requant.py on every path, across column
counts that end blocks at every offset, per-tensor and per-channel parameters, every
kind and rounding, and corner accumulators and multipliers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import Rescale  # noqa: E402
from qdsl.graph.requant import apply_rescale  # noqa: E402
from qdsl.runtime import kernels as K  # noqa: E402

PATHS = [p for p in ("ref", "portable", "avx2", "avxvnni", "avx512", "amx") if p in K.paths()["cpu"]]
_CORNERS = [0, 1, -1, 127, -128, 255, (1 << 24) + 1, -(1 << 24) - 1, (1 << 30) + 1, (1 << 31) - 1, -(1 << 31),
            -(1 << 31) + 1]


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from([0, 1, 2]), rounding=st.integers(0, 3), cols=st.integers(1, 40),
       per_tensor=st.booleans(), rows=st.integers(1, 5), seed=st.integers(0, 2**31), out_signed=st.booleans())
def test_output_stage_paths_equal_formula(kind, rounding, cols, per_tensor, rows, seed, out_signed):
    rng = np.random.default_rng(seed)
    channels = 1 if per_tensor else cols
    rounding = 0 if kind == 0 else rounding
    if kind == 1:
        mult = np.ones(channels, np.int64)
        shift = rng.integers(-31, 63, channels)
        shift[rng.random(channels) < 0.6] = rng.integers(0, 16)
    else:
        mult = rng.integers(0, 1 << 31, channels)
        mult[rng.random(channels) < 0.2] = (1 << 31) - 1
        mult[rng.random(channels) < 0.2] = 1 << 30
        mult[rng.random(channels) < 0.1] = 0
        shift = rng.integers(-31, 32, channels)
        shift[rng.random(channels) < 0.6] = rng.integers(0, 24)
    acc = rng.integers(-(1 << 31), 1 << 31, (rows, cols))
    acc[0, :] = rng.choice(_CORNERS, cols)
    if rows > 1:
        acc[1, :] = rng.integers(-2000, 2000, cols) * (1 << int(rng.integers(0, 12)))  # rounding ties
    lo, hi = (-128, 127) if out_signed else (0, 255)
    zp = int(rng.integers(lo, hi + 1))
    qmin = int(rng.integers(lo, zp + 1)) if rng.random() < 0.3 else lo
    stage = K.OutputStage(mult, shift, zero_point=zp, qmin=qmin, qmax=hi, kind=kind, rounding=rounding)
    r = Rescale(kind, tuple(int(v) for v in mult), tuple(int(v) for v in shift), rounding)
    want = np.clip(apply_rescale(acc, r, axis=1) + zp, qmin, hi)
    for path in PATHS:
        got = K.requantize(acc.astype(np.int32), stage, np.int8 if out_signed else np.uint8, path=path)
        np.testing.assert_array_equal(got.astype(np.int64), want, err_msg=f"path {path}")


def _corner_accumulators() -> np.ndarray:
    vals = {0, 1, -1, 2**31 - 1, -(2**31), -(2**31) + 1, 2**31 - 2}
    for k in range(1, 31):
        for d in (-1, 0, 1):
            vals.update({(1 << k) + d, -(1 << k) + d})
    return np.array(sorted(vals), np.int64)


_ACC = _corner_accumulators()  # 187 values
_MULTS = [0, 1, 2, 3, (1 << 30) - 1, 1 << 30, (1 << 30) + 1, (1 << 31) - 2, (1 << 31) - 1, 1518500250]
_SHIFTS = {0: [-31, -30, -17, -1, 0, 1, 2, 15, 24, 30, 31], 2: [-31, -30, -17, -1, 0, 1, 2, 15, 24, 30, 31],
           1: [-31, -30, -1, 0, 1, 2, 15, 30, 31, 32, 45, 62]}  # POT shifts past 31 fall back to the reference


def _grid(kind: int) -> tuple[np.ndarray, np.ndarray]:
    if kind == 1:
        shift = np.array(_SHIFTS[1], np.int64)
        return np.ones_like(shift), shift
    m, s = np.meshgrid(_MULTS, _SHIFTS[kind], indexing="ij")
    return m.ravel().astype(np.int64), s.ravel().astype(np.int64)


@pytest.mark.parametrize("kind,rounding", [(0, 0)] + [(k, r) for k in (1, 2) for r in range(4)])
@pytest.mark.parametrize("out_signed", [True, False])
def test_output_stage_paths_corner_grid(kind, rounding, out_signed):
    """Every corner accumulator (0, +-1, INT32_MIN/MAX, +-2^k and +-2^k +- 1) against every
    extreme multiplier and shift, per channel (one column per (multiplier, shift) pair,
    a column count that leaves a masked / scalar tail) and per tensor (odd column counts),
    and zero points at the edges of the allowed range."""
    mult, shift = _grid(kind)
    r = Rescale(kind, tuple(int(v) for v in mult), tuple(int(v) for v in shift), rounding)
    lo, hi = (-128, 127) if out_signed else (0, 255)
    dtype = np.int8 if out_signed else np.uint8
    cols = mult.size
    # column c sees every accumulator (rotated rows), so each (m, s) pair meets each corner
    acc = _ACC[(np.arange(_ACC.size)[:, None] + np.arange(cols)[None, :]) % _ACC.size]
    for zp, qmin, qmax in ((0, lo, hi), (lo + 1, lo, hi), (-(1 << 16), lo, hi), (1 << 16, lo, hi),
                           (3, lo + 7, hi - 9)):
        stage = K.OutputStage(mult, shift, zero_point=zp, qmin=qmin, qmax=qmax, kind=kind, rounding=rounding)
        want = np.clip(apply_rescale(acc, r, axis=1) + zp, qmin, qmax)
        for path in PATHS:
            got = K.requantize(acc.astype(np.int32), stage, dtype, path=path)
            np.testing.assert_array_equal(got.astype(np.int64), want, err_msg=f"path {path} zp {zp}")
    # per tensor: each (m, s) pair alone over odd column counts (masked tails of every length)
    for i in range(cols):
        one = Rescale(kind, (int(mult[i]),), (int(shift[i]),), rounding)
        stage = K.OutputStage(mult[i:i + 1], shift[i:i + 1], zero_point=5, qmin=lo, qmax=hi, kind=kind,
                              rounding=rounding)
        n = 1 + 2 * (i % 20)  # 1..39
        a = np.resize(np.roll(_ACC, i), (_ACC.size // n, n))
        want = np.clip(apply_rescale(a, one, axis=1) + 5, lo, hi)
        for path in PATHS:
            got = K.requantize(a.astype(np.int32), stage, dtype, path=path)
            np.testing.assert_array_equal(got.astype(np.int64), want, err_msg=f"path {path} m {mult[i]} s {shift[i]}")


def _add_rescale(rng, kind: int) -> tuple[int, int, int]:
    """(multiplier, shift, rounding) of one ADD rescale of ``kind``, shifts of both signs."""
    if kind == 1:
        return 1, int(rng.choice([0, 0, -3, 1, 5, 17, 31])), int(rng.integers(0, 4))
    m = int(rng.choice([0, 1, (1 << 31) - 1, 1 << 30, int(rng.integers(1 << 30, 1 << 31))]))
    return m, int(rng.choice([-31, -17, -1, 0, 1, 9, 31])), 0 if kind == 0 else int(rng.integers(0, 4))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.sampled_from([1, 7, 16, 33, 511, 512, 513, 1025, 1600]))
def test_add_paths_equal_reference(seed, n):
    """ADD (vector kernels in L1 chunks of 512 elements, masked tails) on every path equals
    the reference executor: every input / output kind and rounding, left and right shifts,
    pre-shifts, I8 and U8 inputs, zero points at the range edges, sizes across chunk ends."""
    from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Tensor
    from qdsl.graph.reference import execute

    rng = np.random.default_rng(seed)
    dts = [DType.U8 if rng.random() < 0.5 else DType.I8 for _ in range(2)]
    kinds = [int(rng.integers(0, 3)) for _ in range(2)]
    rq = [_add_rescale(rng, k) for k in kinds]
    ok = int(rng.integers(0, 3))
    om, osh, ornd = _add_rescale(rng, ok)
    if ok == 1:
        osh = abs(osh)
    signed = bool(rng.random() < 0.5)
    lo, hi = (-128, 127) if signed else (0, 255)
    attrs = {"in_zp": [int(rng.choice([d.range[0], d.range[1], 0, 3])) for d in dts], "in_kind": kinds,
             "in_multiplier": [r[0] for r in rq], "in_shift": [r[1] for r in rq], "in_rounding": [r[2] for r in rq],
             "pre_shift": int(rng.choice([0, 0, 4, 20, 23])), "rq_kind": ok, "rq_multiplier": [om], "rq_shift": [osh],
             "rq_rounding": ornd, "out_zp": int(rng.choice([lo, hi, 0, lo + 1])),
             "out_min": lo, "out_max": hi}
    shape = (-1, n)
    xs = [rng.integers(d.range[0], d.range[1] + 1, (1, n)).astype(d.numpy) for d in dts]
    for x in xs:  # range ends
        x[0, rng.random(n) < 0.2] = x.dtype.type(np.iinfo(x.dtype).min)
        x[0, rng.random(n) < 0.2] = x.dtype.type(np.iinfo(x.dtype).max)
    out = DType.I8 if signed else DType.U8
    tensors = [Tensor("a", dts[0], shape), Tensor("b", dts[1], shape), Tensor("y", out, shape)]
    try:
        graph = IntegerGraph(tensors, ["a", "b"], ["y"], [Op(OpType.ADD, "add", ["a", "b"], ["y"], attrs)]).validate()
    except Exception as e:  # noqa: BLE001 - parameters the format rejects
        raise AssertionError(f"test built an invalid ADD: {e}") from e
    want = execute(graph, xs).outputs[0]
    cg = rt.CompiledGraph(graph)
    for path in PATHS:
        np.testing.assert_array_equal(cg.run(*xs, path=path), want, err_msg=f"path {path} attrs {attrs}")


def _near_ties(m: int, right: int, lo: int, hi: int, rounding: int, rng) -> np.ndarray:
    """Accumulators t whose t*m / 2^(31+right) lies on or within a few steps of every rounding
    boundary whose result lands in [lo - 2, hi + 2] (half-integers; integers for FLOOR), plus
    random ones: the values a float estimate of the FIXED_SINGLE stage could get wrong."""
    s = 31 + right
    offset = 0.0 if rounding == 2 else 0.5
    ks = np.arange(lo - 2, hi + 3)
    if ks.size > 400:
        ks = rng.choice(ks, 400, replace=False)
    cand = []
    for k in ks:
        num = (2 * int(k) + int(2 * offset)) << (s - 1)  # (k + offset) * 2^s, exactly
        t0 = num // m if m else 0
        cand.extend(t0 + d for d in range(-3, 4))
    vals = np.array([v for v in cand if -(2**31) <= v < 2**31], np.int64)
    return np.concatenate([vals, rng.integers(-(1 << 31), 1 << 31, 64), rng.integers(-4096, 4096, 64)])


_TIE_MULTS = [1, 3, 1 << 30, 3 << 28, (1 << 31) - 1, (1 << 30) + 1, 1518500250, 1717986918]


@settings(max_examples=80, deadline=None)
@given(m=st.one_of(st.sampled_from(_TIE_MULTS), st.integers(1, (1 << 31) - 1)), right=st.integers(0, 31),
       rounding=st.integers(0, 3), seed=st.integers(0, 2**31), out_signed=st.booleans(),
       zp_edge=st.sampled_from([None, -(1 << 16), 1 << 16]), n_extra=st.integers(0, 40))
def test_fixed_single_per_tensor_near_ties(m, right, rounding, seed, out_signed, zp_edge, n_extra):
    """FIXED_SINGLE per tensor with a right shift (the stage the conv paths run per channel row;
    AVX2 decides it with a checked float32 estimate and recomputes flagged vectors exactly):
    accumulators on and next to every rounding boundary that lands inside the clamp range, and
    random ones, for every rounding, zero points up to +-2^16, narrowed clamps, and lengths
    that leave 32-, 8- and partial blocks.  Equal to the formula of qdsl/graph/requant.py."""
    rng = np.random.default_rng(seed)
    lo, hi = (-128, 127) if out_signed else (0, 255)
    zp = int(rng.integers(lo, hi + 1)) if zp_edge is None else zp_edge
    qmin = int(rng.integers(lo, hi + 1)) if rng.random() < 0.3 else lo
    qmax = int(rng.integers(qmin, hi + 1)) if rng.random() < 0.3 else hi
    vals = _near_ties(m, right, qmin - zp, qmax - zp, rounding, rng)
    vals = rng.permutation(vals)[: max(1, vals.size - n_extra)]
    acc = vals.reshape(1, -1)
    r = Rescale(2, (m,), (right,), rounding)
    stage = K.OutputStage([m], [right], zero_point=zp, qmin=qmin, qmax=qmax, kind=2, rounding=rounding)
    want = np.clip(apply_rescale(acc, r, axis=1) + zp, qmin, qmax)
    for path in PATHS:
        got = K.requantize(acc.astype(np.int32), stage, np.int8 if out_signed else np.uint8, path=path)
        np.testing.assert_array_equal(got.astype(np.int64), want, err_msg=f"path {path} m {m} right {right}")


@pytest.mark.parametrize("m,right", [(1 << 30, 0), ((1 << 30) + 1, 0), (1518500250, 1), ((1 << 31) - 1, 3),
                                     (3 << 28, 2), (1717986918, 5)])
@pytest.mark.parametrize("rounding", [0, 1, 2, 3])
def test_fixed_single_per_tensor_exhaustive(m, right, rounding):
    """Every accumulator whose FIXED_SINGLE result reaches the U8 and I8 ranges (and beyond, to
    the saturation on both sides), for factors from 1/2 down to 1/64, every rounding: the vector
    stages equal the formula on all of them."""
    factor = m / 2.0 ** (31 + right)
    lim = int(420 / factor)
    acc = np.arange(-lim, lim + 1, dtype=np.int64)
    acc = np.resize(acc, (1, acc.size))
    r = Rescale(2, (m,), (right,), rounding)
    stage_u8 = K.OutputStage([m], [right], zero_point=17, qmin=0, qmax=255, kind=2, rounding=rounding)
    stage_i8 = K.OutputStage([m], [right], zero_point=-3, qmin=-128, qmax=127, kind=2, rounding=rounding)
    rescaled = apply_rescale(acc, r, axis=1)
    for stage, dtype in ((stage_u8, np.uint8), (stage_i8, np.int8)):
        want = np.clip(rescaled + stage.zero_point, stage.qmin, stage.qmax)
        for path in PATHS:
            got = K.requantize(acc.astype(np.int32), stage, dtype, path=path)
            np.testing.assert_array_equal(got.astype(np.int64), want, err_msg=f"path {path}")


@settings(max_examples=30, deadline=None)
@given(rounding=st.integers(0, 3), cols=st.sampled_from([1, 7, 8, 9, 33, 255, 256, 257, 300]),
       rows=st.integers(1, 4), seed=st.integers(0, 2**31), out_signed=st.booleans())
def test_per_channel_single_rounding_stage_equals_formula(rounding, cols, rows, seed, out_signed):
    """FIXED_SINGLE with a multiplier and a right shift >= 0 per channel (the NHWC depthwise
    conv's pixel rows): the AVX2 float estimate per column, in chunks of 256 channels, with
    the integer form for undecided lanes, equals the formula on ties and corner sums."""
    rng = np.random.default_rng(seed)
    mult = rng.integers(0, 1 << 31, cols)
    mult[rng.random(cols) < 0.2] = (1 << 31) - 1
    mult[rng.random(cols) < 0.1] = 0
    shift = rng.integers(0, 32, cols)
    acc = rng.integers(-(1 << 31), 1 << 31, (rows + 2, cols))
    acc[0, :] = rng.choice(_CORNERS, cols)
    acc[1, :] = rng.integers(-2000, 2000, cols) * (1 << int(rng.integers(0, 12)))  # rounding ties
    lo, hi = (-128, 127) if out_signed else (0, 255)
    zp = int(rng.integers(lo, hi + 1))
    qmin = int(rng.integers(lo, zp + 1)) if rng.random() < 0.3 else lo
    stage = K.OutputStage(mult, shift, zero_point=zp, qmin=qmin, qmax=hi, kind=2, rounding=rounding)
    r = Rescale(2, tuple(int(v) for v in mult), tuple(int(v) for v in shift), rounding)
    want = np.clip(apply_rescale(acc, r, axis=1) + zp, qmin, hi)
    for path in PATHS:
        got = K.requantize(acc.astype(np.int32), stage, np.int8 if out_signed else np.uint8, path=path)
        np.testing.assert_array_equal(got.astype(np.int64), want, err_msg=f"path {path}")

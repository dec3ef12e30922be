"""Every optimized kernel path equals the scalar reference and numpy int64, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.runtime import kernels as K  # noqa: E402

PATHS = [p for p in ("ref", "portable", "avx2", "avxvnni", "avx512", "amx") if rt.available() and p in K.paths()["cpu"]]
SIZES = st.sampled_from([1, 2, 3, 5, 6, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 129])


def _expected(a, a_zp, w, w_zp, bias):
    acc = (a.astype(np.int64) - a_zp) @ (w.astype(np.int64) - np.asarray(w_zp).reshape(-1, 1)).T
    if bias is not None:
        acc = acc + bias
    return acc.astype(np.int32)


def _agree(results: dict, expected: np.ndarray):
    bad = [p for p, r in results.items() if not np.array_equal(r, expected)]
    assert not bad, f"paths disagreeing with numpy: {bad}; agreeing: {[p for p in results if p not in bad]}"


@settings(max_examples=40, deadline=None)
@given(m=SIZES, k=SIZES, n=SIZES, bits=st.sampled_from([8, 4, 2]), signed_a=st.booleans(),
       use_zp=st.booleans(), seed=st.integers(0, 2**31))
def test_gemm_all_paths_equal_numpy(m, k, n, bits, signed_a, use_zp, seed):
    rng = np.random.default_rng(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    w = rng.integers(lo, hi + 1, (n, k)).astype(np.int8)
    w_zp = rng.integers(-3, 4, n) if use_zp else np.zeros(n, np.int64)
    if signed_a:
        a, a_zp = rng.integers(-128, 128, (m, k)).astype(np.int8), int(rng.integers(-128, 128))
    else:
        a, a_zp = rng.integers(0, 256, (m, k)).astype(np.uint8), int(rng.integers(0, 256))
    bias = rng.integers(-1000, 1000, n).astype(np.int32)
    pw = K.pack_weights(w, bits=bits, zero_point=w_zp if use_zp else None)
    got = {p: K.gemm(a, pw, a_zero_point=a_zp, bias=bias, path=p) for p in PATHS}
    _agree(got, _expected(a, a_zp, w, w_zp, bias))


@settings(max_examples=12, deadline=None)
@given(m=st.sampled_from([8, 9, 31, 129, 130, 257, 300]), k=st.sampled_from([63, 64, 65, 511, 512, 513, 1000, 2049]),
       n=st.sampled_from([1, 16, 17, 31, 33, 96, 100]), bits=st.sampled_from([8, 4, 2]), signed_a=st.booleans(),
       seed=st.integers(0, 2**31))
def test_gemm_large_blocks_all_paths_equal_numpy(m, k, n, bits, signed_a, seed):
    """Shapes past every blocking edge: several row blocks (AMX: 128 rows, VNNI: 96), several
    K blocks (512 bytes of K), odd panel counts, K not a multiple of 64."""
    rng = np.random.default_rng(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    w = rng.integers(lo, hi + 1, (n, k)).astype(np.int8)
    if signed_a:
        a, a_zp = rng.integers(-128, 128, (m, k)).astype(np.int8), int(rng.integers(-128, 128))
    else:
        a, a_zp = rng.integers(0, 256, (m, k)).astype(np.uint8), int(rng.integers(0, 256))
    pw = K.pack_weights(w, bits=bits)
    got = {p: K.gemm(a, pw, a_zero_point=a_zp, path=p) for p in PATHS if p != "ref"}
    _agree(got, _expected(a, a_zp, w, np.zeros(n, np.int64), None))


@pytest.mark.parametrize("path", PATHS)
def test_gemm_saturation_corners(path):
    # u8 255 * s8 -128 pairs would saturate int16 in vpmaddubsw; zero point -128 on s8
    k = 67
    for a_val, a_zp, dtype in [(255, 0, np.uint8), (0, 255, np.uint8), (127, -128, np.int8), (-128, 127, np.int8)]:
        a = np.full((7, k), a_val, dtype=dtype)
        for w_val in (-128, 127):
            w = np.full((19, k), w_val, dtype=np.int8)
            got = K.gemm(a, K.pack_weights(w), a_zero_point=a_zp, path=path)
            np.testing.assert_array_equal(got, _expected(a, a_zp, w, 0, None))


@pytest.mark.parametrize("wmag", [8, 16, 32, 64, 65, 127])
@pytest.mark.parametrize("m", [1, 6, 7, 100])
def test_gemm_maddubs_bound_all_paths(wmag, m):
    """AVX2 runs vpmaddubsw when no weight pair can saturate int16, adding S = 32767 //
    (255 * pair bound) pair sums in int16 (|w| <= 8: S = 8; 16: 4; 32: 2; 64: 1; a pair
    of 65 + 64 can saturate: the int16 kernel).  Activations at 255 with every pair at the
    bound reach exactly S * 255 * bound, so an S one too large would wrap."""
    rng = np.random.default_rng(wmag * 1000 + m)
    k, n = 517, 37
    for case in range(4):
        if case == 0:  # every pair at the positive bound
            w = np.full((n, k), wmag, np.int8)
        elif case == 1:  # at the negative bound
            w = np.full((n, k), -wmag, np.int8)
        else:
            w = rng.integers(-wmag, wmag + 1, (n, k)).astype(np.int8)
            w[:, :2] = wmag  # keep the bound reached
        if wmag == 65:  # one pair 65 + 64: may saturate, so no vpmaddubsw
            w = np.clip(w, -64, 64)
            w[3, 10:12] = (65, 64)
        for a, a_zp in [(np.full((m, k), 255, np.uint8), 0), (np.full((m, k), 127, np.int8), -128),
                        (rng.integers(0, 256, (m, k)).astype(np.uint8), int(rng.integers(0, 256))),
                        (rng.integers(-128, 128, (m, k)).astype(np.int8), 3)]:
            pw = K.pack_weights(w)
            got = {p: K.gemm(a, pw, a_zero_point=a_zp, path=p) for p in PATHS}
            _agree(got, _expected(a, a_zp, w, np.zeros(n, np.int64), None))


@pytest.mark.parametrize("max_code", [1, 15, 16, 17, 63, 64, 127, 128, 129, 130, 254, 255])
@pytest.mark.parametrize("m", [1, 7, 100])
def test_gemm_activation_bound_all_paths(max_code, m):
    """Activation codes bounded by ``a_max_code`` let full-range int8 weights take the
    vpmaddubsw kernel with S = 32767 // (max_code * pair bound) (weights 127: pair 254;
    129 -> S 1, 130 -> S 0, 16 -> 8, 17 -> 7, run as 4).  Every activation at the bound and
    every pair at the bound reach S * max_code * pair exactly, so an S one too large (or a
    bound taken one too small: 130 as 129, 17 as 16) would saturate or wrap."""
    rng = np.random.default_rng(max_code * 100 + m)
    k, n = 261, 35
    w_cases = [np.full((n, k), -128, np.int8), np.full((n, k), 127, np.int8),
               rng.integers(-128, 128, (n, k)).astype(np.int8)]
    for w in w_cases:
        pw = K.pack_weights(w)
        for a, a_zp, bound in [
            (np.full((m, k), max_code, np.uint8), 0, max_code),
            (rng.integers(0, max_code + 1, (m, k)).astype(np.uint8), int(rng.integers(0, max_code + 1)), max_code),
            # int8 activations: the bound is on value + 128
            (np.full((m, k), max_code - 128, np.int8), -128, max_code),
        ]:
            got = {p: K.gemm(a, pw, a_zero_point=a_zp, path=p, a_max_code=bound) for p in PATHS}
            _agree(got, _expected(a, a_zp, w, np.zeros(n, np.int64), None))


def test_gemm_activation_bound_is_checked():
    w = np.full((16, 64), -128, np.int8)
    pw = K.pack_weights(w)
    a = np.full((7, 64), 127, np.uint8)  # 7 rows: below the AMX driver, which needs no bound
    a[5, 33] = 128  # one code above the stated bound: saturating pairs if it were trusted
    for path in PATHS:
        if path == "ref":  # the reference kernel needs no bound and ignores it
            continue
        if path in ("avxvnni", "avx512", "amx") or (path == "avx2" and K.evex_vnni()):
            # vpdpbusd (the VNNI paths; EVEX on the AVX2 path where K.evex_vnni()) is exact for
            # any codes: the bound is neither needed nor scanned, and the result is exact
            np.testing.assert_array_equal(K.gemm(a, pw, path=path, a_max_code=127),
                                          _expected(a, 0, w, np.zeros(16, np.int64), None))
        else:
            with pytest.raises(rt.RuntimeError_, match="above the stated bound max_code=127"):
                K.gemm(a, pw, path=path, a_max_code=127)
    with pytest.raises(rt.RuntimeError_, match="outside"):
        K.gemm(a, pw, a_max_code=256)
    np.testing.assert_array_equal(K.gemm(a, pw), _expected(a, 0, w, np.zeros(16, np.int64), None))


@pytest.mark.parametrize("path", PATHS)
def test_gemm_requantized_output_equals_reference_stage(path):
    from qdsl.graph.ir import Rescale
    from qdsl.graph.requant import apply_rescale

    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, (13, 70)).astype(np.uint8)
    w = rng.integers(-128, 128, (37, 70)).astype(np.int8)
    mult = rng.integers(1 << 30, (1 << 31) - 1, 37)
    shift = rng.integers(-2, 20, 37)
    stage = K.OutputStage(mult, shift, zero_point=5, qmin=-100, qmax=120)
    got = K.gemm(a, K.pack_weights(w), a_zero_point=128, stage=stage, path=path)
    acc = _expected(a, 128, w, 0, None).astype(np.int64)
    want = np.clip(apply_rescale(acc, Rescale(0, tuple(mult), tuple(shift)), axis=1) + 5, -100, 120)
    np.testing.assert_array_equal(got, want.astype(np.int8))


@settings(max_examples=30, deadline=None)
@given(m=SIZES, k=st.sampled_from([1, 7, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1024, 2049, 7936, 8192]), n=SIZES,
       seed=st.integers(0, 2**31))
def test_binary_gemm_all_paths_equal_numpy(m, k, n, seed):
    rng = np.random.default_rng(seed)
    a = rng.choice([-1, 1], (m, k)).astype(np.int8)
    w = rng.choice([-1, 1], (n, k)).astype(np.int8)
    bits, pw = K.bitpack(a), K.pack_weights(w, bits=1)
    got = {p: K.binary_gemm(bits, pw, path=p) for p in PATHS}
    _agree(got, (a.astype(np.int64) @ w.T.astype(np.int64)).astype(np.int32))


def test_bitpack_one_hot():
    for k in (1, 63, 64, 65, 130):
        for j in range(k):
            s = np.ones((1, k), np.int8)
            s[0, j] = -1
            bits = K.bitpack(s)
            assert bits.shape == (1, (k + 63) // 64)
            expect = np.zeros_like(bits)
            expect[0, j // 64] = np.uint64(1) << np.uint64(j % 64)
            np.testing.assert_array_equal(bits, expect)


_CORNERS = [0, 1, -1, 2, -2, 3, 127, -128, 255, 1 << 15, -(1 << 15), (1 << 30) + 1, (1 << 31) - 1, -(1 << 31),
            -(1 << 31) + 1, 12345678, -12345678]


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from([0, 1, 2]), rounding=st.integers(0, 3), channels=st.sampled_from([1, 3, 8, 11]),
       seed=st.integers(0, 2**31), out_signed=st.booleans())
def test_requantize_equals_export_requant(kind, rounding, channels, seed, out_signed):
    from qdsl.graph.ir import Rescale
    from qdsl.graph.requant import apply_rescale

    rng = np.random.default_rng(seed)
    if kind in (0, 2):  # FIXED (gemmlowp, rounding 0) and FIXED_SINGLE (any rounding)
        rounding = 0 if kind == 0 else rounding
        mult = rng.integers(0, 1 << 31, channels)
        mult[rng.random(channels) < 0.2] = (1 << 31) - 1
        mult[rng.random(channels) < 0.2] = 1 << 30  # exact halves: rounding ties
        shift = rng.integers(-31, 32, channels)
        shift[rng.random(channels) < 0.5] = rng.integers(0, 24)  # results inside the int8 range
    else:
        mult = np.ones(channels, np.int64)
        shift = rng.integers(-31, 63, channels)
        shift[rng.random(channels) < 0.5] = rng.integers(0, 12)
    acc = rng.integers(-(1 << 31), 1 << 31, (9, channels))
    acc[0, :] = rng.choice(_CORNERS, channels)
    acc[1, :] = rng.integers(-70000, 70000, channels)
    acc[2, :] = rng.integers(-1000, 1000, channels) * (1 << int(rng.integers(0, 8)))  # ties for small shifts
    lo, hi = (-128, 127) if out_signed else (0, 255)
    zp = int(rng.integers(lo, hi + 1))
    stage = K.OutputStage(mult, shift, zero_point=zp, qmin=lo, qmax=hi, kind=kind, rounding=rounding)
    r = Rescale(kind, tuple(mult), tuple(shift), rounding)
    want = np.clip(apply_rescale(acc, r, axis=1) + zp, lo, hi)
    for path in PATHS:
        got = K.requantize(acc.astype(np.int32), stage, np.int8 if out_signed else np.uint8, path=path)
        np.testing.assert_array_equal(got.astype(np.int64), want, err_msg=f"path {path}")


@pytest.mark.parametrize("kind", [1, 2])
@pytest.mark.parametrize("rounding", [0, 1, 2, 3])
def test_requantize_ties_every_rounding(kind, rounding):
    """Exact halves, both signs, odd and even neighbours, on 16 channels (two full AVX2
    vectors per row) and per-tensor: every rounding rule must pick the reference's side."""
    from qdsl.graph.ir import Rescale
    from qdsl.graph.requant import apply_rescale

    right = np.arange(16) % 8  # FIXED_SINGLE: factor 2^30 / 2^(31 + right); POT: 2^-(right + 1)
    mult = np.full(16, 1 << 30 if kind == 2 else 1, np.int64)
    shift = right if kind == 2 else right + 1
    k = np.arange(-20, 20)[:, None]
    acc = ((2 * k + 1) << right) + np.zeros((1, 16), np.int64)  # (2k + 1) / 2: ties
    acc = np.concatenate([acc, acc + 1, acc - 1])
    for channels in (16, 1):
        m, sh = (mult, shift) if channels == 16 else (mult[:1], shift[3:4])
        a = acc if channels == 16 else ((2 * k + 1) << int(sh[0] - (kind == 1))) + np.zeros((1, 16), np.int64)
        stage = K.OutputStage(m, sh, zero_point=0, qmin=-128, qmax=127, kind=kind, rounding=rounding)
        want = np.clip(apply_rescale(a, Rescale(kind, tuple(m), tuple(sh), rounding), axis=1), -128, 127)
        for path in PATHS:
            got = K.requantize(a.astype(np.int32), stage, np.int8, path=path)
            np.testing.assert_array_equal(got.astype(np.int64), want, err_msg=f"path {path}")


def test_bad_arguments_raise():
    with pytest.raises(rt.RuntimeError_, match="outside int4 range"):
        K.pack_weights(np.full((2, 3), 9, np.int8), bits=4)
    pw = K.pack_weights(np.ones((4, 5), np.int8))
    with pytest.raises(rt.RuntimeError_, match="K=6"):
        K.gemm(np.zeros((2, 6), np.uint8), pw)
    with pytest.raises(rt.RuntimeError_, match="zero point"):
        K.gemm(np.zeros((2, 5), np.uint8), pw, a_zero_point=-1)
    with pytest.raises(rt.RuntimeError_, match="shift"):
        K.requantize(np.zeros((1, 1), np.int32), K.OutputStage([1 << 30], [40]))
    with pytest.raises(rt.RuntimeError_, match="unknown kernel path"):
        K.gemm(np.zeros((2, 5), np.uint8), pw, path="sse9")


def test_gemm_general_fast_call_keeps_results_and_messages():
    """``gemm`` with a stage, a bias or a_max_code calls the C entry without normalising its
    arguments when they are already in form (contiguous int32 bias of shape (n,), a known
    output dtype): results equal the normalised call's (a bias list, a strided activation
    view), and a failing call still raises the C++ message (it is redone by the slow call)."""
    rng = np.random.default_rng(11)
    a = rng.integers(0, 256, (9, 40)).astype(np.uint8)
    w = rng.integers(-128, 128, (21, 40)).astype(np.int8)
    pw = K.pack_weights(w)
    bias = rng.integers(-1000, 1000, 21).astype(np.int32)
    stage = K.OutputStage([1 << 30], [9], zero_point=3, qmin=0, qmax=255)
    want = _expected(a, 5, w, np.zeros(21, np.int64), bias)
    np.testing.assert_array_equal(K.gemm(a, pw, a_zero_point=5, bias=bias), want)
    np.testing.assert_array_equal(K.gemm(a, pw, a_zero_point=5, bias=list(bias)), want)  # normalised
    np.testing.assert_array_equal(K.gemm(a, pw, a_zero_point=5, bias=bias, a_max_code=255), want)
    wide = np.zeros((9, 80), np.uint8)
    wide[:, ::2] = a
    np.testing.assert_array_equal(K.gemm(wide[:, ::2], pw, a_zero_point=5, bias=bias), want)  # strided: copied
    fast = K.gemm(a, pw, a_zero_point=5, bias=bias, stage=stage, out_dtype=np.uint8)
    assert fast.dtype == np.uint8
    np.testing.assert_array_equal(fast, K.gemm(a, pw, a_zero_point=5, bias=bias, stage=stage, out_dtype=np.uint8,
                                               path="ref"))
    with pytest.raises(rt.RuntimeError_, match="zero point"):
        K.gemm(a, pw, a_zero_point=300, bias=bias, stage=stage, out_dtype=np.uint8)
    with pytest.raises(rt.RuntimeError_, match="code bound"):
        K.gemm(a, pw, a_zero_point=5, a_max_code=256)
    with pytest.raises(rt.RuntimeError_, match="clamp"):
        K.gemm(a, pw, stage=K.OutputStage([1 << 30], [9], qmin=0, qmax=255), out_dtype=np.int8)
    with pytest.raises(rt.RuntimeError_, match="bias must have shape"):
        K.gemm(a, pw, bias=bias[:5])


def test_threads_do_not_change_results():
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, (50, 300)).astype(np.uint8)
    pw = K.pack_weights(rng.integers(-128, 128, (70, 300)).astype(np.int8))
    before = rt.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            rt.set_num_threads(n)
            outs.append(K.gemm(a, pw, a_zero_point=7))
    finally:
        rt.set_num_threads(before)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m,k,n", [(1, 7, 16), (5, 600, 48), (97, 1030, 32), (200, 64, 50), (3, 300, 64)])
def test_int32_output_in_place_equals_numpy(threads, m, k, n):
    """A plain int32 output (no bias, no stage) of whole 16-column panels is accumulated in
    place by the int16 kernels (csrc/gemm.cc `direct`); N = 50 (a partial panel) and the
    bias case keep the block buffer.  1 and 2 threads (GEMV-like shapes split the panels,
    so one task may be in place and another buffered), every path equal to numpy."""
    rng = np.random.default_rng(m * 1000 + n)
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    w = rng.integers(-128, 128, (n, k)).astype(np.int8)
    bias = rng.integers(-1000, 1000, n).astype(np.int32)
    pw = K.pack_weights(w)
    before = rt.get_num_threads()
    rt.set_num_threads(threads)
    try:
        for b in (None, bias):
            got = {p: K.gemm(a, pw, a_zero_point=77, bias=b, path=p) for p in PATHS}
            _agree(got, _expected(a, 77, w, np.zeros(n, np.int64), b))
    finally:
        rt.set_num_threads(before)


@settings(max_examples=25, deadline=None)
@given(m=st.sampled_from([1, 2, 5, 6, 7, 95, 96, 97, 193]), k=st.sampled_from([1, 3, 4, 5, 63, 1023, 1024, 1025, 2049]),
       n=st.sampled_from([1, 15, 16, 17, 33, 673, 700]), signed_a=st.booleans(), zp_end=st.booleans(),
       use_bias=st.booleans(), out=st.sampled_from(["i32", "u8", "i8", "i32 stage"]), threads=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**31))
def test_gemm_quad_driver_edges_equal_reference(m, k, n, signed_a, zp_end, use_bias, out, threads, seed):
    """The u8 x s8 driver of the int GEMM (csrc/gemm.cc GemmQuadDriver, on the VNNI paths and
    EVEX vpdpbusd on AVX2; QDSL_EVEX_VNNI=0 reruns this on the vpmaddubsw / int16 kernels):
    rows past the 96-row block and the 6-row strips, K blocks of <= 256 k-quads (K 1025:
    257 quads, two blocks; 2049: three) and K not a multiple of 4, column chunks (673 and
    700 columns pass the 672 of a 96-row chunk) with a partial last panel, the bias and the
    zero-point correction as the first block's start values, the plain int32 output written
    in place (a partial last panel through a buffer), u8 / i8 / rescaled int32 stages, zero
    points and codes at the dtype's ends, 1 and 2 threads (GEMV-like shapes split the
    panels: start values per task): every path == the reference kernel."""
    rng = np.random.default_rng(seed)
    lo, hi = (-128, 127) if signed_a else (0, 255)
    a = rng.integers(lo, hi + 1, (m, k)).astype(np.int8 if signed_a else np.uint8)
    if zp_end:  # codes and zero point at the ends: the largest |a - zp| and the int32 wrap
        a_zp = int(rng.choice([lo, hi]))
        a[rng.random((m, k)) < 0.5] = hi if a_zp == lo else lo
    else:
        a_zp = int(rng.integers(lo, hi + 1))
    w = rng.integers(-128, 128, (n, k)).astype(np.int8)
    w[rng.random((n, k)) < 0.3] = -128
    bias = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32) if use_bias else None
    stage, dtype = None, np.int32
    if out != "i32":
        dtype = {"u8": np.uint8, "i8": np.int8, "i32 stage": np.int32}[out]
        qlo, qhi = {"u8": (0, 255), "i8": (-128, 127), "i32 stage": (-(1 << 20), 1 << 20)}[out]
        stage = K.OutputStage(rng.integers(1 << 30, (1 << 31) - 1, n), rng.integers(-4, 24, n),
                              zero_point=int(rng.integers(-3, 4)) if out == "i32 stage" else int(rng.integers(qlo, qhi + 1)),
                              qmin=qlo, qmax=qhi)
    pw = K.pack_weights(w)
    before = rt.get_num_threads()
    rt.set_num_threads(threads)
    try:
        got = {p: K.gemm(a, pw, a_zero_point=a_zp, bias=bias, stage=stage, out_dtype=dtype, path=p) for p in PATHS}
    finally:
        rt.set_num_threads(before)
    if stage is None:
        _agree(got, _expected(a, a_zp, w, np.zeros(n, np.int64), bias))
    else:
        _agree(got, got["ref"])

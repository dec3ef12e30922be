"""Accumulators wider than 32 bits (``acc_bits`` 33..64): exact int64 sums, wrap/saturate at
the stated width, and an output stage that rescales the wide value without first saturating
it to int32 (docs/qgraph.md §4.3). The reference executor must equal an independent
computation on Python integers / fractions, and every C++ path must equal the reference."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import qdsl.runtime as rt
from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Rescale, RescaleKind, Rounding, Tensor
from qdsl.graph.reference import execute
from qdsl.graph.requant import INT32_MAX, INT32_MIN, quantize_multiplier
from qdsl.graph.validate import infer_output

native = pytest.mark.skipif(not rt.available(), reason="C++ runtime not built")


def _linear(k: int, acc_bits: int, overflow: int, rescale: Rescale, out: DType) -> IntegerGraph:
    # row 0: (255 - 0) * (255 - 0) per term; row 1: (255 - 0) * (0 - 255): the all-max codes
    w = np.zeros((2, k), np.uint8)
    w[0] = 255
    lo, hi = out.range
    attrs = {"in_zp": 0, "w_zp": [0, 255], "acc_bits": acc_bits, "overflow": overflow,
             **OutputStage(rescale, 0, lo, hi).attrs()}
    acts = [Tensor("x", DType.U8, (-1, k))]
    consts = [Tensor("w", DType.U8, w.shape, w)]
    op = Op(OpType.LINEAR, "fc", ["x", "w"], ["y"], attrs)
    _, shape = infer_output(0, op, acts + consts, Tensor("y", out, (1,)))
    return IntegerGraph(acts + consts + [Tensor("y", out, shape)], ["x"], ["y"], [op]).validate()


def _round(v: Fraction, mode: Rounding) -> int:
    f = v.numerator // v.denominator
    rem = v - f
    if mode == Rounding.FLOOR:
        return f
    if mode == Rounding.HALF_UP:
        return f + (rem >= Fraction(1, 2))
    if mode == Rounding.HALF_EVEN:
        return f + (rem > Fraction(1, 2) or (rem == Fraction(1, 2) and f % 2 == 1))
    return f + (rem > Fraction(1, 2) or (rem == Fraction(1, 2) and v >= 0))  # HALF_AWAY


def _expected(s: int, acc_bits: int, overflow: int, rescale: Rescale, out: DType) -> tuple[int, bool]:
    """The documented semantics on Python integers: wrap/saturate the exact sum, then rescale."""
    lo, hi = -(1 << (acc_bits - 1)), (1 << (acc_bits - 1)) - 1
    over = not lo <= s <= hi
    acc = s if not over else (min(max(s, lo), hi) if overflow else ((s - lo) % (1 << acc_bits)) + lo)
    m, sh = rescale.multiplier[0], rescale.shift[0]
    if rescale.kind == RescaleKind.POT:
        r = _round(Fraction(acc, 2 ** sh), rescale.rounding)
    elif rescale.kind == RescaleKind.FIXED_SINGLE:
        r = _round(Fraction(acc * m, 2 ** (31 + sh)), rescale.rounding)
    else:  # gemmlowp: nearest with ties up, then half away from zero
        r = _round(_round(Fraction(acc * m, 2 ** 31), Rounding.HALF_UP) / Fraction(2 ** sh), Rounding.HALF_AWAY)
    r = min(max(r, INT32_MIN), INT32_MAX)
    return min(max(r, out.range[0]), out.range[1]), over


def _rescales():
    m, s = quantize_multiplier(0.7 * 2.0 ** -24)
    return {
        "pot": Rescale(RescaleKind.POT, [1], [24], Rounding.HALF_EVEN),
        "single": Rescale(RescaleKind.FIXED_SINGLE, [m], [s], Rounding.HALF_AWAY),
        "gemmlowp": Rescale(RescaleKind.FIXED, [m], [s], Rounding.HALF_AWAY),
    }


# fan-in > 2^16 everywhere; 9e6 terms of 255 * 255 reach 2^39 (5.9e11 > 5.5e11), so a 40-bit
# accumulator overflows too; 48 and 64 bits hold every sum exactly.
CASES = [(32, 70_000), (40, 9_000_000), (48, 70_000), (48, 9_000_000), (64, 9_000_000)]


@pytest.mark.parametrize("acc_bits,k", CASES)
@pytest.mark.parametrize("overflow", [0, 1], ids=["wrap", "saturate"])
@pytest.mark.parametrize("kind", sorted(_rescales()))
def test_wide_accumulator_all_max_codes(acc_bits, k, overflow, kind):
    rescale = _rescales()[kind]
    out = DType.I32
    graph = _linear(k, acc_bits, overflow, rescale, out)
    x = np.full((1, k), 255, np.uint8)
    res = execute(graph, x)
    sums = (k * 255 * 255, -k * 255 * 255)
    want = [_expected(s, acc_bits, overflow, rescale, out) for s in sums]
    np.testing.assert_array_equal(res.outputs[0][0], [w for w, _ in want])
    assert res.overflow["fc"] == sum(o for _, o in want)
    assert (res.overflow["fc"] > 0) == (acc_bits < 64 and k * 65025 > (1 << (acc_bits - 1)))
    if rt.available():
        from qdsl.runtime import kernels as K

        cg = rt.CompiledGraph(graph)
        for path in [p for p in ("ref", "portable", "avx2", "avxvnni", "avx512", "amx") if p in K.paths()["cpu"]]:
            got = cg.run(x, path=path)
            np.testing.assert_array_equal(got, res.outputs[0], err_msg=f"path {path}")
            assert cg.overflow_counts()["fc"] == res.overflow["fc"], path


@native
@pytest.mark.parametrize("kind", sorted(_rescales()))
@pytest.mark.parametrize("acc_bits", [32, 33, 40, 48, 63, 64])
def test_cpp_equals_reference_on_random_wide_sums(kind, acc_bits):
    """Random codes, fan-in 2^17 + 3, I8 and I32 outputs: C++ == reference, bit for bit."""
    rng = np.random.default_rng(acc_bits)
    k = (1 << 17) + 3
    for out in (DType.I8, DType.I32):
        graph = _linear(k, acc_bits, int(rng.integers(0, 2)), _rescales()[kind], out)
        x = rng.integers(200, 256, size=(3, k)).astype(np.uint8)
        want = execute(graph, x)
        cg = rt.CompiledGraph(graph)
        np.testing.assert_array_equal(cg.run(x, path="ref"), want.outputs[0])
        np.testing.assert_array_equal(cg.run(x), want.outputs[0])


@native
@pytest.mark.parametrize("kind", sorted(_rescales()))
@pytest.mark.parametrize("acc_bits,overflow", [(32, 0), (40, 1), (48, 0), (64, 1)])
def test_wide_conv_paths_equal_reference(kind, acc_bits, overflow):
    """CONV1D/CONV2D with fan-in 32768·3 / 8192·3·3 of near-max codes (interior sums ~±5e9,
    beyond int32), padding 1 (border taps read the zero point): every C++ path == reference."""
    from qdsl.runtime import kernels as K

    rng = np.random.default_rng(acc_bits + overflow)
    for rank, cin in ((1, 32768), (2, 8192)):
        k = (3,) * rank
        w = rng.integers(250, 256, size=(2, cin) + k).astype(np.uint8)
        w[1] = rng.integers(0, 6, size=w.shape[1:])  # - 255: the negative row
        lo, hi = DType.I32.range
        attrs = {"stride": [1] * rank, "padding": [1] * rank, "dilation": [1] * rank, "groups": 1, "in_zp": 0,
                 "w_zp": [0, 255], "acc_bits": acc_bits, "overflow": overflow,
                 **OutputStage(_rescales()[kind], 0, lo, hi).attrs()}
        acts = [Tensor("x", DType.U8, (-1, cin) + (3,) * rank)]
        consts = [Tensor("w", DType.U8, w.shape, w)]
        op = Op(OpType.CONV2D if rank == 2 else OpType.CONV1D, "conv", ["x", "w"], ["y"], attrs)
        _, shape = infer_output(0, op, acts + consts, Tensor("y", DType.I32, (1,)))
        graph = IntegerGraph(acts + consts + [Tensor("y", DType.I32, shape)], ["x"], ["y"], [op]).validate()
        x = rng.integers(250, 256, size=(2, cin) + (3,) * rank).astype(np.uint8)
        want = execute(graph, x)
        assert (want.overflow["conv"] > 0) == (acc_bits == 32)
        cg = rt.CompiledGraph(graph)
        for path in [p for p in ("ref", "portable", "avx2", "avxvnni", "avx512", "amx") if p in K.paths()["cpu"]]:
            np.testing.assert_array_equal(cg.run(x, path=path), want.outputs[0], err_msg=f"path {path} rank {rank}")
            assert cg.overflow_counts()["conv"] == want.overflow["conv"], path

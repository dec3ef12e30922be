"""Requantization against exact rational arithmetic (``fractions.Fraction``).

The bounds tested here are the ones stated in qdsl/graph/requant.py and docs/qgraph.md §4.1.
"""

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from qdsl.graph.ir import Rescale, RescaleKind, Rounding
from qdsl.graph.requant import (
    INT32_MAX,
    INT32_MIN,
    apply_rescale,
    make_rescale,
    pot_shift,
    quantize_multiplier,
    rdbp,
    rounding_shift,
    srdhm,
)

int32s = st.integers(INT32_MIN, INT32_MAX)
# factors over the whole useful range: 2^-40 .. 2^20, log-uniform-ish
factors = st.builds(lambda m, e: math.ldexp(m, e), st.floats(0.5, 1.0, exclude_max=True), st.integers(-40, 20))


def round_half_away(q: Fraction) -> int:
    f = math.floor(abs(q) + Fraction(1, 2))
    return f if q >= 0 else -f


def round_mode(q: Fraction, mode: Rounding) -> int:
    f = math.floor(q)
    rem = q - f
    if mode is Rounding.FLOOR:
        return f
    if mode is Rounding.HALF_UP:
        return f + (rem >= Fraction(1, 2))
    if mode is Rounding.HALF_AWAY:
        return round_half_away(q)
    return f + (rem > Fraction(1, 2) or (rem == Fraction(1, 2) and f % 2 == 1))


def dist_to_half(q: Fraction) -> Fraction:
    return abs((q - Fraction(1, 2)) - round(q - Fraction(1, 2)))


@settings(max_examples=400, deadline=None)
@given(factors)
def test_quantize_multiplier_is_closest(real):
    m, s = quantize_multiplier(real)
    assert 0 <= m <= INT32_MAX and -31 <= s <= 31
    mq = Fraction(m) / 2 ** (31 + s)
    exact = Fraction(real)
    if s < 31:  # no precision reduction for tiny factors
        assert 2**30 <= m
        assert abs(mq - exact) <= Fraction(1, 2 ** (32 + s))
    else:
        assert abs(mq - exact) <= Fraction(1, 2**62) + exact / 2**30 or abs(mq - exact) <= Fraction(1, 2 ** 63)


@settings(max_examples=1000, deadline=None)
@given(int32s, factors)
def test_fixed_rescale_bounds(x, real):
    m, s = quantize_multiplier(real)
    left = max(-s, 0)
    assume(INT32_MIN <= x * 2**left <= INT32_MAX)  # the left shift saturates otherwise (documented)
    r = int(apply_rescale(np.array([x]), Rescale(RescaleKind.FIXED, [m], [s]))[0])
    right = max(s, 0)
    xm_q = Fraction(x * m * 2**left) / 2 ** (31 + right)
    # two roundings half away: at most 1/2 + 2^-(right+1) from the exact product with Mq
    assert abs(r - xm_q) <= Fraction(1, 2) + Fraction(1, 2 ** (right + 1))
    # and equal to one rounding except within 2^-(right+1) of a half-integer (double rounding)
    if r != round_half_away(xm_q):
        assert dist_to_half(xm_q) <= Fraction(1, 2 ** (right + 1))
        if right == 0:  # the only single-rounding exception: a negative tie goes up
            assert xm_q < 0 and dist_to_half(xm_q) == 0 and r == math.floor(xm_q + Fraction(1, 2))
    # relative to the true factor (when m was not reduced)
    if s < 31:
        bound = Fraction(1, 2) + Fraction(1, 2 ** (right + 1)) + abs(x) * Fraction(1, 2 ** (32 + s))
        assert abs(r - x * Fraction(real)) <= bound


@settings(max_examples=500, deadline=None)
@given(int32s, int32s)
def test_srdhm_is_rounded_high_product(a, b):
    got = int(srdhm(np.array([a]), np.array([b]))[0])
    if a == b == INT32_MIN:
        assert got == INT32_MAX
    else:
        assert got == math.floor(Fraction(a * b, 2**31) + Fraction(1, 2))


@pytest.mark.parametrize("a,b,want", [(-1, 2**30, 0), (1, 2**30, 1), (-3, 2**30, -1), (3, 2**30, 2),
                                      (INT32_MIN, INT32_MIN, INT32_MAX), (INT32_MIN, INT32_MAX, INT32_MIN + 1)])
def test_srdhm_ties_and_saturation(a, b, want):
    assert int(srdhm(np.array([a]), np.array([b]))[0]) == want


@settings(max_examples=500, deadline=None)
@given(int32s, st.integers(0, 31))
def test_rdbp_rounds_half_away(x, e):
    assert int(rdbp(np.array([x]), np.array([e]))[0]) == round_half_away(Fraction(x, 2**e))


@settings(max_examples=500, deadline=None)
@given(int32s, st.integers(-31, 62), st.sampled_from(list(Rounding)))
def test_pot_shift_exact(x, s, mode):
    got = int(rounding_shift(np.array([x]), np.array([s]), mode)[0])
    assert got == round_mode(Fraction(x) / Fraction(2) ** s, mode)
    clamped = int(apply_rescale(np.array([x]), Rescale(RescaleKind.POT, [1], [s], mode))[0])
    assert clamped == min(max(got, INT32_MIN), INT32_MAX)


def test_rounding_ties_spelled_out():
    x = np.array([-5, -3, -1, 1, 3, 5])  # x / 2: exact ties
    assert rounding_shift(x, 1, Rounding.HALF_AWAY).tolist() == [-3, -2, -1, 1, 2, 3]
    assert rounding_shift(x, 1, Rounding.HALF_EVEN).tolist() == [-2, -2, 0, 0, 2, 2]
    assert rounding_shift(x, 1, Rounding.HALF_UP).tolist() == [-2, -1, 0, 1, 2, 3]
    assert rounding_shift(x, 1, Rounding.FLOOR).tolist() == [-3, -2, -1, 0, 1, 2]
    assert rdbp(x, 1).tolist() == [-3, -2, -1, 1, 2, 3]


def test_make_rescale_picks_pot_only_for_exact_powers():
    r = make_rescale([0.25, 2.0, 1.0], Rounding.HALF_EVEN)
    assert r.kind is RescaleKind.POT and r.shift == (2, -1, 0) and r.rounding is Rounding.HALF_EVEN
    r = make_rescale([0.25, 0.3])
    assert r.kind is RescaleKind.FIXED and r.rounding is Rounding.HALF_AWAY
    assert make_rescale(0.25, allow_pot=False).kind is RescaleKind.FIXED
    assert pot_shift(0.3) is None and pot_shift(2.0**-40) == 40


def test_per_channel_rescale_runs_along_axis_1():
    x = np.full((2, 3, 4), 100)
    r = make_rescale([1.0, 0.5, 0.25])
    y = apply_rescale(x, r, axis=1)
    assert (y[:, 0] == 100).all() and (y[:, 1] == 50).all() and (y[:, 2] == 25).all()


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), 2.0**31])
def test_quantize_multiplier_rejects(bad):
    with pytest.raises(ValueError):
        quantize_multiplier(bad)


def test_tiny_factors_degrade_to_zero():
    assert quantize_multiplier(0.0) == (0, 0)
    assert quantize_multiplier(2.0**-70) == (0, 0)
    m, s = quantize_multiplier(2.0**-40)
    assert s == 31 and m == 2**22

"""Accumulator widths against brute force.

For random small layers (hypothesis): the worst-case width from bits and fan-in is at
least the width the actual integer weights can reach, and the tight bound from the
weights equals the exact extremes found by enumerating every input vector (every
zero point too, when the input is asymmetric).  Tiny layers are also enumerated over
every weight matrix to show the worst case itself is exact.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, strategies as st

from qdsl.lint.accumulator import (
    bits_for,
    operand_range,
    operand_ranges,
    rule_of_thumb_bits,
    tight_range,
    worst_case_bits,
    worst_case_range,
)
from qdsl.spec.model import Kind


def _codes(kind: Kind, bits: int, signed: bool, narrow: bool) -> list[int]:
    """Every integer code of an operand, from first principles (not from the module)."""
    if kind is Kind.BINARY:
        return [-1, 1] if signed else [0, 1]
    if kind is Kind.TERNARY:
        return [-1, 0, 1]
    if signed:
        return list(range(-(2 ** (bits - 1)) + int(narrow), 2 ** (bits - 1)))
    return list(range(0, 2**bits - int(narrow)))


operand = st.one_of(
    st.tuples(st.just(Kind.INT), st.integers(2, 4), st.booleans(), st.booleans(), st.booleans()),
    st.tuples(st.sampled_from([Kind.BINARY, Kind.TERNARY]), st.just(1), st.booleans(), st.just(False),
              st.just(True)),
)


def _brute(w_tilde: np.ndarray, x_codes: list[int], zero_points: list[int], n: int, bias) -> tuple[int, int]:
    values = sorted(set(x_codes))
    if len(values) ** n > 5000:  # a linear form is extreme at the box's corners: enough
        values = [values[0], values[-1]]
    vecs = np.array(list(itertools.product(values, repeat=n)), dtype=np.int64)
    lo = hi = None
    for z in zero_points:
        acc = (vecs - z) @ w_tilde.T + bias
        lo = int(acc.min()) if lo is None else min(lo, int(acc.min()))
        hi = int(acc.max()) if hi is None else max(hi, int(acc.max()))
    return lo, hi


@given(
    w=operand, x=operand, out=st.integers(1, 3), n=st.integers(1, 5), seed=st.integers(0, 2**31 - 1),
    with_bias=st.booleans(), known_zp=st.booleans(),
)
def test_worst_case_covers_and_tight_bound_is_exact(w, x, out, n, seed, with_bias, known_zp):
    rng = np.random.default_rng(seed)
    wk, wb, ws, wn, wsym = w
    xk, xb, xs, xn, xsym = x
    w_codes = _codes(wk, wb, ws, wn)
    x_codes = _codes(xk, xb, xs, xn)
    weights = rng.choice(w_codes, size=(out, n)).astype(np.int64)
    # an asymmetric weight has one zero point per output channel, anywhere in its range
    w_zp = rng.choice(w_codes, size=(out, 1)) if (wk is Kind.INT and not wsym) else np.zeros((out, 1), np.int64)
    w_tilde = weights - w_zp
    bias = rng.integers(-50, 50, size=out) if with_bias else np.zeros(out, np.int64)
    if xk is Kind.INT and not xsym:
        zps = [int(rng.choice(x_codes))] if known_zp else x_codes
    else:
        zps = [0]
    lo, hi = _brute(w_tilde, x_codes, zps, n, bias)

    if len(zps) == 1:
        x_ranges = [(min(x_codes) - zps[0], max(x_codes) - zps[0])]
    else:
        x_ranges = list(operand_ranges(xk, xb, xs, xn, xsym))
    assert tight_range(w_tilde, x_ranges, bias if with_bias else None) == (lo, hi)

    if not with_bias:
        needed = bits_for(lo, hi)
        wr = operand_range(wk, wb, ws, wn, wsym)
        xr = operand_range(xk, xb, xs, xn, xsym)
        assert worst_case_bits(wr, xr, n) >= needed


@pytest.mark.parametrize("wbits,wsigned,wnarrow,xbits,xsigned,xsym,n", [
    (2, True, False, 2, True, True, 2),
    (2, True, True, 2, False, True, 3),
    (3, True, False, 2, True, False, 2),
    (2, False, False, 2, True, True, 2),
    (2, True, False, 1, False, False, 3),
])
def test_worst_case_is_attained(wbits, wsigned, wnarrow, xbits, xsigned, xsym, n):
    """Enumerating every weight matrix row, zero point and input reaches the worst case exactly."""
    w_codes = _codes(Kind.INT, wbits, wsigned, wnarrow)
    x_codes = _codes(Kind.INT, xbits, xsigned, False)
    zps = [0] if xsym else x_codes
    rows = np.array(list(itertools.product(w_codes, repeat=n)), dtype=np.int64)
    lo, hi = _brute(rows, x_codes, zps, n, np.zeros(len(rows), np.int64))
    wr = operand_range(Kind.INT, wbits, wsigned, wnarrow, True)
    xr = operand_range(Kind.INT, xbits, xsigned, False, xsym)
    assert worst_case_range(wr, xr, n) == (lo, hi)


@given(st.integers(2, 16), st.integers(2, 16), st.integers(1, 1 << 20), st.booleans(), st.booleans())
def test_rule_of_thumb_bounds_exact_width(bw, bx, n, wnarrow, xsigned):
    wr = operand_range(Kind.INT, bw, True, wnarrow, True)
    xr = operand_range(Kind.INT, bx, xsigned, False, True)
    assert worst_case_bits(wr, xr, n) <= rule_of_thumb_bits(bw, bx, n)


def test_full_range_signed_matches_closed_form():
    # two most-negative codes multiply to +2^(bw+bx-2): int8 x int8 needs 16 bits for one term
    assert worst_case_bits((-128, 127), (-128, 127), 1) == 16
    assert worst_case_bits((-127, 127), (-128, 127), 1) == 15  # narrow weights save a bit
    assert worst_case_bits((-128, 127), (-128, 127), 4096) == 16 + 12


@given(st.integers(-(1 << 40), 1 << 40), st.integers(-(1 << 40), 1 << 40))
def test_bits_for_is_minimal(a, b):
    lo, hi = min(a, b), max(a, b)
    k = bits_for(lo, hi)
    assert -(1 << (k - 1)) <= min(lo, 0) and max(hi, 0) <= (1 << (k - 1)) - 1
    if k > 1:
        assert -(1 << (k - 2)) > min(lo, 0) or max(hi, 0) > (1 << (k - 2)) - 1


def test_pot_weights_range_follows_the_quantizer_levels():
    # 4-bit power-of-two weights: n = 2^(4-1) - 1 = 7 magnitudes 2^0..2^6 (units of the smallest)
    assert operand_range(Kind.POT, 4, True) == (-64, 64)

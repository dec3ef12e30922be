"""Integer requantization: a real factor ``M > 0`` applied to int32 values without floats.

Two forms (``RescaleKind``), both defined here on numpy int64 arrays (the reference
executor calls these functions; the C++ runtime must match them bit for bit):

FIXED (gemmlowp / TFLite ``MultiplyByQuantizedMultiplier``)
    ``M ≈ m · 2^(-31-s)`` with an int32 multiplier ``m`` in [2^30, 2^31 - 1] (or 0) and a
    shift ``s`` in [-31, 31]. For an int32 ``x``::

        left  = max(-s, 0);  right = max(s, 0)
        t = sat32(x · 2^left)
        u = SRDHM(t, m)        # SaturatingRoundingDoublingHighMul
        r = RDBP(u, right)     # RoundingDivideByPOT

    ``SRDHM(a, b)``: if ``a == b == INT32_MIN`` the result is ``INT32_MAX`` (the one
    overflow case); otherwise ``p = a·b`` (exact, int64), ``nudge = 2^30`` if ``p >= 0``
    else ``1 - 2^30``, result ``trunc((p + nudge) / 2^31)`` (C division, toward zero).
    That is ``floor(p / 2^31 + 1/2)``: nearest, ties toward +infinity (for a negative tie
    the nudge is one short of a half, so e.g. ``SRDHM(-1, 2^30) = 0``, not -1).

    ``RDBP(x, e)`` for ``0 <= e <= 31``: ``mask = 2^e - 1``, ``rem = x & mask``,
    ``thr = (mask >> 1) + (1 if x < 0 else 0)``, result ``(x >> e) + (1 if rem > thr else 0)``
    with ``>>`` arithmetic. That is ``x / 2^e`` rounded half away from zero.

    Bound (tested against ``fractions.Fraction`` in tests/export/test_requant.py): with
    ``Mq = m · 2^(-31-s)`` and no saturation in ``t``,
    ``|r - x·Mq| <= 1/2 + 2^-(s+1)`` (two roundings) and ``|Mq - M| <= 2^-(32+s)`` when
    ``m`` is nonzero, so ``|r - x·M| <= 1/2 + 2^-(s+1) + |x|·2^-(32+s) <= 1.5`` for
    ``s >= 0``; and ``r == round_half_away(x·Mq)`` except when ``x·Mq`` is within
    ``2^-(s+1)`` of a half-integer (the double rounding) or, for ``s <= 0``, is a negative
    tie (SRDHM rounds ties up).

FIXED_SINGLE (same ``m``, ``s``; one rounding)
    ``t = sat32(x · 2^left)``, ``r = sat32(round(t·m / 2^(31+right)))`` with ``t·m`` exact in
    int64 and ``round`` the stated :class:`Rounding` (as POT below, on ``t·m`` by
    ``31 + right`` bits): ``r == round(x·Mq)`` exactly. gemmlowp's two roundings flip about
    ``2^-right`` of all outputs by one code, which compounds through a deep network; one
    rounding with the quantizer's own mode agrees with the fake-quant model except where
    float32 rounding in the fake-quant model itself decides.

POT (exact power of two, ``M = 2^-s``)
    ``s <= 0``: ``r = sat32(x · 2^-s)`` (exact); ``s > 0``: ``r = round(x / 2^s)`` with the
    op's :class:`Rounding`, then ``sat32``. Bit-exact against ``round(x·M)`` by construction.

:func:`quantize_multiplier` decomposes a float factor for FIXED; :func:`pot_shift` for POT.

Wide form (:func:`apply_rescale_wide`, the output stage of a conv/linear whose ``acc_bits``
is above 32): the int64 accumulator is not saturated to int32 first. POT ``s <= 0`` as
above; POT ``s > 0``: ``sat32(round(x / 2^s))``; FIXED / FIXED_SINGLE with
``t = sat32(x · 2^left)`` when ``left > 0`` (a factor >= 1 saturates anyway), else ``t = x``:
FIXED ``r = sat32(RDBP(floor((t·m + 2^30) / 2^31), right))``, FIXED_SINGLE
``r = sat32(round(t·m / 2^(31+right)))``, with ``t·m`` exact (Python integers here, 128-bit in
C++). For int32-range ``x`` each equals the form above (``floor((t·m + 2^30)/2^31)`` is
SRDHM for ``m >= 0``), so the wide form only extends it.
"""

from __future__ import annotations

import math

import numpy as np

from qdsl.graph.schema import GraphFormatError, Rescale, RescaleKind, Rounding

__all__ = [
    "INT32_MIN",
    "INT32_MAX",
    "quantize_multiplier",
    "pot_shift",
    "make_rescale",
    "srdhm",
    "rdbp",
    "rounding_shift",
    "apply_rescale",
    "apply_rescale_wide",
    "sat",
    "wrap",
]

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
FIXED_SHIFT_RANGE = (-31, 31)
POT_SHIFT_RANGE = (-31, 62)


def quantize_multiplier(real: float) -> tuple[int, int]:
    """``(m, s)`` with ``m · 2^(-31-s)`` the closest such value to ``real`` (round half away).

    ``m`` is in [2^30, 2^31 - 1] unless ``real`` is 0 or below ``2^-62`` (then ``(0, 0)``).
    Factors below ``2^-31`` cannot use ``s > 31``: the multiplier is divided (rounding half
    away) to keep ``s = 31``, so precision falls gracefully to zero. Raises ``ValueError``
    for negative, non-finite or ``>= 2^31`` factors.
    """
    if not math.isfinite(real) or real < 0:
        raise ValueError(f"rescale factor must be finite and >= 0, got {real!r}")
    if real == 0.0:
        return 0, 0
    q, e = math.frexp(real)  # real = q * 2^e, q in [0.5, 1)
    # q * 2^31 is exact in binary64 (power-of-two scaling); adding 0.5 is exact because
    # the value is below 2^31 and has at most 53 significant bits, so floor() rounds half up
    # on a non-negative number, i.e. half away from zero.
    m = int(math.floor(q * 2**31 + 0.5))
    if m == 2**31:
        m //= 2
        e += 1
    s = -e
    if s < FIXED_SHIFT_RANGE[0]:
        raise ValueError(f"rescale factor {real!r} is too large (>= 2^31)")
    if s > FIXED_SHIFT_RANGE[1]:
        extra = s - FIXED_SHIFT_RANGE[1]
        if extra >= 32:
            return 0, 0
        m = (m + (1 << (extra - 1))) >> extra  # m > 0: round half away
        s = FIXED_SHIFT_RANGE[1]
    return m, s


def pot_shift(real: float) -> int | None:
    """``s`` with ``real == 2^-s`` exactly, or ``None`` when ``real`` is not a power of two."""
    if not math.isfinite(real) or real <= 0:
        return None
    q, e = math.frexp(real)
    if q != 0.5:
        return None
    return 1 - e


def make_rescale(factors, rounding: Rounding = Rounding.HALF_AWAY, allow_pot: bool = True,
                 single: bool = False) -> Rescale:
    """A :class:`Rescale` for one factor per tensor (length 1) or per channel.

    Uses the exact POT form when every factor is a power of two whose shift is in range
    (``allow_pot``), else FIXED (gemmlowp; its rounding is always half away) or, with
    ``single``, FIXED_SINGLE with ``rounding``.
    """
    factors = [float(f) for f in np.atleast_1d(np.asarray(factors, dtype=np.float64))]
    if allow_pot:
        shifts = [pot_shift(f) for f in factors]
        if all(s is not None and POT_SHIFT_RANGE[0] <= s <= POT_SHIFT_RANGE[1] for s in shifts):
            return Rescale(RescaleKind.POT, [1] * len(shifts), shifts, rounding)
    pairs = [quantize_multiplier(f) for f in factors]
    if single:
        return Rescale(RescaleKind.FIXED_SINGLE, [p[0] for p in pairs], [p[1] for p in pairs], rounding)
    return Rescale(RescaleKind.FIXED, [p[0] for p in pairs], [p[1] for p in pairs], Rounding.HALF_AWAY)


def sat(x: np.ndarray, bits: int = 32) -> np.ndarray:
    """Clamp int64 values to the signed ``bits`` range (64: the identity)."""
    if bits >= 64:
        return np.asarray(x, dtype=np.int64)
    return np.clip(x, -(1 << (bits - 1)), (1 << (bits - 1)) - 1)


def wrap(x: np.ndarray, bits: int = 32) -> np.ndarray:
    """Two's complement wrap of int64 values to ``bits`` (64: the identity)."""
    if bits >= 64:
        return np.asarray(x, dtype=np.int64)
    half = 1 << (bits - 1)
    return ((x + half) & ((1 << bits) - 1)) - half


def srdhm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """SaturatingRoundingDoublingHighMul on int32-valued int64 arrays: ``floor(a·b/2^31 + 1/2)``."""
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    p = a * b  # |p| <= 2^62: exact in int64
    nudge = np.where(p >= 0, 1 << 30, 1 - (1 << 30))
    q = p + nudge
    # C's truncating division by 2^31 (numpy's // floors, so fix negative inexact cases)
    r = np.where(q >= 0, q >> 31, -((-q) >> 31))
    return np.where((a == INT32_MIN) & (b == INT32_MIN), INT32_MAX, r)


def rdbp(x: np.ndarray, e: np.ndarray) -> np.ndarray:
    """RoundingDivideByPOT: ``x / 2^e`` rounded half away from zero, ``0 <= e <= 31``."""
    x = np.asarray(x, dtype=np.int64)
    e = np.asarray(e, dtype=np.int64)
    mask = (np.int64(1) << e) - 1
    rem = x & mask
    thr = (mask >> 1) + (x < 0)
    return (x >> e) + (rem > thr)


def rounding_shift(x: np.ndarray, s: np.ndarray, rounding: Rounding) -> np.ndarray:
    """Exact ``x · 2^-s`` for ``s <= 0``; ``x / 2^s`` rounded per ``rounding`` for ``s > 0`` (int64)."""
    x = np.asarray(x, dtype=np.int64)
    s = np.asarray(s, dtype=np.int64)
    if s.size == 1 and s.ndim <= x.ndim:  # one shift for all (the common case): no per-element shift arrays
        return _rounding_shift_one(x, int(s.reshape(-1)[0]), rounding)
    # s keeps its own shape (per channel, per row): numpy broadcasts it in each operation below
    # instead of materialising x-sized shift arrays (LAYERNORM's per-row shifts: 2x faster)
    if np.broadcast_shapes(s.shape, x.shape) != x.shape:
        s = np.broadcast_to(s, x.shape)  # raises as before
    left = np.where(s < 0, -s, 0)
    right = np.where(s > 0, s, 0)
    floor = x >> right
    rem = x - (floor << right)  # in [0, 2^right)
    half = np.where(right > 0, np.int64(1) << np.maximum(right - 1, 0), 0)
    shifted = floor + np.where(right > 0, _rounds_up(x, floor, rem, half, rounding), False)
    # left shifts: |x| <= 2^31 and left <= 31 keeps |x · 2^left| <= 2^62 (exact in int64)
    return np.where(s < 0, x << left, shifted)


def _rounding_shift_one(x: np.ndarray, s: int, rounding: Rounding) -> np.ndarray:
    """:func:`rounding_shift` by one shift ``s`` (the same formulas on scalars)."""
    if s <= 0:
        return x << -s
    floor = x >> s
    rem = x - (floor << s)
    return floor + _rounds_up(x, floor, rem, np.int64(1) << (s - 1), rounding)


def _rounds_up(x, floor, rem, half, rounding: Rounding):
    """Whether ``x / 2^s`` rounds up from ``floor`` = ``x >> s``, given ``rem`` = ``x - (floor << s)``
    and ``half`` = ``2^(s-1)`` (both rounding_shift forms)."""
    if rounding == Rounding.FLOOR:
        return np.zeros(np.shape(x), dtype=bool)
    if rounding == Rounding.HALF_UP:
        return rem >= half
    if rounding == Rounding.HALF_AWAY:
        return (rem > half) | ((rem == half) & (x >= 0))
    if rounding == Rounding.HALF_EVEN:
        return (rem > half) | ((rem == half) & ((floor & 1) == 1))
    raise GraphFormatError(f"unknown rounding code {int(rounding)}")


def apply_rescale(x: np.ndarray, rescale: Rescale, axis: int | None = 1) -> np.ndarray:
    """``rescale`` applied to int32-range values ``x`` (int64 in, int64 out, int32 range).

    Per-channel parameters (length C > 1) run along ``axis`` of ``x``. The input is first
    saturated to int32 (exported graphs never need it; the rule makes the op total).
    """
    x = sat(np.asarray(x, dtype=np.int64))
    m = np.asarray(rescale.multiplier, dtype=np.int64)
    s = np.asarray(rescale.shift, dtype=np.int64)
    if m.size > 1:
        shape = [1] * x.ndim
        shape[axis] = m.size
        m, s = m.reshape(shape), s.reshape(shape)
    if rescale.kind == RescaleKind.POT:
        return sat(rounding_shift(x, s, rescale.rounding))
    left = np.where(s < 0, -s, 0)
    right = np.where(s > 0, s, 0)
    t = sat(x << left)
    if rescale.kind == RescaleKind.FIXED_SINGLE:
        # |t·m| < 2^62: exact in int64; one rounding of t·m / 2^(31+right)
        return sat(rounding_shift(t * m, 31 + right, rescale.rounding))
    return rdbp(srdhm(t, m), right)


def _round_shift_int(v: int, s: int, rounding: Rounding) -> int:
    """``v / 2^s`` (``s >= 1``) rounded per ``rounding``, on Python integers (exact at any width)."""
    f = v >> s
    rem = v - (f << s)
    h = 1 << (s - 1)
    if rounding == Rounding.FLOOR:
        return f
    if rounding == Rounding.HALF_UP:
        return f + (rem >= h)
    if rounding == Rounding.HALF_AWAY:
        return f + (rem > h or (rem == h and v >= 0))
    if rounding == Rounding.HALF_EVEN:
        return f + (rem > h or (rem == h and (f & 1) == 1))
    raise GraphFormatError(f"unknown rounding code {int(rounding)}")


def _wide_one(x: int, kind: int, m: int, s: int, rounding: int) -> int:
    x, m, s = int(x), int(m), int(s)
    if kind == RescaleKind.POT:
        if s <= 0:
            return min(max(min(max(x, INT32_MIN), INT32_MAX) << -s, INT32_MIN), INT32_MAX)
        return min(max(_round_shift_int(x, s, Rounding(rounding)), INT32_MIN), INT32_MAX)
    left, right = max(-s, 0), max(s, 0)
    t = min(max(min(max(x, INT32_MIN), INT32_MAX) << left, INT32_MIN), INT32_MAX) if left else x
    if kind == RescaleKind.FIXED_SINGLE:
        r = _round_shift_int(t * m, 31 + right, Rounding(rounding))
    else:
        u = (t * m + (1 << 30)) >> 31
        r = _round_shift_int(u, right, Rounding.HALF_AWAY) if right else u
    return min(max(r, INT32_MIN), INT32_MAX)


def apply_rescale_wide(x: np.ndarray, rescale: Rescale, axis: int | None = 1) -> np.ndarray:
    """``rescale`` applied to int64 accumulators wider than 32 bits (the module docstring's
    wide form): element by element on Python integers, slow and exact; int64 out, int32 range."""
    x = np.asarray(x, dtype=np.int64)
    m = np.asarray(rescale.multiplier, dtype=np.int64)
    s = np.asarray(rescale.shift, dtype=np.int64)
    if m.size > 1:
        shape = [1] * x.ndim
        shape[axis] = m.size
        m, s = m.reshape(shape), s.reshape(shape)
    one = np.vectorize(lambda v, mm, ss: _wide_one(v, int(rescale.kind), mm, ss, int(rescale.rounding)),
                       otypes=[np.int64])
    return one(x, m, s) if x.size else x.copy()

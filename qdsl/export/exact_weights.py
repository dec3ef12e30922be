"""Exact integer weights for formats without an integer lowering of their own (minifloats, MX).

A minifloat weight (``fp4_e2m1``, ``fp8_e4m3``...) with a scale per tensor, per output
channel or per block of a row is not an integer grid, but each of its values is a *dyadic*
number (an integer times a power of two) times, at most, one real factor per output channel:

* element values of a minifloat are ``m · 2^e`` with a few mantissa bits ``m``
  (``fp4_e2m1``: {0, .5, 1, 1.5, 2, 3, 4, 6}),
* power-of-two block scales (OCP MX, E8M0) and minifloat-coded block scales
  (NVFP4's ``fp8_e4m3``) are dyadic too, so their products with the elements are exact in
  binary32 and dyadic,
* a per-channel (or per-tensor) real scale ``s_c`` is the one real factor.

So output channel ``c`` holds exactly ``code · 2^k_c · s_c`` with integer codes, ``k_c`` the
exponent of the finest bit any of its values uses.  When every channel's codes fit int8
(int4 when they all fit 4 bits) the weight lowers onto the existing integer weight path
with scale ``2^k_c · s_c`` and zero point 0: the graph multiplies the very values the
fake-quant model multiplies (:func:`exact_weight_ints`).  ``fp4_e2m1`` per channel always
fits (codes 0..12); MXFP4 fits while a row's block exponents span at most 3 binades; FP8
(e4m3: 4 significant bits over 16 binades) fits only a narrow row.  Otherwise export
refuses, naming the layer, the format and the first channel that does not fit.

Torch is used only to run the weight quantizer; the decomposition itself is numpy.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from qdsl.quantizers import functional as F

__all__ = ["ExactInts", "NotExact", "exact_weight_ints", "dyadic_rows", "SIGNIFICANT_BITS"]

SIGNIFICANT_BITS = 12
"""Element values are recovered from ``x̂ / s_c`` by rounding to this many significant bits;
minifloat elements have at most 8 (fp8_e4m3: 4), and binary32's product ``e · s_c`` is
within 2^-24 of the exact one, so the rounding recovers ``e`` (checked: ``fl32(e · s_c) == x̂``)."""


@attrs.frozen
class ExactInts:
    """A weight as integer-graph constants: ``value[c, ...] = codes[c, ...] · scale[c]``."""

    codes: np.ndarray
    """int64 codes, the weight's shape."""
    scale: np.ndarray
    """float64 per output channel."""
    dtype: str
    """``"I4"`` when every code is in [-8, 7], else ``"I8"``."""


@attrs.frozen
class NotExact:
    """Why a weight has no exact int8 form: the first channel that does not fit."""

    channel: int
    largest_code: float
    """The largest |code| that channel needs at its finest bit (inf: not a short dyadic)."""
    reason: str

    def message(self, what: str) -> str:
        """``what`` names the weights (``"fp4_e2m1 weights with group(32) scales"``)."""
        return (f"{what} have no exact int8 form: output channel {self.channel} {self.reason}; the integer graph "
                f"takes such weights only as integers in [-128, 127] times one scale per output channel")


def _round_sig(v: np.ndarray, bits: int) -> np.ndarray:
    """``v`` rounded to ``bits`` significant bits (half even), exactly, in float64."""
    m, e = np.frexp(v)
    return np.ldexp(np.rint(np.ldexp(m, bits)), e - bits)


def _lsb_exponent(v: np.ndarray) -> np.ndarray:
    """Per element of a float64 array: ``k`` with ``v / 2^k`` an odd integer (``v != 0``)."""
    m, e = np.frexp(v)  # v = m · 2^e, 0.5 <= |m| < 1: m · 2^53 is an integer
    mant = np.abs(np.ldexp(m, 53)).astype(np.int64)
    tz = np.zeros(mant.shape, dtype=np.int64)
    rest = mant.copy()
    for shift in (32, 16, 8, 4, 2, 1):  # trailing zeros of a 53-bit integer, branch-free
        low = (rest & ((1 << shift) - 1)) == 0
        tz += np.where(low, shift, 0)
        rest = np.where(low, rest >> shift, rest)
    return e - 53 + tz


def dyadic_rows(values: np.ndarray, lo: int = -128, hi: int = 127) -> tuple[np.ndarray, np.ndarray] | NotExact:
    """``(codes, k)`` with ``values[c] = codes[c] · 2^k[c]`` and codes in ``[lo, hi]``, the
    coarsest exact grid per row (axis 0); or :class:`NotExact` for the first row that does
    not fit.  ``values`` is float64 of shape ``[C, ...]``."""
    rows = values.reshape(values.shape[0], -1)
    if not np.isfinite(rows).all():
        c = int(np.nonzero(~np.isfinite(rows).all(axis=1))[0][0])
        return NotExact(c, float("inf"), "holds a non-finite value")
    nz = rows != 0
    lsb = np.where(nz, _lsb_exponent(np.where(nz, rows, 1.0)), np.iinfo(np.int64).max)
    k = lsb.min(axis=1)
    k = np.where(k == np.iinfo(np.int64).max, 0, k)  # an all-zero row: any grid
    codes = np.ldexp(rows, -k[:, None])  # exact: every value is a multiple of 2^k
    big = np.abs(codes).max(axis=1)
    bad = (codes.min(axis=1) < lo) | (codes.max(axis=1) > hi)
    if bad.any():
        c = int(np.nonzero(bad)[0][0])
        return NotExact(c, float(big[c]), f"needs codes up to {big[c]:.0f} on its finest step 2^{int(k[c])}")
    return codes.astype(np.int64).reshape(values.shape), k


def exact_weight_ints(wq, w: torch.Tensor, out_axis: int = 0) -> ExactInts | NotExact:
    """The frozen weight quantizer ``wq``'s values of the float weight ``w`` as exact integer
    codes with one scale per output channel (module doc), or why not.

    The scale is read through ``param_view`` (per tensor, per channel on ``wq.axis`` or per
    group of a row).  When it is one real number per output channel, that number is the
    channel's factor and the elements are recovered from ``x̂ / s_c``; when it varies along
    a row (block scales), the values themselves must be dyadic (power-of-two or
    minifloat-coded block scales are; arbitrary real block scales are not, and are refused)."""
    with torch.no_grad():
        w32 = w.detach().float()
        wh = wq(w32).detach().double()
        s = F.param_view(wq.scale.detach().double(), wh, wq.axis, wq.group_size)
        s = torch.broadcast_to(s, wh.shape)
    whn, sn = wh.movedim(out_axis, 0).numpy(), s.movedim(out_axis, 0).numpy()
    c = whn.shape[0]
    s_rows = sn.reshape(c, -1)
    per_row = (s_rows == s_rows[:, :1]).all(axis=1) & (s_rows[:, 0] > 0)  # one real factor in the row
    factor = np.where(per_row, s_rows[:, 0], 1.0)
    fshape = (c,) + (1,) * (whn.ndim - 1)
    elems = np.where(per_row.reshape(fshape), _round_sig(whn / factor.reshape(fshape), SIGNIFICANT_BITS), whn)
    back = (elems.astype(np.float32) * factor.astype(np.float32).reshape(fshape)).astype(np.float64)
    wrong = (back != whn).reshape(c, -1).any(axis=1)
    if wrong.any():
        return NotExact(int(np.nonzero(wrong)[0][0]), float("inf"),
                        "holds values that are not short dyadic multiples of its scale")
    got = dyadic_rows(elems)
    if isinstance(got, NotExact):
        return got
    codes, k = got
    scale = np.ldexp(factor, k)
    dtype = "I4" if codes.size == 0 or (codes.min() >= -8 and codes.max() <= 7) else "I8"
    return ExactInts(np.moveaxis(codes, 0, out_axis), scale, dtype)

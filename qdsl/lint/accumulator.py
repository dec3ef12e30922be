"""Accumulator width of integer dot products: worst case from bit widths, exact from weights.

Every weighted layer (linear, conv1d, conv2d, grouped or not) computes, per output,

    acc = Σ_{i<n} w̃_i · x̃_i  (+ b)      n = fan_in = in_channels/groups · Π kernel_size

where ``w̃ = w_q - z_w`` and ``x̃ = x_q - z_x`` are the zero-point-corrected integer
codes.  An accumulator of ``B`` bits (two's complement) holds ``[-2^(B-1), 2^(B-1)-1]``.

Operand ranges (:func:`operand_range`), signedness and zero-point aware:

* int, symmetric: ``[qmin, qmax]`` - signed ``[-2^(b-1) (+1 if narrow), 2^(b-1)-1]``,
  unsigned ``[0, 2^b-1 (-1 if narrow)]``.
* int with a zero point ``z ∈ [qmin, qmax]``: ``x̃ ∈ [qmin-z, qmax-z]``.  Before
  calibration ``z`` is unknown; over every ``z`` the union is ``[-D, D]`` with
  ``D = qmax - qmin``.  Using the union is exact for the worst case below, because the
  worst weights are all equal, so one ``z`` serves every term.
* binary: ``{-1, +1}`` (signed) or ``{0, 1}``; ternary ``{-1, 0, +1}``.
* pot with ``b`` bits: 1 sign bit and a ``(b-1)``-bit exponent code, one code meaning
  zero, so magnitudes ``2^e`` for ``e ∈ [0, 2^(b-1)-2]`` in units of the smallest step
  (unsigned: ``e ∈ [0, 2^b-2]``).

**Worst case** (:func:`worst_case_range`).  A product of ``w ∈ [wl, wh]`` and
``x ∈ [xl, xh]`` is bilinear, so its extremes are at the corners:
``pmax = max(wl·xl, wl·xh, wh·xl, wh·xh)`` and ``pmin`` likewise.  All ``n`` terms can
reach ``pmax`` at once (all weights and inputs at the same corner), so the exact worst
case is ``[n·pmin, n·pmax]`` and the width is :func:`bits_for` of it.  For signed
symmetric full-range operands ``pmax = 2^(bw-1)·2^(bx-1)`` (two most-negative codes), so
the width is ``bw + bx - 1 + ceil(log2(n + 2^-(bw+bx-2)))``, i.e. at most
``bw + bx + ceil(log2 n)`` (DESIGN.md's rule of thumb, :func:`rule_of_thumb_bits`);
narrow range or unsigned operands can need a bit less, which the exact form gives.

**Tight bound** (:func:`tight_range`) with the actual integer weights ``W`` (one row per
output).  For a fixed row the sum is linear in ``x̃``, so over the input box
``[xl, xh]^n`` its maximum is at a vertex, taken element-wise:
``max = Σ_{w>0} w·xh + Σ_{w<0} w·xl`` and ``min = Σ_{w>0} w·xl + Σ_{w<0} w·xh``, plus the
bias.  That is the exact largest (smallest) accumulator any input in range can produce.
With an unknown input zero point, the maximum over ``z`` of a convex function of
``z`` sits at ``z = qmin`` or ``z = qmax``, so both endpoints are evaluated.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from qdsl.graph.ops.weighted import worst_case_range
from qdsl.spec.formats import NumberFormat, builtin_format
from qdsl.spec.model import Kind

__all__ = [
    "operand_range",
    "operand_ranges",
    "bits_for",
    "worst_case_range",
    "worst_case_bits",
    "rule_of_thumb_bits",
    "tight_range",
    "tight_bits",
]


def bits_for(lo: int, hi: int) -> int:
    """Smallest two's complement width holding every integer in ``[lo, hi]`` (≥ 1)."""
    lo, hi = int(min(lo, 0)), int(max(hi, 0))
    bits = 1
    while -(1 << (bits - 1)) > lo or hi > (1 << (bits - 1)) - 1:
        bits += 1
    return bits


def operand_ranges(
    kind: Kind, bits: int, signed: bool, narrow_range: bool = False, symmetric: bool = True,
    fmt: NumberFormat | None = None,
) -> tuple[tuple[int, int], ...] | None:
    """The zero-point-corrected code ranges an operand can take, one per extreme zero point.

    Symmetric operands have one range; asymmetric ones two (``z = qmin`` and ``z = qmax``);
    ``None`` for float tensors (no integer accumulator).  The number format (``fmt``, else
    the built-in one of ``kind``) says which (qdsl.spec.formats ``operand_ranges``).
    """
    fmt = fmt if fmt is not None else builtin_format(kind)
    if not fmt.quantized:
        return None
    return fmt.operand_ranges(bits, signed, narrow_range, symmetric)


def operand_range(
    kind: Kind, bits: int, signed: bool, narrow_range: bool = False, symmetric: bool = True,
    fmt: NumberFormat | None = None,
) -> tuple[int, int] | None:
    """The hull of :func:`operand_ranges` (``[-D, D]`` for an unknown zero point)."""
    ranges = operand_ranges(kind, bits, signed, narrow_range, symmetric, fmt)
    if ranges is None:
        return None
    return min(r[0] for r in ranges), max(r[1] for r in ranges)


def worst_case_bits(w: tuple[int, int], x: tuple[int, int], fan_in: int) -> int:
    return bits_for(*worst_case_range(w, x, fan_in))


def rule_of_thumb_bits(bits_w: int, bits_x: int, fan_in: int) -> int:
    """``bits_w + bits_x + ceil(log2 fan_in)``: an upper bound on :func:`worst_case_bits`."""
    return bits_w + bits_x + (math.ceil(math.log2(fan_in)) if fan_in > 1 else 0)


def tight_range(
    weights: np.ndarray | Sequence[Sequence[int]],
    x_ranges: Sequence[tuple[int, int]],
    bias: np.ndarray | Sequence[int] | None = None,
) -> tuple[int, int]:
    """Exact extremes of ``W @ x̃ + b`` over every output row and every ``x̃`` in the box.

    ``weights`` are zero-point-corrected integers, shape ``(out, ...)`` (flattened per
    row); ``x_ranges`` lists the candidate input ranges (one per possible zero point,
    see :func:`operand_ranges`).
    """
    w = np.asarray(weights)
    w = w.reshape(w.shape[0], -1) if w.ndim > 1 else w.reshape(1, -1)
    # int64 suffices unless |w|·|x|·n could pass 2^62; then use Python ints (object).
    big = max(abs(int(v)) for r in x_ranges for v in r) or 1
    wmax = int(np.abs(w).max()) if w.size else 0
    dtype = object if wmax * big * max(1, w.shape[1]) >= (1 << 62) else np.int64
    w = w.astype(dtype)
    pos = np.where(w > 0, w, 0).sum(axis=1)
    neg = np.where(w < 0, w, 0).sum(axis=1)
    b = np.zeros(w.shape[0], dtype=dtype) if bias is None else np.asarray(bias).astype(dtype).reshape(-1)
    lo = hi = None
    for xl, xh in x_ranges:
        row_hi = pos * xh + neg * xl + b
        row_lo = pos * xl + neg * xh + b
        h, l_ = int(row_hi.max()), int(row_lo.min())
        hi = h if hi is None else max(hi, h)
        lo = l_ if lo is None else min(lo, l_)
    return lo, hi


def tight_bits(weights, x_ranges, bias=None) -> int:
    return bits_for(*tight_range(weights, x_ranges, bias))

"""The common grid of a residual ADD whose scales are not all powers of two.

ADD (docs/qgraph.md §4.4) brings each operand onto one power-of-two grid
``s_t = s_out / 2^k`` as an int32 term, sums the terms (``sat32``) and shifts the sum right
by ``k`` with the output quantizer's rounding.  Each term is rounded once onto ``s_t``, so
the graph's sum is off the exact one by up to about one ``s_t`` step: the output code differs
from the correctly rounded one only when the exact sum lies within ``~2^-k`` of an output
step's tie.  A fixed ``k = 16`` (the old ``INT32_TARGET_BITS``) flipped one code of the
calibrated ResNet-50 low-bit test at ``layer3.1`` (exact sum 2.5000023 steps: the terms
50666.96 and 113173.19 rounded to 50667 and 113173, exactly 2.5 · 2^16, half-even gave 2,
the fake-quant model's float32 sum 3).

:func:`add_fraction_bits` therefore takes the largest ``k`` up to
:data:`ADD_MAX_FRACTION_BITS` for which every operand's worst-case term provably stays in
int32 without saturating on the way (its left shift before the multiplier, its term, and the
sum of all terms).  Worst cases, in output steps (real value / ``s_out``):

* an 8-bit operand: ``max(|qmin - zp|, |qmax - zp|) · s_i / s_out`` (its code range);
* a layer accumulator kept wide: its ``bound`` (every product at its largest, plus the bias;
  ``accumulator_bound``), cut by a fused clamp (ReLU6: ``hi``);
* a LayerNorm's wide output: its ``bound``, at most the int32 range of its unit.

A term then satisfies ``|t_i| <= r_i · 2^k · (1 + 2^-20) + 2`` (the factor's 31-bit
multiplier is within ``2^-30`` relative; one FIXED stage rounds by at most 1.5), and the
multiplier form ``x · 2^left · m / 2^31`` with ``m >= 2^30`` has ``|x · 2^left| <= 2 |t_i|``:
so ``2 · B_i <= INT32_MAX`` for each term and ``Σ B_i <= INT32_MAX`` for the sum.  A layer
accumulator's factor ``s_acc / s_t`` must also stay below ``2^30`` (an accumulator that can
only be 0 still gets a stage).  Operands without a known bound keep
:data:`~qdsl.export.values.INT32_TARGET_BITS` (16, the old fixed choice, unproven as before).
Many or wide operands get fewer bits (down to 0); the runtime takes any ``k`` in [0, 31]
(an output POT shift, per-input FIXED factors below 2^31).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from qdsl.export.values import INT32_TARGET_BITS, Pending, QVal, wide_scale
from qdsl.graph.requant import INT32_MAX

__all__ = ["ADD_MAX_FRACTION_BITS", "add_fraction_bits", "term_range"]

ADD_MAX_FRACTION_BITS = 24
"""Most fraction bits below the output step an ADD's common grid keeps.  Beyond ~24 the
float32 fake-quant sum itself (24-bit significand) no longer resolves the ties more finely."""

_REL = 1.0 + 2.0**-20  # covers the multiplier's relative error (2^-30) with room
_SLACK = 2  # rounding of one term (FIXED: at most 1.5 of s_t)


def term_range(v: Any, s_out: float) -> float | None:
    """The largest ``|real value|`` of ADD operand ``v`` in output steps (``/ s_out``), or
    ``None`` when nothing bounds it."""
    ws = wide_scale(v)
    if ws is not None:  # a LayerNorm's wide output: I32 at its unit
        r = 2.0**31 * ws
        if getattr(v, "bound", None) is not None:
            r = min(r, float(v.bound))
        return r / s_out
    if isinstance(v, QVal):
        return max(abs(v.qmin - v.zp), abs(v.qmax - v.zp)) * float(v.scale) / s_out
    if isinstance(v, Pending):
        r = math.inf if v.bound is None else float(v.bound)
        r = min(r, max(abs(v.lo), abs(v.hi)))  # a fused clamp (ReLU6) bounds it too
        return r / s_out if math.isfinite(r) else None
    return None


def _fits(ranges: Sequence[float], acc_factors: Sequence[float], k: int) -> bool:
    bounds = [math.ceil(r * 2.0**k * _REL) + _SLACK for r in ranges]
    return (all(2 * b <= INT32_MAX for b in bounds) and sum(bounds) <= INT32_MAX
            and all(f * 2.0**k <= 2.0**30 for f in acc_factors))


def add_fraction_bits(operands: Sequence[Any], s_out: float, cap: int = ADD_MAX_FRACTION_BITS) -> int:
    """Fraction bits ``k`` of the common grid ``s_out / 2^k`` of an ADD of ``operands``
    (8-bit QVals, layer accumulators, LayerNorm wide outputs) with output scale ``s_out``:
    the most, up to ``cap``, that provably keep every term and the sum in int32 (module doc)."""
    ranges = [term_range(v, s_out) for v in operands]
    if any(r is None for r in ranges):
        return min(INT32_TARGET_BITS, cap)
    # a layer accumulator's stage factor s_acc / s_t, in units of 2^k
    acc_factors = [float(np.max(v.scales)) / s_out for v in operands
                   if isinstance(v, Pending) and wide_scale(v) is None and v.scales is not None]
    k = cap
    while k > 0 and not _fits(ranges, acc_factors, k):
        k -= 1
    return k

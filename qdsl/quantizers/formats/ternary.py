"""Ternary: ``α·sign(x)·[|x| > Δ]``, codes in {-1, 0, +1}."""

from __future__ import annotations

from qdsl.quantizers import functional as F
from qdsl.quantizers import ste
from qdsl.quantizers.formats.base import FormatOps, WeightInts, is_weight

__all__ = ["TernaryOps"]


class TernaryOps(FormatOps):
    def raw_scale(self, q, x, lo, hi):
        if q.role.is_weight and x is not None:
            # TWN: threshold 0.7·mean|W| and α = mean|W| above it, from the weight itself
            thr, raw = F.ternary_params(x.detach(), q.axis, q.group_size)
            return raw, thr
        return super().raw_scale(q, x, lo, hi)

    def learned_threshold(self, scale):
        return scale.detach() * 0.5  # nearest of 0 and α

    def fake(self, q, x, scale, zp, thr):
        codes = F.ternary_codes(x, thr, q.axis, q.group_size)
        return codes.to(x.dtype) * F.param_view(scale.to(x.dtype), x, q.axis, q.group_size)

    def codes(self, q, x, scale, zp, thr):
        return F.ternary_codes(x, thr, q.axis, q.group_size)

    def qat_surrogate(self, q, x, s_view):
        # TWN: codes straight-through, α over the kept weights; activations: identity in |x| <= s
        if is_weight(q) and q.group_size is None:
            return ste.ternary_weight(x, q.axis)
        return super().qat_surrogate(q, x, s_view)

    def lower_weight(self, q, codes, scale):
        return WeightInts(codes, scale, "I2")

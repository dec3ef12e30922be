"""Power-of-two values: each value is 0 or ``±s·2^-j`` (``0 <= j < n``, ``n = 2^(bits-1) - 1``)."""

from __future__ import annotations

from qdsl.quantizers import functional as F
from qdsl.quantizers.formats.base import FormatOps, NotExportable, WeightInts, packed_int_dtype
from qdsl.spec.formats import pot_levels

__all__ = ["PotOps"]


class PotOps(FormatOps):
    def fake(self, q, x, scale, zp, thr):
        return F.fake_quant_pot_weight(x, scale, q.recipe.bits, q.axis, q.group_size)

    def codes(self, q, x, scale, zp, thr):
        return F.pot_weight_codes(x, scale, q.recipe.bits, q.axis, q.group_size)

    def scale_surrogate(self, s_view, value):
        # a learned scale of pot values: value/s per element, unclamped (unlike the default)
        return s_view * (value / s_view.detach()).detach()

    def lower_weight(self, q, codes, scale):
        # value = sign(c)·s·2^(|c|-n) = (sign(c)·2^(|c|-1)) · s·2^(1-n), an integer grid
        # (the format's operand_codes) at scale s·2^(1-n)
        bits = q.recipe.bits
        n = pot_levels(bits)
        top = q.format.max_export_weight_bits
        if top is not None and bits > top:
            raise NotExportable(f"{bits}-bit power-of-two weights span more than int8", f"use bits <= {top} for pot weights")
        return WeightInts(q.format.operand_codes(codes), scale * q.format.grid_step(bits), packed_int_dtype(n + 1, True))

"""Affine integers: ``q = clamp(round(x/s) + z, qmin, qmax)``, ``x̂ = (q - z)·s``."""

from __future__ import annotations

import torch

from qdsl.quantizers import functional as F
from qdsl.quantizers import range_search as RS
from qdsl.quantizers import ste
from qdsl.quantizers.formats.base import FormatOps, WeightInts, packed_int_dtype, zero_gain

__all__ = ["IntOps"]


class IntOps(FormatOps):
    fast_path = True

    def qparams(self, q, x, lo, hi, rule):
        raw, zpf = RS.range_to_qparams(lo, hi, q.qmin, q.qmax, symmetric=q.recipe.symmetric)
        scale = rule(raw)
        if not q.recipe.symmetric:
            # the zero point must match the scale actually used (pot rules change it)
            zpf = torch.clamp(q.qmin - torch.round(torch.clamp(lo, max=0.0) / scale.detach()), q.qmin, q.qmax)
        return scale, zpf.to(torch.int32), None

    def fake(self, q, x, scale, zp, thr):
        if q._round_fn is None:
            return F.fake_quant_affine(x, scale, zp, q.qmin, q.qmax, q._round_mode,
                                       q.axis, q.group_size, q.generator)
        sv, inv, z = q._param_views(x, scale, zp)
        c = torch.clamp(q._round_fn(F.scaled(x, inv), generator=q.generator) + z, q.qmin, q.qmax)
        return (c - z) * sv

    def codes(self, q, x, scale, zp, thr):
        if q._round_fn is None:
            return F.quantize_affine(x, scale, zp, q.qmin, q.qmax, q._round_mode,
                                     q.axis, q.group_size, generator=q.generator)
        _, inv, z = q._param_views(x, scale, zp)
        c = torch.clamp(q._round_fn(F.scaled(x, inv), generator=q.generator) + z, q.qmin, q.qmax)
        return c.to(F.int_dtype(q.qmin, q.qmax))

    def qat_value(self, q, x, scale, zp, thr):
        # the clipping-mask STE to x, LSQ/LSQ+ to a learned scale (ste.fake_quant's own gradient)
        zp_used = None if q.recipe.symmetric else zp
        if q._round_fn is not None:  # a user rounding: their values, the clipping-mask STE
            value = q._fake(x.detach(), scale.detach(), zp, thr)
            sur = ste.fake_quant(x, scale, zp_used, q.qmin, q.qmax, rounding="half_even", axis=q.axis,
                                 group_size=q.group_size)
            return value + zero_gain(sur)
        return ste.fake_quant(x, scale, zp_used, q.qmin, q.qmax, rounding=q._round_mode, axis=q.axis,
                              group_size=q.group_size)

    def lower_weight(self, q, codes, scale):
        return WeightInts(codes, scale, packed_int_dtype(q.recipe.bits, int(q.qmin) < 0))

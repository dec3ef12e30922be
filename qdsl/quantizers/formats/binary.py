"""Binary: ``α·sign(x)`` (signed, XNOR-Net) or ``α·[x >= α/2]`` (unsigned {0, 1})."""

from __future__ import annotations

from qdsl.quantizers import functional as F
from qdsl.quantizers.formats.base import FormatOps, NotExportable, WeightInts

__all__ = ["BinaryOps"]


class BinaryOps(FormatOps):
    def fake(self, q, x, scale, zp, thr):
        return F.fake_quant_binary(x, scale.to(x.dtype), q.recipe.signed, q.axis, q.group_size)

    def codes(self, q, x, scale, zp, thr):
        return F.binary_codes(x, scale, q.recipe.signed, q.axis, q.group_size)

    def lower_weight(self, q, codes, scale):
        if not q.recipe.signed:
            raise NotExportable("unsigned {0, 1} binary weights have no XNOR lowering", "use signed binary weights")
        return WeightInts(codes, scale, "BIN")

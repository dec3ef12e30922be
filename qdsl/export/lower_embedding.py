"""Export of an embedding lookup (``nn.Embedding``) to EMBEDDING.

The ids are an I32 graph input (an integer example input; :mod:`qdsl.export.graph_io`).
The table is the layer's frozen weight codes (the spec quantizes ``weight`` of
``type:Embedding``: per tensor, or per row = ``granularity = channel`` along axis 0), and
the result waits, like a layer's accumulator, for the next quantizer (the embedding's
``output`` or the reader's ``input``): its scale sets the op's output stage, one factor
``s_w[row] / s_out`` per row (or one for a per-tensor table).  The fake-quant model
computes ``(code - zp) · s_w[row]`` in float and rounds it at that quantizer, which is the
same value rounded once: the graph agrees up to the fixed-point multiplier's error.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from qdsl.export.lower_layers import weight_ints
from qdsl.export.values import Builder, ExportError, IdsVal, Pending, Target
from qdsl.graph.ir import DType, OpType
from qdsl.graph.requant import make_rescale

__all__ = ["embedding_pending"]


def embedding_pending(b: Builder, fqn: str, m: nn.Module, patch, ids, shape) -> Pending:
    """The lookup of ``ids`` in the quantized table of the Embedding ``m`` (module doc)."""
    if not isinstance(ids, IdsVal):
        origin = getattr(ids, "origin", "?")
        raise ExportError(fqn, f"the embedding reads '{origin}', not integer token ids from a graph input",
                          "pass the ids as an integer tensor in the example input (they become an I32 graph input)")
    if patch is None or patch.wq is None:
        raise ExportError(fqn, "the embedding table is left in float (no weight quantizer)",
                          "quantize it in the spec: rule type:Embedding { weight = w8 } (per tensor or per_channel)")
    if patch.iq is not None:
        raise ExportError(fqn, "an embedding's input is token ids, which an input quantizer cannot quantize",
                          "remove `input` from the rule that matches this embedding")
    if getattr(m, "max_norm", None) is not None:
        raise ExportError(fqn, "max_norm renormalizes the table on every lookup, which has no integer lowering",
                          "construct the Embedding without max_norm")
    codes, wdtype, s_w, w_zp, _ = weight_ints(patch, fqn, 0)
    if np.any(w_zp != w_zp[0]):
        raise ExportError(fqn, "per-row zero points have no EMBEDDING lowering", "make the weight quantizer symmetric "
                          "or per tensor")
    # every exportable weight format's codes fit one byte (int4/int2/ternary/binary too)
    tdtype = DType.I8 if wdtype.range[0] < 0 else DType.U8
    table = b.tensor(f"{fqn}.weight", tdtype, codes.shape, codes)
    b.info[table] = (s_w, w_zp)
    per_row = bool(np.any(s_w != s_w[0]))
    s = s_w if per_row else s_w[:1]

    def emit(bld: Builder, t: Target, lo: float, hi: float):
        try:
            rescale = make_rescale(s / t.scale, t.rounding, True, single=bld.single_rounding)
        except ValueError as e:
            raise ExportError(fqn, f"a requantization factor is out of range ({e})") from None
        out_min, out_max = t.clamp_codes(lo, hi)
        a = {"w_zp": int(w_zp[0]), **rescale.attrs(), "out_zp": t.zp, "out_min": out_min, "out_max": out_max}
        return bld.op(OpType.EMBEDDING, fqn, [ids.name, table], t.dtype, shape, a, out=fqn), shape

    return Pending("embedding", fqn, shape, emit)

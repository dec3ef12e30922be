"""Lowering of elementwise activations (Hardswish, SiLU, GELU, ...) to a LUT op.

An 8-bit input has only 256 codes, so any elementwise float function between two
per-tensor quantizers is exactly a table: entry ``i`` is the output quantizer's code of
``f(dequantize(i + min(in dtype)))``, evaluated with torch's own function in binary32 on the
dequantized value the fake-quant model sees (docs/qgraph.md, LUT).  The table is built
when the next quantizer is known, so the result is a :class:`Pending`.  A per-channel
function (PReLU with one slope per channel) is one such table per channel (LUT_CHANNEL).
"""

from __future__ import annotations

from typing import Callable

import torch

from qdsl.export.values import Builder, ExportError, Pending, QVal, Target
from qdsl.graph.ir import DType, OpType

__all__ = ["lut_table", "lut_channel_table", "lut_pending"]


def lut_table(fn: Callable[[torch.Tensor], torch.Tensor], v: QVal, t: Target, lo: float, hi: float) -> tuple[int, ...]:
    """The 256 output codes of ``fn`` from the grid of ``v`` to the target ``t``, a later
    ReLU/clamp (``lo``/``hi``, real values) folded in."""
    first = v.dtype.range[0]
    codes = torch.arange(first, first + 256, dtype=torch.float32)
    # the fake quantizer's dequantization, binary32: (q - zp) * scale
    x = (codes - float(v.zp)) * torch.tensor(v.scale, dtype=torch.float32)
    with torch.no_grad():
        y = fn(x).to(torch.float32).numpy()
    out_min, out_max = t.clamp_codes(lo, hi)
    return tuple(min(max(t.code(float(r)), out_min), out_max) for r in y)


def lut_channel_table(fn: Callable[[torch.Tensor], torch.Tensor], v: QVal, t: Target, lo: float, hi: float,
                      channels: int) -> tuple[int, ...]:
    """``channels`` tables of :func:`lut_table`, channel-major: ``fn`` is a per-channel
    function (PReLU's slope per channel) evaluated on a ``(1, C, 256)`` grid."""
    first = v.dtype.range[0]
    codes = torch.arange(first, first + 256, dtype=torch.float32)
    x = ((codes - float(v.zp)) * torch.tensor(v.scale, dtype=torch.float32)).expand(1, channels, 256).contiguous()
    with torch.no_grad():
        y = fn(x).to(torch.float32).reshape(-1).numpy()
    out_min, out_max = t.clamp_codes(lo, hi)
    return tuple(min(max(t.code(float(r)), out_min), out_max) for r in y)


def lut_pending(where: str, x, fn: Callable[[torch.Tensor], torch.Tensor], what: str, shape,
                per_channel: bool = False) -> Pending:
    """``fn`` (an elementwise activation named ``what``) on the 8-bit quantized value ``x``;
    ``per_channel``: a different function per channel (axis 1), one table each (LUT_CHANNEL)."""
    if not isinstance(x, QVal):
        origin = getattr(x, "origin", "?")
        raise ExportError(where, f"{what} reads an unquantized value from '{origin}': its integer lowering is a "
                                 "lookup table over 8-bit input codes",
                          f"quantize it: add `output = a8` (any activation quantizer) for '{origin}' in the spec")
    if x.dtype not in (DType.I8, DType.U8):
        raise ExportError(where, f"{what} reads a {x.dtype.name} value; its lookup table needs an 8-bit input",
                          "quantize its input to int8/uint8")
    v = x

    def emit(bld: Builder, t: Target, lo: float, hi: float):
        if t.dtype not in (DType.I8, DType.U8):
            raise ExportError(where, f"the {what} result must be int8-quantized, not {t.dtype.name} ({t.where})")
        if per_channel:
            table = lut_channel_table(fn, v, t, lo, hi, v.shape[1])
            name = bld.op(OpType.LUT_CHANNEL, where, [v.name], t.dtype, shape, {"table": table}, out=f"{where}:lut")
            return name, shape
        table = lut_table(fn, v, t, lo, hi)
        name = bld.op(OpType.LUT, where, [v.name], t.dtype, shape, {"table": table}, out=f"{where}:lut")
        return name, shape

    return Pending("lut", where, shape, emit)

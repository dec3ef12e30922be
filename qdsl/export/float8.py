"""FP8 weights for the ONNX export: ``fp8_e4m3`` / ``fp8_e5m2`` as ONNX FLOAT8 tensors.

ONNX (opset 19+) has two of the OCP 8-bit formats as element types of QuantizeLinear /
DequantizeLinear: FLOAT8E4M3FN (4 exponent bits, bias 7, no infinities, one NaN pattern per
sign: OCP ``fp8_e4m3``, torch ``float8_e4m3fn``) and FLOAT8E5M2 (IEEE-like, bias 15: OCP
``fp8_e5m2``, torch ``float8_e5m2``).  A weight in one of them with a scale per tensor or per
output channel is written as ``DequantizeLinear(float8 weight, scale, float8 zero point 0,
axis)``: the decoded value is ``e · s``, the product the fake-quant model computes.

The integer graph has no such weights (only exact int8 decodes, qdsl/export/exact_weights.py),
so :func:`qdsl.export.export` takes them only for the ONNX writer (``onnx_float8=True``):
the graph tensor then holds the float8 *bit patterns* as U8 and its grid in ``info`` is a
:class:`Float8Grid` naming the ONNX type.  Such a graph is not an integer graph and is never
returned by :func:`qdsl.export.export` without that flag.

FP8 *activations* (per tensor, rounding half even) are, in the same mode, lowered like int8
ones onto placeholder codes whose grid scale is an :class:`F8Scale`; the ONNX writer turns
every such quantization point into ``QuantizeLinear -> DequantizeLinear`` with a float8 zero
point (ONNX's saturating round-to-nearest-even cast of ``x / s``, which is the fake
quantizer's rule), and refuses ops it lowers on integer codes (lookup tables, attention,
LayerNorm, clamps other than ReLU) when they read or write one.

Block-scaled FP8 (MXFP8: ``fp8_e4m3(granularity=group(32), scale=pot)``, or minifloat-coded
block scales) is written the same way with ONNX's blocked quantization (opset 21,
``block_size`` along the flattened row; a conv weight is dequantized as ``[C, K]`` and
reshaped).  FP6 and FP4 have no ONNX type onnxruntime runs (FLOAT4E2M1 is opset 23; its CPU
kernels do not implement it, checked with onnxruntime 1.32); they reach ONNX only through
an exact int8 decode, else the export refuses.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from qdsl.export.exact_weights import SIGNIFICANT_BITS

__all__ = ["Float8Grid", "Float8Weight", "F8Scale", "onnx_float8_type", "float8_weight", "float8_target",
           "F8_PLACEHOLDER"]

F8_PLACEHOLDER = 127
"""An FP8 activation's placeholder codes are [-127, 127] (int8, narrow): unlike any int8
target's range at the same scale they never match one, and they are never computed with."""

# (exponent bits, mantissa bits, bias, special values) -> the ONNX and torch element types
_TYPES = {
    (4, 3, 7, "fn"): ("FLOAT8E4M3FN", torch.float8_e4m3fn),
    (5, 2, 15, "ieee"): ("FLOAT8E5M2", torch.float8_e5m2),
}


def _key(fmt: Any) -> tuple | None:
    try:
        return fmt.exponent, fmt.mantissa, fmt.bias, fmt.special
    except AttributeError:  # not a minifloat
        return None


def onnx_float8_type(fmt: Any) -> str | None:
    """The ONNX element type of a number format, when ONNX has one (FP8 only), else None."""
    got = _TYPES.get(_key(fmt))
    return got[0] if got else None


class Float8Grid(tuple):
    """``(scale, zero point)`` of a weight held as float8 bit patterns, plus its ONNX type
    and, for block scales, the blocks' scales ``[C, G]`` and size: it unpacks like every
    grid in ``info``, and the ONNX writer reads the rest."""

    onnx_type: str
    blocks: np.ndarray | None
    block_size: int | None

    def __new__(cls, scale, zp, onnx_type: str, blocks: np.ndarray | None = None, block_size: int | None = None):
        obj = super().__new__(cls, (scale, zp))
        obj.onnx_type, obj.blocks, obj.block_size = onnx_type, blocks, block_size
        return obj


@attrs.frozen
class Float8Weight:
    bits: np.ndarray
    """The float8 bit patterns (uint8 values as int64), the weight's shape."""
    scale: np.ndarray
    """float64 per output channel (with block scales: each row's largest, for the graph's
    bias and output stage, which the ONNX writer does not read for the weight)."""
    onnx_type: str
    blocks: np.ndarray | None = None
    """float64 ``[C, G]`` block scales (``group(k)``: MXFP8's powers of two, or NVFP4-style
    minifloat-coded scales), None for a scale per tensor or channel."""
    block_size: int | None = None

    def grid(self, zp: np.ndarray) -> Float8Grid:
        return Float8Grid(self.scale, zp, self.onnx_type, self.blocks, self.block_size)


def float8_weight(wq, w: torch.Tensor, out_axis: int = 0) -> Float8Weight | None:
    """The frozen FP8 weight quantizer ``wq``'s values of ``w`` as float8 bit patterns and
    their scales (per tensor, per output channel, or per block of a row along the flattened
    row), or None when ``wq`` is not FP8 on one of those layouts (the caller then takes the
    integer path or refuses)."""
    got = _TYPES.get(_key(wq.format))
    if got is None or wq.axis not in (None, out_axis) or (wq.group_size and out_axis != 0):
        return None
    onnx_type, tdtype = got
    with torch.no_grad():
        wh = wq(w.detach().float()).detach()
        c = wh.shape[out_axis]
        if wq.group_size:
            blocks = wq.scale.detach().double().reshape(c, -1)
            if blocks.shape[1] * wq.group_size != wh[0].numel():
                return None  # a row that is not a whole number of blocks: no ONNX block layout
            sv = blocks.repeat_interleave(wq.group_size, dim=1).reshape(wh.shape)
            s = blocks.max(dim=1).values
        else:
            s = wq.scale.detach().double().reshape(-1)
            s = s.expand(c) if s.numel() == 1 else s
            view = [1] * wh.dim()
            view[out_axis] = c
            sv = s.reshape(view)
        e = wh.double() / sv
        m, ex = torch.frexp(e)  # round to SIGNIFICANT_BITS bits: the element value (exact_weights.py)
        e = torch.ldexp(torch.round(torch.ldexp(m, torch.tensor(SIGNIFICANT_BITS))), ex - SIGNIFICANT_BITS)
        f8 = e.to(tdtype)
        if not torch.equal(f8.double(), e) or not torch.equal(e.float() * sv.float(), wh):
            return None  # not an fp8 value times the scale: the integer path decides
        bits = f8.view(torch.uint8).numpy().astype(np.int64)
    if wq.group_size:
        return Float8Weight(bits, s.numpy().copy(), onnx_type, blocks.numpy().copy(), int(wq.group_size))
    return Float8Weight(bits, s.numpy().copy(), onnx_type)


class F8Scale(float):
    """The scale of an FP8 activation in the ONNX writer's mode: a float that also names its
    ONNX type, carried along with the value wherever the lowering passes a grid's scale
    (reshapes, pools), and recorded in ``info``.  It equals only an F8Scale of the same
    type, so an int8 value at the same scale is requantized to it, never taken as it."""

    onnx_type: str

    def __new__(cls, value: float, onnx_type: str):
        obj = super().__new__(cls, value)
        obj.onnx_type = onnx_type
        return obj

    def __eq__(self, other):
        return isinstance(other, F8Scale) and float(self) == float(other) and self.onnx_type == other.onnx_type

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = float.__hash__

    def __reduce__(self):
        return F8Scale, (float(self), self.onnx_type)


def float8_target(scale: float, fmt: Any, where: str):
    """An FP8 per-tensor activation quantizer as the lowering's :class:`Target`: placeholder
    int8 codes (:data:`F8_PLACEHOLDER`), zero point 0, scale an :class:`F8Scale`."""
    from qdsl.export.values import Target
    from qdsl.graph.ir import DType, Rounding

    return Target(F8Scale(scale, onnx_float8_type(fmt)), 0, -F8_PLACEHOLDER, F8_PLACEHOLDER, DType.I8,
                  Rounding.HALF_EVEN, where)

"""FP8 weights for the ONNX export: ``fp8_e4m3`` / ``fp8_e5m2`` as ONNX FLOAT8 tensors.

ONNX (opset 19+) has two of the OCP 8-bit formats as element types of QuantizeLinear /
DequantizeLinear: FLOAT8E4M3FN (4 exponent bits, bias 7, no infinities, one NaN pattern per
sign: OCP ``fp8_e4m3``, torch ``float8_e4m3fn``) and FLOAT8E5M2 (IEEE-like, bias 15: OCP
``fp8_e5m2``, torch ``float8_e5m2``).  A weight in one of them with a scale per tensor or per
output channel is written as ``DequantizeLinear(float8 weight, scale, float8 zero point 0,
axis)``: the decoded value is ``e · s``, the product the fake-quant model computes.

The integer graph has no such weights (only exact int8 decodes, qdsl/export/exact_weights.py),
so :func:`qdsl.export.export` takes them only for the ONNX writer (``float8_weights=True``):
the graph tensor then holds the float8 *bit patterns* as U8 and its grid in ``info`` is a
:class:`Float8Grid` naming the ONNX type.  Such a graph is not an integer graph and is never
returned by :func:`qdsl.export.export` without that flag.

FP6, FP4 and block-scaled (MX, NVFP4) weights have no ONNX element type here (ONNX's
FLOAT4E2M1 and block_size quantization are newer than what qdsl targets); they reach ONNX only
through an exact int8 decode, else the export refuses.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from qdsl.export.exact_weights import SIGNIFICANT_BITS

__all__ = ["Float8Grid", "Float8Weight", "onnx_float8_type", "float8_weight"]

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
    """``(scale, zero point)`` of a weight held as float8 bit patterns, plus its ONNX type:
    it unpacks like every grid in ``info``, and the ONNX writer reads :attr:`onnx_type`."""

    onnx_type: str

    def __new__(cls, scale, zp, onnx_type: str):
        obj = super().__new__(cls, (scale, zp))
        obj.onnx_type = onnx_type
        return obj


@attrs.frozen
class Float8Weight:
    bits: np.ndarray
    """The float8 bit patterns (uint8 values as int64), the weight's shape."""
    scale: np.ndarray
    """float64 per output channel."""
    onnx_type: str


def float8_weight(wq, w: torch.Tensor, out_axis: int = 0) -> Float8Weight | None:
    """The frozen FP8 weight quantizer ``wq``'s values of ``w`` as float8 bit patterns and
    one scale per output channel, or None when ``wq`` is not FP8 with a per-tensor or
    per-output-channel scale (the caller then takes the integer path or refuses)."""
    got = _TYPES.get(_key(wq.format))
    if got is None or wq.group_size or wq.axis not in (None, out_axis):
        return None
    onnx_type, tdtype = got
    with torch.no_grad():
        wh = wq(w.detach().float()).detach()
        c = wh.shape[out_axis]
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
    return Float8Weight(bits, s.numpy().copy(), onnx_type)

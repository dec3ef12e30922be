"""QUANTIZE, DEQUANTIZE, BINARIZE, BINARIZE_CHANNEL: the float <-> integer boundary ops
(BINARIZE_CHANNEL: a learned per-channel binarisation threshold on 8-bit codes)."""

from __future__ import annotations

import math

import numpy as np

from qdsl.graph.checks import I32_RANGE
from qdsl.graph.ops import OpDef
from qdsl.graph.schema import ACTIVATION_DTYPES, INT8_DTYPES, AttrType, DType, OpSchema, Rounding

__all__ = ["OPS", "quantize", "dequantize", "binarize", "binarize_channel"]


def _round_f(v: np.ndarray, mode: int) -> np.ndarray:
    """Round float64 values (holding exact f32 quotients) to integers, per :class:`Rounding`."""
    if mode == Rounding.HALF_EVEN:
        return np.rint(v)
    if mode == Rounding.HALF_AWAY:
        return np.sign(v) * np.floor(np.abs(v) + 0.5)
    if mode == Rounding.HALF_UP:
        return np.floor(v + 0.5)
    return np.floor(v)


def quantize(x: np.ndarray, a, out=None) -> np.ndarray:
    # v = x * (1/scale), both steps in binary32 (torch's fake-quant kernels multiply by the
    # f32 reciprocal; qdsl.quantizers.functional does the same), widened exactly to f64
    inv = np.float32(1.0) / np.float32(a["scale"])
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to ±inf then clamps: the documented policy
        v = (x.astype(np.float32) * inv).astype(np.float64)
    r = _round_f(v, a["rounding"]) + a["zero_point"]
    r = np.where(np.isnan(r), a["zero_point"], r)  # NaN maps to the zero point
    return np.clip(r, a["qmin"], a["qmax"]).astype(np.int64)


def dequantize(q: np.ndarray, a) -> np.ndarray:
    return (q - a["zero_point"]).astype(np.float32) * np.float32(a["scale"])


def binarize(x: np.ndarray, a) -> np.ndarray:
    return np.where(x < a["zero_point"], -1, 1).astype(np.int64)


def binarize_channel(x: np.ndarray, a) -> np.ndarray:
    # channel c along axis 1: -1 where x < thresholds[c], else +1 (x == thresholds[c] is +1)
    t = np.asarray(a["thresholds"], dtype=np.int64).reshape((1, x.shape[1]) + (1,) * (x.ndim - 2))
    return np.where(x < t, -1, 1).astype(np.int64)


def _infer_quantize(c, op, ins, out):
    x = ins[0]
    c.dt(x, (DType.F32,), "input")
    s = op.attrs["scale"]
    c.need(math.isfinite(s) and s > 0, f"scale must be finite and > 0, got {s}")
    c.dt(out, INT8_DTYPES, "output")
    lo, hi = out.dtype.range
    c.int("zero_point", *I32_RANGE)
    mn, mx = c.int("qmin", lo, hi), c.int("qmax", lo, hi)
    c.need(mn <= mx, f"qmin {mn} > qmax {mx}")
    c.int("rounding", 0, len(Rounding) - 1)
    return INT8_DTYPES, x.shape


def _infer_dequantize(c, op, ins, out):
    x = ins[0]
    c.dt(x, ACTIVATION_DTYPES + (DType.I32,), "input")
    s = op.attrs["scale"]
    c.need(math.isfinite(s) and s > 0, f"scale must be finite and > 0, got {s}")
    c.int("zero_point", *((0, 0) if x.dtype in (DType.BIN, DType.I32) else x.dtype.range))
    return (DType.F32,), x.shape


def _infer_binarize(c, op, ins, out):
    x = ins[0]
    c.dt(x, (DType.F32,) + INT8_DTYPES, "input")
    c.int("zero_point", *((0, 0) if x.dtype is DType.F32 else x.dtype.range))
    return (DType.BIN,), x.shape


def _infer_binarize_channel(c, op, ins, out):
    x = ins[0]
    c.dt(x, INT8_DTYPES, "input")
    c.need(len(x.shape) >= 2 and x.shape[1] >= 1, f"input {x.name!r} must have a channel axis, has shape {x.shape}")
    # one threshold per channel; below min(dtype) is "always +1", above max(dtype) "always -1"
    lo, hi = x.dtype.range
    c.ints("thresholds", x.shape[1], lo, hi + 1)
    return (DType.BIN,), x.shape


OPS = (
    OpDef("QUANTIZE", 1,
          OpSchema(1, 1, {"scale": AttrType.FLOAT, "zero_point": AttrType.INT,
                          "qmin": AttrType.INT, "qmax": AttrType.INT, "rounding": AttrType.INT}),
          _infer_quantize, lambda op, args, graph, counts: quantize(args[0], op.attrs),
          "F32 -> I8/U8: ``clamp(round(x * f32(1/scale)) + zp, qmin, qmax)`` in binary32."),
    OpDef("DEQUANTIZE", 2, OpSchema(1, 1, {"scale": AttrType.FLOAT, "zero_point": AttrType.INT}),
          _infer_dequantize, lambda op, args, graph, counts: dequantize(args[0], op.attrs),
          "I8/U8/BIN -> F32: ``(q - zp) * scale``."),
    OpDef("BINARIZE", 19, OpSchema(1, 1, {"zero_point": AttrType.INT}),
          _infer_binarize, lambda op, args, graph, counts: binarize(args[0], op.attrs),
          "I8/U8/F32 -> BIN: ``-1 if x < zero_point else +1``."),
    OpDef("BINARIZE_CHANNEL", 41, OpSchema(1, 1, {"thresholds": AttrType.INTS}),
          _infer_binarize_channel, lambda op, args, graph, counts: binarize_channel(args[0], op.attrs),
          "I8/U8 -> BIN per channel (axis 1): ``-1 if x < thresholds[c] else +1``."),
)

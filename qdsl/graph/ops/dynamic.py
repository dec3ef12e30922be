"""QUANTIZE_DYNAMIC and LINEAR_DYNAMIC: dynamic (run-time scale) int8 quantization of a
linear layer's input, as torch.ao's dynamic Linear does.

QUANTIZE_DYNAMIC computes the scale (and, for an affine quantizer, the zero point) of its
F32 input when it runs, per tensor or per row (a row: all dims but the last), exactly as
qdsl's fake-quant dynamic quantizer (minmax observer, float scale) computes them, and writes
two outputs: the codes and their ``qparams`` (F32, ``[..rows.., 2]``: scale, zero point).
LINEAR_DYNAMIC multiplies those codes by per-channel int8 weights in int32 and converts
the accumulator to F32 with ``s_x[row] * s_w[ch]`` and a float bias.  Float constants are
not part of the integer IR, so the weight scales and the bias travel as attributes holding
the binary32 bit patterns (``int32`` view) of the values: exact, and the C++ loader reads
them the same way.  docs/qgraph.md §4 has the formulas.
"""

from __future__ import annotations

import numpy as np

from qdsl.graph.checks import I32_RANGE
from qdsl.graph.ops import OpDef
from qdsl.graph.ops.boundary import _round_f
from qdsl.graph.schema import INT8_DTYPES, AttrType, DType, OpSchema, Rounding

__all__ = ["OPS", "quantize_dynamic", "linear_dynamic", "f32_bits", "bits_f32", "MAX_K"]

TINY = np.float32(1e-12)
"""The smallest scale (qdsl.quantizers.range_search: a zero range gets this, never 0)."""
MAX_K = 65536
"""Largest reduction length: |q - zp| <= 255 times |w| <= 128, K times, fits int32."""
_SIGNED_WEIGHTS = (DType.I8, DType.I4, DType.I2)


def f32_bits(values) -> tuple[int, ...]:
    """binary32 values as the int32 bit patterns the attributes hold."""
    return tuple(int(v) for v in np.asarray(values, dtype=np.float32).reshape(-1).view(np.int32))


def bits_f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.int64).astype(np.int32).view(np.float32)


def _qparams(rows: np.ndarray, a) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point (f32) per row of ``rows`` [R, N]: the fake-quant formulas in binary32."""
    fin = np.isfinite(rows)
    lo = np.where(fin, rows, np.float32(np.inf)).min(axis=1)
    hi = np.where(fin, rows, np.float32(-np.inf)).max(axis=1)
    none = ~fin.any(axis=1)  # no finite value: the range is [0, 0]
    lo[none], hi[none] = 0, 0
    lo, hi = np.minimum(lo, np.float32(0)), np.maximum(hi, np.float32(0))
    qmin, qmax = a["qmin"], a["qmax"]
    if a["symmetric"]:
        amax = np.maximum(-lo, hi) if qmin < 0 else np.where(hi > 0, hi, -lo)
        scale = np.maximum(amax / np.float32(qmax), TINY)
        zp = np.zeros_like(scale)
    else:
        scale = np.maximum((hi - lo) / np.float32(qmax - qmin), TINY)
        zp = np.clip(np.float32(qmin) - np.rint(lo / scale), qmin, qmax).astype(np.float32)
    return scale.astype(np.float32), zp


def quantize_dynamic(x: np.ndarray, a) -> tuple[np.ndarray, np.ndarray]:
    x = x.astype(np.float32)
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    scale, zp = _qparams(flat if a["per_row"] else flat.reshape(1, -1), a)
    if not a["per_row"]:
        scale, zp = np.repeat(scale, flat.shape[0]), np.repeat(zp, flat.shape[0])
    inv = np.float32(1.0) / scale  # x * f32(1/scale), as QUANTIZE and the fake quantizer
    with np.errstate(over="ignore", invalid="ignore"):
        v = (flat * inv[:, None]).astype(np.float64)
    r = _round_f(v, a["rounding"]) + zp[:, None]
    r = np.where(np.isnan(r), zp[:, None], r)  # NaN maps to the zero point
    q = np.clip(r, a["qmin"], a["qmax"]).astype(np.int64).reshape(x.shape)
    return q, np.stack([scale, zp], axis=-1).reshape(x.shape[:-1] + (2,))


def linear_dynamic(q: np.ndarray, qp: np.ndarray, w: np.ndarray, a) -> np.ndarray:
    k = q.shape[-1]
    qp = qp.astype(np.float32).reshape(-1, 2)
    acc = (q.reshape(-1, k) - qp[:, 1:2].astype(np.int64)) @ w.astype(np.int64).T  # exact
    m = qp[:, 0:1] * bits_f32(a["w_scale"])[None, :]  # f32(s_x[row] * s_w[ch])
    y = acc.astype(np.float32) * m  # f32(acc) * m, rounded once
    if a["bias"]:
        y = y + bits_f32(a["bias"])[None, :]
    if a["relu"]:
        y = np.maximum(y, np.float32(0))
    return y.astype(np.float32).reshape(q.shape[:-1] + (w.shape[0],))


def _infer_quantize(c, op, ins, out):
    x = ins[0]
    c.dt(x, (DType.F32,), "input")
    c.need(len(x.shape) >= 2, f"input {x.name!r} must have rank >= 2, has shape {x.shape}")
    c.dt(out, INT8_DTYPES, "output")
    lo, hi = out.dtype.range
    mn, mx = c.int("qmin", lo, hi), c.int("qmax", lo, hi)
    c.need(mn < mx and mx > 0, f"qmin {mn} must be < qmax {mx} and qmax > 0")
    c.int("symmetric", 0, 1)
    c.int("per_row", 0, 1)
    c.int("rounding", 0, len(Rounding) - 1)
    return INT8_DTYPES, x.shape


def _qparams_out(op, ins):
    return ((DType.F32, tuple(ins[0].shape[:-1]) + (2,)),)


def _infer_linear(c, op, ins, out):
    q, qp, w = ins
    c.dt(q, INT8_DTYPES, "input")
    c.act(qp, "qparams")
    c.dt(qp, (DType.F32,), "qparams")
    c.need(len(q.shape) >= 2, f"input {q.name!r} must have rank >= 2, has shape {q.shape}")
    c.need(tuple(qp.shape) == tuple(q.shape[:-1]) + (2,),
           f"qparams {qp.name!r} must have shape {tuple(q.shape[:-1]) + (2,)} (scale, zero point per row), has {qp.shape}")
    c.const(w, "weight")
    c.dt(w, _SIGNED_WEIGHTS, "weight")
    c.need(len(w.shape) == 2, f"weight {w.name!r} must have rank 2, has shape {w.shape}")
    cout, k = w.shape
    c.need(k == q.shape[-1], f"weight {w.name!r} expects {k} input features, input has {q.shape[-1]}")
    c.need(k <= MAX_K, f"{k} input features exceed {MAX_K} (the int32 accumulator must be exact)")
    c.ints("w_scale", cout, *I32_RANGE)
    c.need(all(np.isfinite(bits_f32(op.attrs["w_scale"])) & (bits_f32(op.attrs["w_scale"]) > 0)),
           "w_scale must hold finite positive binary32 values")
    c.ints("bias", (0, cout), *I32_RANGE)
    c.need(bool(np.isfinite(bits_f32(op.attrs["bias"])).all()), "bias must hold finite binary32 values")
    c.int("relu", 0, 1)
    c.dt(out, (DType.F32,), "output")
    return (DType.F32,), tuple(q.shape[:-1]) + (cout,)


OPS = (
    OpDef("QUANTIZE_DYNAMIC", 31,
          OpSchema(1, 1, {"qmin": AttrType.INT, "qmax": AttrType.INT, "symmetric": AttrType.INT,
                          "per_row": AttrType.INT, "rounding": AttrType.INT}, n_outputs=2),
          _infer_quantize, lambda op, args, graph, counts: quantize_dynamic(args[0], op.attrs),
          "F32 -> I8/U8 codes and F32 qparams ``[rows, 2]`` (scale, zero point) computed at run time "
          "from the min/max per tensor or per row.", extra_outputs=_qparams_out),
    OpDef("LINEAR_DYNAMIC", 32,
          OpSchema(3, 3, {"w_scale": AttrType.INTS, "bias": AttrType.INTS, "relu": AttrType.INT}),
          _infer_linear,
          lambda op, args, graph, counts: linear_dynamic(args[0], args[1], args[2].data, op.attrs),
          "I8/U8 codes + qparams x int8 weight -> F32: ``f32(acc) * f32(s_x[r] * s_w[c]) + bias[c]``."),
)

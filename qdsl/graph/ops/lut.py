"""LUT: I8/U8 -> I8/U8 elementwise lookup, ``table[x - min(in dtype)]``; LUT_CHANNEL: one
such table per channel (axis 1), for per-channel functions (PReLU with one slope per channel)."""

from __future__ import annotations

import numpy as np

from qdsl.graph.ops import OpDef
from qdsl.graph.schema import INT8_DTYPES, AttrType, DType, OpSchema

__all__ = ["OPS", "lut", "lut_channel"]


def lut(x: np.ndarray, a, x_dtype: DType) -> np.ndarray:
    # the table has one entry per code of the 8-bit input, lowest code first (int64 values,
    # like every other op's, so consumers never compute in a narrow container)
    table = np.asarray(a["table"], dtype=np.int64)
    return table[x.astype(np.int64) - x_dtype.range[0]]


def lut_channel(x: np.ndarray, a, x_dtype: DType) -> np.ndarray:
    # entry c·256 + i: channel c, input code min(in dtype) + i
    channels = x.shape[1]
    table = np.asarray(a["table"], dtype=np.int64).reshape(channels, 256)
    c = np.arange(channels).reshape((1, channels) + (1,) * (x.ndim - 2))
    return table[c, x.astype(np.int64) - x_dtype.range[0]]


def _infer(c, op, ins, out):
    x = ins[0]
    c.dt(x, INT8_DTYPES, "input")
    c.dt(out, INT8_DTYPES, "output")
    # one entry per input code, each a value of the output dtype (docs/qgraph.md §4.4)
    c.ints("table", 256, *out.dtype.range)
    return INT8_DTYPES, x.shape


def _infer_channel(c, op, ins, out):
    x = ins[0]
    c.dt(x, INT8_DTYPES, "input")
    c.dt(out, INT8_DTYPES, "output")
    c.need(len(x.shape) >= 2 and x.shape[1] >= 1, f"input {x.name!r} must have a channel axis, has shape {x.shape}")
    c.ints("table", 256 * x.shape[1], *out.dtype.range)
    return INT8_DTYPES, x.shape


def _run(fn):
    return lambda op, args, graph, counts: fn(args[0], op.attrs, graph.tensor(op.inputs[0]).dtype)


OPS = (
    OpDef("LUT", 20, OpSchema(1, 1, {"table": AttrType.INTS}), _infer, _run(lut),
          "I8/U8 -> I8/U8 elementwise lookup: ``table[x - min(in dtype)]`` (256 entries)."),
    OpDef("LUT_CHANNEL", 25, OpSchema(1, 1, {"table": AttrType.INTS}), _infer_channel, _run(lut_channel),
          "Per-channel lookup: ``table[256·c + x - min(in dtype)]`` (256 entries per channel, axis 1)."),
)

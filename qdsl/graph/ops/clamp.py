"""CLAMP: ``clamp(x, out_min, out_max)`` (ReLU / ReLU6 in the quantized domain)."""

from __future__ import annotations

import numpy as np

from qdsl.graph.ops import OpDef
from qdsl.graph.schema import INT8_DTYPES, AttrType, OpSchema

__all__ = ["OPS", "clamp"]


def clamp(x: np.ndarray, a) -> np.ndarray:
    return np.clip(x, a["out_min"], a["out_max"])


def _infer(c, op, ins, out):
    x = ins[0]
    c.dt(x, INT8_DTYPES, "input")
    lo, hi = x.dtype.range
    c.need(c.int("out_min", lo, hi) <= c.int("out_max", lo, hi), "out_min > out_max")
    return (x.dtype,), x.shape


OPS = (
    OpDef("CLAMP", 12, OpSchema(1, 1, {"out_min": AttrType.INT, "out_max": AttrType.INT}),
          _infer, lambda op, args, graph, counts: clamp(args[0], op.attrs),
          "``clamp(x, out_min, out_max)`` (ReLU / ReLU6 in the quantized domain)."),
)

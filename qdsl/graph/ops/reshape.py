"""RESHAPE: reshape the non-batch dims (flatten)."""

from __future__ import annotations

import math

from qdsl.graph.ops import OpDef
from qdsl.graph.schema import ACTIVATION_DTYPES, AttrType, OpSchema

__all__ = ["OPS"]


def _infer(c, op, ins, out):
    x = ins[0]
    n = x.shape[0] if x.shape else 1
    c.dt(x, ACTIVATION_DTYPES, "input")
    shape = c.ints("shape", None, 1, 1 << 31)
    c.need(len(shape) >= 1, "attribute 'shape' must not be empty")
    c.need(math.prod(shape) == math.prod(x.shape[1:]), f"cannot reshape {x.shape} to (N, {', '.join(map(str, shape))})")
    return (x.dtype,), (n,) + tuple(shape)


def _run(op, args, graph, counts):
    x = args[0]
    return x.reshape((x.shape[0],) + tuple(op.attrs["shape"]))


OPS = (
    OpDef("RESHAPE", 18, OpSchema(1, 1, {"shape": AttrType.INTS}), _infer, _run,
          "Reshape the non-batch dims (flatten)."),
)

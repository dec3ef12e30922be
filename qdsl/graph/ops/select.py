"""SELECT: one index along one axis, ``y = x.take(index, axis)`` (the axis is dropped).

What the recurrent lowering needs to read a slice the graph cannot otherwise name: layer
``k``'s initial state ``h0[k]`` of an ``(layers·directions, N, H)`` state input (axis 0 of
an input declared with a static first dim, so ``y``'s first dim is the batch), and the
reverse direction's last-position output ``y[:, T - 1]`` of a bidirectional layer (axis 1).
A copy: any activation dtype, the values and the grid unchanged.
"""

from __future__ import annotations

import numpy as np

from qdsl.graph.ops import OpDef
from qdsl.graph.schema import AttrType, DType, OpSchema

__all__ = ["OPS", "select"]

_DTYPES = (DType.I8, DType.U8, DType.I32, DType.F32)


def select(x: np.ndarray, a) -> np.ndarray:
    return np.take(x, a["index"], axis=a["axis"])


def _infer(c, op, ins, out):
    x = ins[0]
    c.dt(x, _DTYPES, "input")
    c.need(2 <= len(x.shape) <= 6, f"input {x.name!r} must have rank 2..6, has shape {x.shape}")
    axis = c.int("axis", 0, len(x.shape) - 1)
    c.need(x.shape[axis] >= 1, f"axis {axis} of {x.name!r} must have a static size (shape {x.shape})")
    c.int("index", 0, max(x.shape[axis] - 1, 0))
    return (x.dtype,), tuple(x.shape[:axis]) + tuple(x.shape[axis + 1:])


OPS = (
    OpDef("SELECT", 38, OpSchema(1, 1, {"axis": AttrType.INT, "index": AttrType.INT}), _infer,
          lambda op, args, graph, counts: select(args[0], op.attrs),
          "One index along one axis (the axis dropped): a copy of that slice, dtype unchanged."),
)

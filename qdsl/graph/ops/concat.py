"""CONCAT: concatenation along ``axis`` with per-input rescale."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from qdsl.graph.ops import OpDef
from qdsl.graph.ops.add import check_inputs, in_rescale
from qdsl.graph.requant import apply_rescale
from qdsl.graph.schema import IN_RQ_ATTRS, INT8_DTYPES, OUT_ATTRS, AttrType, OpSchema

__all__ = ["OPS", "concat"]


def concat(xs: Sequence[np.ndarray], a) -> np.ndarray:
    parts = [
        np.clip(apply_rescale(x - a["in_zp"][i], in_rescale(a, i)) + a["out_zp"], a["out_min"], a["out_max"])
        for i, x in enumerate(xs)
    ]
    return np.concatenate(parts, axis=a["axis"])


def _infer(c, op, ins, out):
    x = ins[0]
    check_inputs(c, ins, out, wide=False)
    axis = c.int("axis", 1, len(x.shape) - 1)
    lo, hi = out.dtype.range
    c.int("out_zp", lo, hi)
    c.need(c.int("out_min", lo, hi) <= c.int("out_max", lo, hi), "out_min > out_max")
    for i, tensor in enumerate(ins):
        same = all(a == b for j, (a, b) in enumerate(zip(tensor.shape, x.shape)) if j != axis)
        c.need(same, f"input {i} {tensor.name!r} shape {tensor.shape} differs from {x.shape} off axis {axis}")
    shape = list(x.shape)
    shape[axis] = sum(tensor.shape[axis] for tensor in ins)
    return INT8_DTYPES, tuple(shape)


OPS = (
    OpDef("CONCAT", 11, OpSchema(1, None, {**IN_RQ_ATTRS, "axis": AttrType.INT, **OUT_ATTRS}),
          _infer, lambda op, args, graph, counts: concat(args, op.attrs),
          "Concatenation along ``axis`` with per-input rescale.", all_activations=True),
)

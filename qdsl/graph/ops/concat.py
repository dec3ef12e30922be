"""CONCAT: concatenation along ``axis`` with per-input rescale.  With a BIN output every
input is BIN (a concat of signs, which a binary layer reads) with ``in_zp`` 0, identity
rescales, ``out_zp`` 0 and the clamp ``[-1, 1]``: the parts' ±1 values, concatenated."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from qdsl.graph.ops import OpDef
from qdsl.graph.ops.add import check_inputs, in_rescale
from qdsl.graph.requant import apply_rescale
from qdsl.graph.schema import IN_RQ_ATTRS, INT8_DTYPES, OUT_ATTRS, AttrType, DType, OpSchema, RescaleKind

__all__ = ["OPS", "concat"]


def concat(xs: Sequence[np.ndarray], a) -> np.ndarray:
    parts = [
        np.clip(apply_rescale(x - a["in_zp"][i], in_rescale(a, i)) + a["out_zp"], a["out_min"], a["out_max"])
        for i, x in enumerate(xs)
    ]
    return np.concatenate(parts, axis=a["axis"])


def _infer_bin(c, op, ins) -> None:
    n = len(ins)
    for i, tensor in enumerate(ins):
        c.dt(tensor, (DType.BIN,), f"input {i} of a BIN concat")
        c.need(len(tensor.shape) == len(ins[0].shape), f"input {i} {tensor.name!r} has rank {len(tensor.shape)}")
    identity = (list(c.ints("in_zp", n)) == [0] * n and list(op.attrs["in_kind"]) == [int(RescaleKind.POT)] * n
                and list(op.attrs["in_multiplier"]) == [1] * n and list(op.attrs["in_shift"]) == [0] * n
                and (op.attrs["out_zp"], op.attrs["out_min"], op.attrs["out_max"]) == (0, -1, 1))
    c.need(identity, "a BIN concat takes in_zp 0, identity rescales (POT, 1, 0), out_zp 0 and clamp [-1, 1]")


def _infer(c, op, ins, out):
    x = ins[0]
    if out.dtype is DType.BIN:
        _infer_bin(c, op, ins)
    else:
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
    return INT8_DTYPES + (DType.BIN,), tuple(shape)


OPS = (
    OpDef("CONCAT", 11, OpSchema(1, None, {**IN_RQ_ATTRS, "axis": AttrType.INT, **OUT_ATTRS}),
          _infer, lambda op, args, graph, counts: concat(args, op.attrs),
          "Concatenation along ``axis`` with per-input rescale.", all_activations=True),
)

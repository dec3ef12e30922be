"""ADD: elementwise add of two quantized tensors with per-input rescale."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from qdsl.graph.checks import check_out, check_rescale
from qdsl.graph.ops import OpDef
from qdsl.graph.requant import apply_rescale, sat
from qdsl.graph.schema import IN_RQ_ATTRS, INT8_DTYPES, OUT_ATTRS, RQ_ATTRS, AttrType, DType, OpSchema, OutputStage, Rescale

__all__ = ["OPS", "add", "in_rescale", "check_inputs"]


def in_rescale(a, i: int) -> Rescale:
    """Input ``i``'s rescale from the per-input lists (``in_kind``, ...)."""
    return Rescale(a["in_kind"][i], (a["in_multiplier"][i],), (a["in_shift"][i],), a["in_rounding"][i])


def add(xs: Sequence[np.ndarray], a) -> np.ndarray:
    terms = [apply_rescale((x - a["in_zp"][i]) << a["pre_shift"], in_rescale(a, i)) for i, x in enumerate(xs)]
    total = sat(terms[0] + terms[1])
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(total, st.rescale) + st.zero_point, st.qmin, st.qmax)


def check_inputs(c, ins, out, wide: bool) -> None:
    """ADD / CONCAT: input dtypes and ranks, per-input zero points and rescales, output dtype."""
    x = ins[0]
    for i, tensor in enumerate(ins):
        # ADD also takes I32 activations (a conv/linear's wide output, for residuals)
        c.dt(tensor, INT8_DTYPES + ((DType.I32,) if wide else ()), f"input {i}")
        c.need(len(tensor.shape) == len(x.shape), f"input {i} {tensor.name!r} has rank {len(tensor.shape)}, input 0 has {len(x.shape)}")
    zps = c.ints("in_zp", len(ins))
    for tensor, zp in zip(ins, zps):
        c.need(tensor.dtype.range[0] <= zp <= tensor.dtype.range[1], f"in_zp {zp} outside the range of {tensor.name!r}")
    check_rescale(c, "in_", len(ins), per_input=True)
    c.dt(out, INT8_DTYPES, "output")


def _infer(c, op, ins, out):
    x = ins[0]
    check_inputs(c, ins, out, wide=True)
    c.need(ins[1].shape == x.shape, f"add operands have different shapes {x.shape} and {ins[1].shape}")
    c.int("pre_shift", 0, 31)
    check_out(c, out.dtype, 1)
    return INT8_DTYPES, x.shape


OPS = (
    OpDef("ADD", 10, OpSchema(2, 2, {**IN_RQ_ATTRS, "pre_shift": AttrType.INT, **RQ_ATTRS, **OUT_ATTRS}),
          _infer, lambda op, args, graph, counts: add(args, op.attrs),
          "Elementwise add of two quantized tensors with per-input rescale.", all_activations=True),
)

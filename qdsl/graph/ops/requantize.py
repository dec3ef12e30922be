"""REQUANTIZE: I8/U8 (or I32 at zero point 0) -> I8/U8 through one output stage.

An I32 input is a wide activation (a LAYERNORM's wide output) that an 8-bit quantizer reads;
its zero point is 0, so ``x - in_zp`` stays an int32 value."""

from __future__ import annotations

import numpy as np

from qdsl.graph.checks import check_out
from qdsl.graph.ops import OpDef
from qdsl.graph.requant import apply_rescale
from qdsl.graph.schema import INT8_DTYPES, OUT_ATTRS, RQ_ATTRS, AttrType, DType, OpSchema, OutputStage

__all__ = ["OPS", "requantize"]


def requantize(x: np.ndarray, a) -> np.ndarray:
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(x - a["in_zp"], st.rescale, axis=1) + st.zero_point, st.qmin, st.qmax)


def _infer(c, op, ins, out):
    x = ins[0]
    c.dt(x, INT8_DTYPES + (DType.I32,), "input")
    c.int("in_zp", *((0, 0) if x.dtype is DType.I32 else x.dtype.range))
    c.dt(out, INT8_DTYPES, "output")
    check_out(c, out.dtype, x.shape[1] if len(x.shape) > 1 else 1)
    return INT8_DTYPES, x.shape


OPS = (
    OpDef("REQUANTIZE", 3, OpSchema(1, 1, {"in_zp": AttrType.INT, **RQ_ATTRS, **OUT_ATTRS}),
          _infer, lambda op, args, graph, counts: requantize(args[0], op.attrs),
          "I8/U8 (I32 at zero point 0) -> I8/U8: ``clamp(rescale(x - in_zp) + out_zp, out_min, out_max)``."),
)

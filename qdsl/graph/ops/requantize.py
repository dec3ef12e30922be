"""REQUANTIZE: I8/U8 -> I8/U8 through one output stage."""

from __future__ import annotations

import numpy as np

from qdsl.graph.checks import check_out
from qdsl.graph.ops import OpDef
from qdsl.graph.requant import apply_rescale
from qdsl.graph.schema import INT8_DTYPES, OUT_ATTRS, RQ_ATTRS, AttrType, OpSchema, OutputStage

__all__ = ["OPS", "requantize"]


def requantize(x: np.ndarray, a) -> np.ndarray:
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(x - a["in_zp"], st.rescale, axis=1) + st.zero_point, st.qmin, st.qmax)


def _infer(c, op, ins, out):
    x = ins[0]
    c.dt(x, INT8_DTYPES, "input")
    c.int("in_zp", *x.dtype.range)
    c.dt(out, INT8_DTYPES, "output")
    check_out(c, out.dtype, x.shape[1] if len(x.shape) > 1 else 1)
    return INT8_DTYPES, x.shape


OPS = (
    OpDef("REQUANTIZE", 3, OpSchema(1, 1, {"in_zp": AttrType.INT, **RQ_ATTRS, **OUT_ATTRS}),
          _infer, lambda op, args, graph, counts: requantize(args[0], op.attrs),
          "I8/U8 -> I8/U8: ``clamp(rescale(x - in_zp) + out_zp, out_min, out_max)``."),
)

"""LUT: I8/U8 -> I8/U8 elementwise lookup, ``table[x - min(in dtype)]``."""

from __future__ import annotations

import numpy as np

from qdsl.graph.ops import OpDef
from qdsl.graph.schema import INT8_DTYPES, AttrType, DType, OpSchema

__all__ = ["OPS", "lut"]


def lut(x: np.ndarray, a, x_dtype: DType) -> np.ndarray:
    # the table has one entry per code of the 8-bit input, lowest code first (int64 values,
    # like every other op's, so consumers never compute in a narrow container)
    table = np.asarray(a["table"], dtype=np.int64)
    return table[x.astype(np.int64) - x_dtype.range[0]]


def _infer(c, op, ins, out):
    x = ins[0]
    c.dt(x, INT8_DTYPES, "input")
    c.dt(out, INT8_DTYPES, "output")
    # one entry per input code, each a value of the output dtype (docs/qgraph.md §4.4)
    c.ints("table", 256, *out.dtype.range)
    return INT8_DTYPES, x.shape


OPS = (
    OpDef("LUT", 20, OpSchema(1, 1, {"table": AttrType.INTS}),
          _infer, lambda op, args, graph, counts: lut(args[0], op.attrs, graph.tensor(op.inputs[0]).dtype),
          "I8/U8 -> I8/U8 elementwise lookup: ``table[x - min(in dtype)]`` (256 entries)."),
)

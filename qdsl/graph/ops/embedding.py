"""EMBEDDING: a row lookup (gather) of a constant integer table by I32 token ids.

``y[..., d] = clamp(rescale(table[id, d] - w_zp, row id) + out_zp, out_min, out_max)``
for every id of the input (shape ``ids.shape + (D,)``).  The table holds the weight's
codes (its real rows are ``(code - w_zp) · s_w[row]``); the rescale is per tensor
(length 1) or per row (length V: one factor ``s_w[row] / s_out`` per vocabulary entry),
so a per-row-quantized table lands on one output grid.  Ids outside ``[0, V)`` are an
error of the run (:class:`EmbeddingIdError` here, a status with the same message in
C++), never a read outside the table.
"""

from __future__ import annotations

import numpy as np

from qdsl.graph.checks import check_out
from qdsl.graph.ops import OpDef
from qdsl.graph.requant import apply_rescale
from qdsl.graph.schema import INT8_DTYPES, OUT_ATTRS, RQ_ATTRS, AttrType, DType, OpSchema, OutputStage
from qdsl.spec.diagnostics import QdslError

__all__ = ["OPS", "EmbeddingIdError", "embedding", "embedding_table"]


class EmbeddingIdError(QdslError):
    """A token id outside the table's rows reached an EMBEDDING op."""


def embedding_table(table: np.ndarray, a) -> np.ndarray:
    """The requantized table: every row through the op's output stage (per row or per tensor)."""
    st = OutputStage.from_attrs(a)
    t = np.asarray(table, dtype=np.int64) - a["w_zp"]
    return np.clip(apply_rescale(t, st.rescale, axis=0) + st.zero_point, st.qmin, st.qmax)


def check_ids(ids: np.ndarray, rows: int, name: str) -> None:
    """Raise :class:`EmbeddingIdError` naming the first id outside ``[0, rows)``."""
    bad = (ids < 0) | (ids >= rows)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise EmbeddingIdError(f"EMBEDDING {name!r}: token id {int(ids[at])} at index {list(at)} is outside "
                               f"[0, {rows}) ({int(bad.sum())} id(s) out of range)")


def embedding(ids: np.ndarray, table: np.ndarray, a, name: str = "?") -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64)
    check_ids(ids, table.shape[0], name)
    return embedding_table(table, a)[ids]


def _infer(c, op, ins, out):
    ids, table = ins
    c.dt(ids, (DType.I32,), "ids")
    c.const(table, "table")
    c.dt(table, INT8_DTYPES, "table")
    c.need(len(table.shape) == 2 and min(table.shape) >= 1, f"table {table.name!r} must be [V, D], has shape {table.shape}")
    c.int("w_zp", *table.dtype.range)
    c.dt(out, INT8_DTYPES, "output")
    check_out(c, out.dtype, table.shape[0])  # the rescale: one factor, or one per row
    return INT8_DTYPES, tuple(ids.shape) + (table.shape[1],)


def _run(op, args, graph, counts):
    return embedding(args[0], args[1].data, op.attrs, op.name)


OPS = (
    OpDef("EMBEDDING", 30, OpSchema(2, 2, {"w_zp": AttrType.INT, **RQ_ATTRS, **OUT_ATTRS}), _infer, _run,
          "I32 ids, a constant I8/U8 [V, D] table -> I8/U8 rows: "
          "``clamp(rescale(table[id] - w_zp, row id) + out_zp, out_min, out_max)``.", reads_ids=True),
)

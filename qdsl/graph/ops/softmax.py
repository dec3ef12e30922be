"""SOFTMAX: integer softmax along the last axis of an 8-bit input, by an exact exp table.

A row's codes ``x`` differ from its largest code ``m`` by ``d = x - m`` in [-255, 0] (the
zero point cancels), so ``exp(s·d)`` takes at most 256 values: the exporter stores them
as ``table[255 + d] = round(2^20 · exp(s·d))`` (so ``table[255] = 2^20``).  Then::

    E_i = table[x_i - m + 255]        S = Σ_i E_i            (int64)
    Q_i = floor(E_i · 2^30 / S)                               (in [0, 2^30])
    y_i = clamp(rescale(Q_i) + out_zp, out_min, out_max)

with the rescale the real factor ``2^-30 / s_out``: the output lands on the output
quantizer's grid (docs/qgraph.md §4.4).  Entries are at most 2^24 and ``table[255] >= 1``
(so ``S >= 1``); ``E_i · 2^30 < 2^54`` is exact in int64.
"""

from __future__ import annotations

import math

import numpy as np

from qdsl.graph.checks import check_out
from qdsl.graph.ops import OpDef
from qdsl.graph.requant import apply_rescale
from qdsl.graph.schema import INT8_DTYPES, OUT_ATTRS, RQ_ATTRS, AttrType, OpSchema, OutputStage

__all__ = ["OPS", "softmax", "softmax_table", "SOFTMAX_TABLE_BITS", "SOFTMAX_FRAC_BITS", "MAX_TABLE_ENTRY"]

SOFTMAX_TABLE_BITS = 20
"""``table[255] = 2^20`` in the tables the exporter writes (exp(0))."""
SOFTMAX_FRAC_BITS = 30
"""``Q = floor(E · 2^30 / S)``: the probability in 30 fraction bits before the output stage."""
MAX_TABLE_ENTRY = 2**24


def softmax_table(scale: float) -> tuple[int, ...]:
    """``table[255 + d] = round(2^20 · exp(scale · d))`` for ``d`` in [-255, 0] (float64), the
    table of an input grid ``scale``: the exporter and the fake-quant simulation
    (:mod:`qdsl.patch.int_sim`) both build it here."""
    one = 1 << SOFTMAX_TABLE_BITS
    return tuple(int(math.floor(one * math.exp(scale * (i - 255)) + 0.5)) for i in range(256))


def softmax(x: np.ndarray, a) -> np.ndarray:
    x = np.asarray(x, dtype=np.int64)
    table = np.asarray(a["table"], dtype=np.int64)
    e = table[x - x.max(axis=-1, keepdims=True) + 255]
    s = e.sum(axis=-1, keepdims=True)
    q = (e << SOFTMAX_FRAC_BITS) // s
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(q, st.rescale) + st.zero_point, st.qmin, st.qmax)


def _infer(c, op, ins, out):
    x = ins[0]
    c.dt(x, INT8_DTYPES, "input")
    c.need(len(x.shape) >= 2, f"input {x.name!r} needs an axis besides the batch, has shape {x.shape}")
    table = c.ints("table", 256, 0, MAX_TABLE_ENTRY)
    c.need(table[255] >= 1, "table[255] (exp(0)) must be >= 1")
    c.dt(out, INT8_DTYPES, "output")
    check_out(c, out.dtype, 1)
    return INT8_DTYPES, x.shape


OPS = (
    OpDef("SOFTMAX", 28, OpSchema(1, 1, {"table": AttrType.INTS, **RQ_ATTRS, **OUT_ATTRS}), _infer,
          lambda op, args, graph, counts: softmax(args[0], op.attrs),
          "Softmax along the last axis: exp table of the code differences, int64 sum, division, one output stage."),
)

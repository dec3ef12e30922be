"""RESIZE: separable two-tap interpolation along the spatial axes (nearest / (bi)linear upsample).

Every output position ``j`` of spatial axis ``d`` reads two input positions, ``i0 = index[j]``
and ``i1 = min(i0 + 1, L_d - 1)``, with integer weights ``2^F - weight[j]`` and ``weight[j]``
(``F = frac_bits``); the taps multiply across axes (bilinear: four taps).  The exact sum of
``w · (x - in_zp)`` goes through one output stage whose factor carries the ``2^(-F·rank)``
(docs/qgraph.md §4.4 has the formula, and how export derives the taps).  Nearest is
``F = 0``, all weights 0: a copy of ``x[i0]`` (exact when the stage is the identity).
"""

from __future__ import annotations

import numpy as np

from qdsl.graph.checks import check_out
from qdsl.graph.ops import OpDef
from qdsl.graph.requant import apply_rescale, apply_rescale_wide
from qdsl.graph.schema import INT8_DTYPES, OUT_ATTRS, RQ_ATTRS, AttrType, DType, OpSchema, OutputStage

__all__ = ["OPS", "resize", "MAX_FRAC_BITS"]

MAX_FRAC_BITS = 11
"""For an 8-bit input ``|x - in_zp| <= 255`` and the tap product ``<= 2^(2F)``: the sum stays
inside int32 (255 · 2^22 < 2^31), so the stage never saturates its input."""


def _taps(a, in_sizes):
    """Per spatial axis: (i0, i1, w0, w1) int64 arrays over the output positions."""
    one = 1 << a["frac_bits"]
    out, start = [], 0
    for n_in, n_out in zip(in_sizes, a["size"]):
        i0 = np.asarray(a["index"][start:start + n_out], dtype=np.int64)
        w1 = np.asarray(a["weight"][start:start + n_out], dtype=np.int64)
        out.append((i0, np.minimum(i0 + 1, n_in - 1), one - w1, w1))
        start += n_out
    return out


def resize(x: np.ndarray, a, x_dtype: DType) -> np.ndarray:
    v = x.astype(np.int64) - a["in_zp"]
    for d, (i0, i1, w0, w1) in enumerate(_taps(a, v.shape[2:])):
        axis = 2 + d
        shape = [1] * v.ndim
        shape[axis] = -1
        # exact: |v| grows by at most 2^F per axis (int64 for an I32 accumulator input)
        v = np.take(v, i0, axis=axis) * w0.reshape(shape) + np.take(v, i1, axis=axis) * w1.reshape(shape)
    st = OutputStage.from_attrs(a)
    # the wide rescale equals the int32 one on int32-range sums (always for I8/U8 inputs,
    # MAX_FRAC_BITS); an I32 accumulator input times 2^(F·rank) needs it
    scaled = apply_rescale_wide(v, st.rescale) if x_dtype is DType.I32 else apply_rescale(v, st.rescale)
    return np.clip(scaled + st.zero_point, st.qmin, st.qmax)


def _infer(c, op, ins, out):
    x = ins[0]
    c.dt(x, INT8_DTYPES + (DType.I32,), "input")
    rank = len(x.shape) - 2
    c.need(rank in (1, 2), f"input {x.name!r} must have 1 or 2 spatial dims, has shape {x.shape}")
    size = c.ints("size", rank, 1, 1 << 24)
    f = c.int("frac_bits", 0, MAX_FRAC_BITS)
    n = sum(size)
    c.ints("weight", n, 0, 1 << f)
    idx = c.ints("index", n, 0, None)
    start = 0
    for d in range(rank):
        in_len = x.shape[2 + d]
        part = idx[start:start + size[d]]
        c.need(all(i < in_len for i in part), f"attribute 'index' of spatial axis {d} must be < {in_len}")
        start += size[d]
    c.int("in_zp", *x.dtype.range)
    c.dt(out, INT8_DTYPES, "output")
    check_out(c, out.dtype, x.shape[1])
    return INT8_DTYPES, x.shape[:2] + tuple(size)


_ATTRS = {"size": AttrType.INTS, "index": AttrType.INTS, "weight": AttrType.INTS, "frac_bits": AttrType.INT,
          "in_zp": AttrType.INT, **RQ_ATTRS, **OUT_ATTRS}
OPS = (
    OpDef("RESIZE", 24, OpSchema(1, 1, _ATTRS), _infer,
          lambda op, args, graph, counts: resize(args[0], op.attrs, graph.tensor(op.inputs[0]).dtype),
          "Separable two-tap interpolation (nearest / linear / bilinear) per spatial axis, then an output stage."),
)

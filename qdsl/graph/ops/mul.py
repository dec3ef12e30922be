"""MUL: elementwise product of two quantized activations (numpy broadcasting), one output stage.

``y = clamp(rescale((x0 - zp0) · (x1 - zp1)) + out_zp, out_min, out_max)``: the real
product ``(x0 - zp0)·s0 · (x1 - zp1)·s1`` requantized by the factor ``s0·s1 / s_out``.
Each difference of an 8-bit code and its zero point is in [-255, 255], so the product is
within ±65025: exact in int32, and the output stage reads it as an accumulator.
Squeeze-excitation multiplies a (N, C, H, W) activation by a (N, C, 1, 1) gate: the two
shapes broadcast as in numpy (same rank; per dimension equal or one of them 1; the batch
dimensions equal).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from qdsl.graph.checks import check_out
from qdsl.graph.ops import OpDef
from qdsl.graph.requant import apply_rescale
from qdsl.graph.schema import INT8_DTYPES, OUT_ATTRS, RQ_ATTRS, AttrType, OpSchema, OutputStage

__all__ = ["OPS", "mul", "broadcast_shape"]


def broadcast_shape(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...] | None:
    """The shape MUL's operands of shapes ``a`` and ``b`` broadcast to, or ``None``.

    Same rank; per dimension equal or one of them 1; a dimension 1 on both sides stays 1.
    The batch dimension (``-1`` in a graph) must be equal: it is never broadcast."""
    if len(a) != len(b) or not a or a[0] != b[0]:
        return None
    out = [a[0]]
    for x, y in zip(a[1:], b[1:]):
        if x != y and 1 not in (x, y):
            return None
        out.append(y if x == 1 else x)
    return tuple(out)


def mul(xs: Sequence[np.ndarray], a) -> np.ndarray:
    # int64 throughout; |(x0 - zp0)(x1 - zp1)| <= 255 * 255, inside int32 before the stage
    product = (xs[0] - a["in_zp"][0]) * (xs[1] - a["in_zp"][1])
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(product, st.rescale) + st.zero_point, st.qmin, st.qmax)


def _infer(c, op, ins, out):
    for i, tensor in enumerate(ins):
        c.dt(tensor, INT8_DTYPES, f"input {i}")
    zps = c.ints("in_zp", 2)
    for tensor, zp in zip(ins, zps):
        c.need(tensor.dtype.range[0] <= zp <= tensor.dtype.range[1], f"in_zp {zp} outside the range of {tensor.name!r}")
    shape = broadcast_shape(ins[0].shape, ins[1].shape)
    c.need(shape is not None, f"mul operands {ins[0].shape} and {ins[1].shape} do not broadcast (same rank, "
                              "each dimension equal or 1, equal batch)")
    c.dt(out, INT8_DTYPES, "output")
    check_out(c, out.dtype, 1)
    return INT8_DTYPES, shape


OPS = (
    OpDef("MUL", 21, OpSchema(2, 2, {"in_zp": AttrType.INTS, **RQ_ATTRS, **OUT_ATTRS}),
          _infer, lambda op, args, graph, counts: mul(args, op.attrs),
          "Elementwise product of two quantized activations (numpy broadcasting), one output stage.",
          all_activations=True),
)

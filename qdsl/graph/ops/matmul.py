"""MATMUL: the product of two quantized activations (attention's ``q @ kᵀ`` and ``p @ v``).

Each operand is first viewed through a permutation of its dimensions (``a_perm``,
``b_perm``: the batch dimension stays first), so a transpose or a head split feeding the
product costs no op; the permuted operands are ``(B, ..., M, K)`` and ``(B, ..., K, N)``
with the same rank and the leading dimensions between the batch and the last two
broadcast as in numpy (equal or 1).  Then::

    acc[..., m, n] = Σ_k (a[..., m, k] - zp_a) · (b[..., k, n] - zp_b)
    y = clamp(rescale(acc) + out_zp, out_min, out_max)

permuted by ``out_perm``.  Each difference is in [-255, 255], so ``K ≤ 33025`` keeps the
sum exact in int32; the rescale is the real factor ``s_a · s_b / s_out`` (one per tensor).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from qdsl.graph.checks import check_out
from qdsl.graph.ops import OpDef
from qdsl.graph.requant import apply_rescale
from qdsl.graph.schema import INT8_DTYPES, OUT_ATTRS, RQ_ATTRS, AttrType, OpSchema, OutputStage

__all__ = ["OPS", "matmul", "matmul_shape", "MAX_DEPTH"]

MAX_DEPTH = (2**31 - 1) // (255 * 255)
"""The largest reduction length whose sum of products of two 8-bit differences fits int32."""


def _permuted(shape: Sequence[int], perm: Sequence[int]) -> tuple[int, ...] | None:
    if sorted(perm) != list(range(len(shape))) or not perm or perm[0] != 0:
        return None
    return tuple(shape[p] for p in perm)


def matmul_shape(a: Sequence[int], b: Sequence[int], a_perm: Sequence[int], b_perm: Sequence[int],
                 out_perm: Sequence[int]) -> tuple[tuple[int, ...] | None, str]:
    """The output shape of MATMUL on operands of shapes ``a`` and ``b`` (``None`` and the
    reason when the operands or permutations do not fit)."""
    pa, pb = _permuted(a, a_perm), _permuted(b, b_perm)
    if pa is None or pb is None:
        return None, f"a_perm {tuple(a_perm)} / b_perm {tuple(b_perm)} must permute the operand dims, batch first"
    if len(pa) != len(pb) or len(pa) < 3:
        return None, f"operands {pa} and {pb} (permuted) need the same rank >= 3"
    if pa[0] != pb[0]:
        return None, f"operands {pa} and {pb} have different batch dims"
    if pa[-1] != pb[-2]:
        return None, f"inner dims differ: {pa} @ {pb}"
    lead = []
    for x, y in zip(pa[1:-2], pb[1:-2]):
        if x != y and 1 not in (x, y):
            return None, f"leading dims of {pa} and {pb} do not broadcast"
        lead.append(y if x == 1 else x)
    out = (pa[0], *lead, pa[-2], pb[-1])
    po = _permuted(out, out_perm)
    if po is None:
        return None, f"out_perm {tuple(out_perm)} must permute the {len(out)} result dims, batch first"
    return po, ""


def matmul(xs: Sequence[np.ndarray], a) -> np.ndarray:
    x0 = np.transpose(np.asarray(xs[0], dtype=np.int64) - a["in_zp"][0], a["a_perm"])
    x1 = np.transpose(np.asarray(xs[1], dtype=np.int64) - a["in_zp"][1], a["b_perm"])
    acc = np.matmul(x0, x1)  # int64, exact; within int32 for K <= MAX_DEPTH
    st = OutputStage.from_attrs(a)
    y = np.clip(apply_rescale(acc, st.rescale) + st.zero_point, st.qmin, st.qmax)
    return np.transpose(y, a["out_perm"])


def _infer(c, op, ins, out):
    for i, tensor in enumerate(ins):
        c.dt(tensor, INT8_DTYPES, f"input {i}")
        c.act(tensor, f"input {i}")
    zps = c.ints("in_zp", 2)
    for tensor, zp in zip(ins, zps):
        c.need(tensor.dtype.range[0] <= zp <= tensor.dtype.range[1], f"in_zp {zp} outside the range of {tensor.name!r}")
    a = op.attrs
    shape, why = matmul_shape(ins[0].shape, ins[1].shape, a["a_perm"], a["b_perm"], a["out_perm"])
    c.need(shape is not None, why)
    depth = _permuted(ins[0].shape, a["a_perm"])[-1]
    c.need(depth <= MAX_DEPTH, f"reduction length {depth} exceeds {MAX_DEPTH} (int32 accumulator)")
    c.dt(out, INT8_DTYPES, "output")
    check_out(c, out.dtype, 1)
    return INT8_DTYPES, shape


OPS = (
    OpDef("MATMUL", 27, OpSchema(2, 2, {"in_zp": AttrType.INTS, "a_perm": AttrType.INTS, "b_perm": AttrType.INTS,
                                        "out_perm": AttrType.INTS, **RQ_ATTRS, **OUT_ATTRS}),
          _infer, lambda op, args, graph, counts: matmul(args, op.attrs),
          "Batched product of two quantized activations (operand and result permutations), one output stage.",
          all_activations=True),
)

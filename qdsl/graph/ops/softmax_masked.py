"""SOFTMAX_MASKED: SOFTMAX (:mod:`qdsl.graph.ops.softmax`) over the positions one or two masks keep.

Inputs: ``x`` (I8/U8, rank >= 2, the scores) and one or two masks (activations, graph
inputs or constants; I32, I8, U8 or F32).  A mask is placed on ``x`` by ``mask_dims``
(``rank(x)`` entries per mask, the masks' lists concatenated): entry ``a`` is the mask
dim that indexes ``x``'s axis ``a``, or -1 where the mask broadcasts over that axis.
Consecutive axes may share one mask dim (row-major: a ``(N·H, L, S)`` mask on
``(N, H, L, S)`` scores has ``mask_dims = (0, 0, 1, 2)``); a mask dim of size 1
broadcasts over its axes.  So a key mask ``(N, S)`` on ``(N, H, L, S)`` is
``(0, -1, -1, 1)`` and an attention mask ``(L, S)`` is ``(-1, -1, 0, 1)``.

``mask_attend`` (one per mask) says which values attend: 1 = a nonzero value attends
(Hugging Face's ``attention_mask``), 0 = a zero value attends and a nonzero one masks
(torch's bool masks, True = masked).  An F32 mask is additive (torch's float masks):
its values must be 0 (attend) or -inf (masked), with ``mask_attend = 0``; any other
value is an error of the run (:class:`MaskError` here, a status with the same message
in C++), as it has no integer form.

A position is kept when every mask keeps it.  Per row (``K`` the kept positions)::

    m = max_{i in K} x_i
    E_i = table[x_i - m + 255] for i in K, 0 otherwise        S = Σ_i E_i      (int64)
    Q_i = floor(E_i · 2^30 / S)       (Q_i = 0 for every i when K is empty)
    y_i = clamp(rescale(Q_i) + out_zp, out_min, out_max)

which is SOFTMAX of the kept codes alone (a masked position gets exactly probability 0,
code ``out_zp``).  A fully masked row (K empty), where float softmax gives NaN, gives all
probabilities 0: ``y_i = clamp(out_zp)``; the fake-quant attention does the same
(:func:`qdsl.patch.attention.attention`).  A mask's dims are checked against ``x``'s when
the graph is validated where both are known, and at run time (a dim of size -1 is the batch).
"""

from __future__ import annotations

import numpy as np

from qdsl.graph.checks import check_out
from qdsl.graph.ops import OpDef
from qdsl.graph.ops.softmax import MAX_TABLE_ENTRY, SOFTMAX_FRAC_BITS
from qdsl.graph.requant import apply_rescale
from qdsl.graph.schema import INT8_DTYPES, OUT_ATTRS, RQ_ATTRS, AttrType, DType, OpSchema, OutputStage
from qdsl.spec.diagnostics import QdslError

__all__ = ["OPS", "MaskError", "MASK_DTYPES", "softmax_masked", "softmax_kept", "mask_keep", "check_mask_dims"]

MASK_DTYPES = (DType.I32, DType.I8, DType.U8, DType.F32)
"""The dtypes a mask input may have."""


class MaskError(QdslError):
    """A mask reaching SOFTMAX_MASKED at run time does not fit its scores or holds a float
    value other than 0 and -inf."""


def check_mask_dims(dims, mask_rank: int) -> str | None:
    """Why ``dims`` (one mask's ``mask_dims`` entries) is not a valid placement, or None."""
    used = [d for d in dims if d != -1]
    if any(d < -1 or d >= mask_rank for d in dims):
        return f"entries must be -1 or a mask dim in [0, {mask_rank})"
    if used != sorted(used) or sorted(set(used)) != list(range(mask_rank)):
        return f"the mask dims must appear in order, each at least once (mask rank {mask_rank})"
    for k in set(used):
        axes = [a for a, d in enumerate(dims) if d == k]
        if axes != list(range(axes[0], axes[-1] + 1)):
            return f"mask dim {k} must index consecutive axes, got {axes}"
    return None


def _groups(dims) -> list[list[int]]:
    return [[a for a, d in enumerate(dims) if d == k] for k in range(max(dims) + 1)]


def mask_keep(xshape: tuple[int, ...], mask: np.ndarray, dims, attend: int, name: str, what: str) -> np.ndarray:
    """The positions of ``x`` (shape ``xshape``) that ``mask`` keeps, as a bool array."""
    mask = np.asarray(mask)
    if mask.ndim != max(dims) + 1:
        raise MaskError(f"SOFTMAX_MASKED {name!r}: {what} has rank {mask.ndim}, expected {max(dims) + 1}")
    view = [1] * len(xshape)
    for k, axes in enumerate(_groups(dims)):
        want = int(np.prod([xshape[a] for a in axes]))
        if mask.shape[k] == 1:
            continue
        if mask.shape[k] != want:
            raise MaskError(f"SOFTMAX_MASKED {name!r}: {what} dim {k} has size {mask.shape[k]}, expected {want} "
                            f"(axes {axes} of scores {tuple(xshape)}) or 1")
        for a in axes:
            view[a] = xshape[a]
    if mask.dtype.kind == "f":
        bad = ~((mask == 0) | (mask == -np.inf))
        if bad.any():
            at = [int(i) for i in np.argwhere(bad)[0]]
            raise MaskError(f"SOFTMAX_MASKED {name!r}: {what} holds {float(mask[tuple(at)]):g} at index {at}: an "
                            "additive float mask must be 0 (attend) or -inf (masked)")
    nonzero = np.asarray(mask != 0).reshape(view)
    return np.broadcast_to(nonzero if attend else ~nonzero, xshape)


def softmax_masked(x: np.ndarray, masks, a, name: str = "?", mask_names=None) -> np.ndarray:
    x = np.asarray(x, dtype=np.int64)
    rank = x.ndim
    keep = np.ones(x.shape, dtype=bool)
    for j, mask in enumerate(masks):
        what = f"mask {mask_names[j]!r}" if mask_names else f"mask {j + 1}"
        keep = keep & mask_keep(x.shape, mask, a["mask_dims"][j * rank:(j + 1) * rank], a["mask_attend"][j], name,
                                what)
    return softmax_kept(x, keep, a)


def softmax_kept(x: np.ndarray, keep: np.ndarray, a) -> np.ndarray:
    """The op's arithmetic on the codes ``x`` over the positions ``keep`` (bool, x's shape)
    marks; ``a`` needs ``table`` and the output stage.  The fake-quant simulation
    (:mod:`qdsl.patch.int_sim`) calls this same function."""
    x = np.asarray(x, dtype=np.int64)
    table = np.asarray(a["table"], dtype=np.int64)
    m = np.where(keep, x, np.iinfo(np.int64).min).max(axis=-1, keepdims=True)
    e = np.where(keep, table[np.where(keep, x - m + 255, 255)], 0)
    s = e.sum(axis=-1, keepdims=True)
    q = (e << SOFTMAX_FRAC_BITS) // np.maximum(s, 1)  # a fully masked row: every E_i = 0, so Q_i = 0
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(q, st.rescale) + st.zero_point, st.qmin, st.qmax)


def _infer(c, op, ins, out):
    x, masks = ins[0], ins[1:]
    c.dt(x, INT8_DTYPES, "input")
    c.act(x, "input")
    rank = len(x.shape)
    c.need(rank >= 2, f"input {x.name!r} needs an axis besides the batch, has shape {x.shape}")
    dims = c.ints("mask_dims", rank * len(masks), -1)
    attend = c.ints("mask_attend", len(masks), 0, 1)
    for j, mask in enumerate(masks):
        c.dt(mask, MASK_DTYPES, f"mask {j + 1}")
        c.need(mask.dtype is not DType.F32 or attend[j] == 0,
               f"mask {mask.name!r} is F32 (additive: 0 attends, -inf masks), so its mask_attend must be 0")
        md = tuple(dims[j * rank:(j + 1) * rank])
        why = check_mask_dims(md, len(mask.shape))
        c.need(why is None, f"mask_dims {md} of mask {mask.name!r} (shape {mask.shape}): {why}")
        for k, axes in enumerate(_groups(md)):
            sizes = [x.shape[a] for a in axes]
            size = mask.shape[k]
            if size in (1, -1) or -1 in sizes:  # -1 is the batch: checked at run time
                continue
            c.need(size == int(np.prod(sizes)), f"mask {mask.name!r} dim {k} has size {size}, expected "
                   f"{int(np.prod(sizes))} (axes {axes} of {x.shape}) or 1")
    table = c.ints("table", 256, 0, MAX_TABLE_ENTRY)
    c.need(table[255] >= 1, "table[255] (exp(0)) must be >= 1")
    c.dt(out, INT8_DTYPES, "output")
    check_out(c, out.dtype, 1)
    return INT8_DTYPES, x.shape


def _run(op, args, graph, counts):
    masks = [m if isinstance(m, np.ndarray) else m.data for m in args[1:]]
    return softmax_masked(args[0], masks, op.attrs, op.name, op.inputs[1:])


OPS = (
    OpDef("SOFTMAX_MASKED", 34,
          OpSchema(2, 3, {"table": AttrType.INTS, "mask_dims": AttrType.INTS, "mask_attend": AttrType.INTS,
                          **RQ_ATTRS, **OUT_ATTRS}),
          _infer, _run,
          "SOFTMAX over the positions one or two masks keep (masked: probability 0; a fully masked row: all 0).",
          reads_masks=True),
)

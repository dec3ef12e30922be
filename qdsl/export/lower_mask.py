"""Attention masks computed from an integer graph input (Hugging Face's additive
``(1 - attention_mask[:, None, None, :]) * finfo.min``, sdpa's bool masks).

A value computed only from one integer graph input (the ``attention_mask`` the model was
called with: an I32 graph input) and constants, through casts, arithmetic, comparisons,
indexing, ``expand``/``reshape``/``unsqueeze`` and the like, is not a quantized value but a
*mask expression*: :class:`MaskExpr` records it symbolically (a function of the input,
built node by node), so any such construction is accepted without a lowering per op.  Where
it is added to the attention scores (``scores + mask``), :func:`add_mask` checks its meaning
by evaluating the recorded expression on probe inputs of the example's shape: all ones, and
0/1 patterns (seeded) and their complements; each entry must be 0 where the mask attends and
at or below ``finfo.min / 2`` (or ``-inf``) where it masks, with the mask's 1s attending
(``attend = 1``) or its 0s attending (``attend = 0``), and the masked entries of the broadcast
``(N, H, L, S)`` result must be those of the input placed by one ``mask_dims`` (batch axis on
the scores' batch axis).  Anything else is refused naming the module and the op.  The
``scores`` quantizer then reads the scores alone (as the fake-quant model, which leaves the
masked positions out) and the softmax becomes SOFTMAX_MASKED reading the graph input itself
(``mask_dims``, ``mask_attend``: docs/qgraph.md §4.4).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Callable

import attrs
import torch

from qdsl.export.lower_attn import MaskInput, softmax_pending
from qdsl.export.values import ConstVal, ExportError, IdsVal, Pending, QVal

__all__ = ["MaskExpr", "MaskedScores", "MaskedQ", "mask_step", "add_mask", "masked_softmax", "read_mask",
           "NOT_A_MASK"]

NOT_A_MASK = object()
""":func:`mask_step`'s answer for an op that reads no mask expression."""


@attrs.frozen(eq=False)
class MaskExpr:
    """A function ``fn`` of the integer graph input ``input`` (example value ``example``)."""

    origin: str
    input: str
    example: torch.Tensor
    fn: Callable[[torch.Tensor], Any]

    @property
    def value(self) -> Any:
        return self.fn(self.example)


@attrs.frozen(eq=False)
class MaskedScores:
    """The scores plus a mask expression, before the ``scores`` quantizer."""

    origin: str
    scores: Any
    mask: MaskExpr


@attrs.frozen(eq=False)
class MaskedQ:
    """The quantized scores and the mask SOFTMAX_MASKED will read."""

    origin: str
    q: QVal
    mask: MaskExpr


def _as_expr(lw, a: Any) -> MaskExpr | None:
    if isinstance(a, MaskExpr):
        return a
    if isinstance(a, IdsVal) and a.name in lw.input_examples:
        return MaskExpr(a.origin, a.name, lw.input_examples[a.name], lambda t: t)
    return None


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    torch.fx.node.map_aggregate(args, lambda v: out.append(v) or v)
    return out


def mask_step(lw, kind: str, target: Any, args: tuple, kwargs: dict, where: str) -> Any:
    """A call (``kind``: function or method) reading a mask expression and otherwise only
    constants: the extended expression; :data:`NOT_A_MASK` when it reads none."""
    leaves = _flat((args, kwargs))
    exprs = [e for e in (_as_expr(lw, a) for a in leaves) if e is not None]
    if not exprs or (kind == "function" and target is operator.getitem and not isinstance(args[0], (MaskExpr, IdsVal))):
        return NOT_A_MASK
    if any(isinstance(a, IdsVal) for a in leaves) and not any(isinstance(a, MaskExpr) for a in leaves) \
            and kind == "function" and target in (torch.nn.functional.embedding,):
        return NOT_A_MASK
    if len({e.input for e in exprs}) > 1:
        raise ExportError(where, "a value computed from two integer graph inputs has no integer lowering")
    others = [a for a in leaves if _as_expr(lw, a) is None and isinstance(a, (Pending, QVal))]
    if others:
        return NOT_A_MASK  # the scores + mask add (add_mask) or an op the caller refuses
    base = exprs[0]

    def sub(a: Any, t: torch.Tensor) -> Any:
        e = _as_expr(lw, a)
        if e is not None:
            return e.fn(t)
        return a.value if isinstance(a, ConstVal) else a

    def fn(t: torch.Tensor) -> Any:
        a = torch.fx.node.map_aggregate(args, lambda v: sub(v, t))
        k = torch.fx.node.map_aggregate(kwargs, lambda v: sub(v, t))
        if kind == "method":
            return getattr(a[0], target)(*a[1:], **k)
        return target(*a, **k)
    expr = MaskExpr(where or "<model>", base.input, base.example, fn)
    try:
        with torch.no_grad():
            expr.value
    except Exception as exc:  # noqa: BLE001 - the model's own op on its own example failed
        raise ExportError(where, f"the mask computation {getattr(target, '__name__', target)} failed on the "
                                 f"example ({type(exc).__name__}: {exc})") from None
    return expr


def add_mask(where: str, a: Any, b: Any) -> MaskedScores | None:
    """``scores + mask`` (either order); None when neither operand is a mask expression."""
    if isinstance(b, MaskExpr) and not isinstance(a, MaskExpr):
        return MaskedScores(where, a, b)
    if isinstance(a, MaskExpr) and not isinstance(b, MaskExpr):
        return MaskedScores(where, b, a)
    return None


def _probes(example: torch.Tensor) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [torch.ones_like(example)]
    for _ in range(3):
        p = (torch.rand(example.shape, generator=g) < 0.5).to(example.dtype)
        p.view(-1)[0], p.view(-1)[-1] = 1, 0  # both values present
        out += [p, 1 - p]
    return out


def _placements(in_rank: int, out_rank: int) -> list[tuple[int, ...]]:
    """Candidate ``mask_dims``: input dim 0 on the batch axis, the others on increasing axes."""
    out = []
    for axes in itertools.combinations(range(1, out_rank), in_rank - 1):
        dims = [-1] * out_rank
        dims[0] = 0
        for d, a in enumerate(axes, start=1):
            dims[a] = d
        out.append(tuple(dims))
    return out


def _placed(p: torch.Tensor, dims: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor | None:
    """The input ``p`` indexed onto an output of ``shape`` by ``dims`` (-1: broadcast);
    None when the sizes do not fit."""
    if any(d >= 0 and p.shape[d] not in (1, shape[a]) for a, d in enumerate(dims)):
        return None
    order = [d for d in dims if d >= 0]
    view = p.permute(*order).reshape([p.shape[d] if d >= 0 else 1 for d in dims])
    return view.expand(shape)


def _same(masked: torch.Tensor, placed: torch.Tensor | None) -> bool:
    return placed is not None and torch.equal(masked, placed)


def read_mask(where: str, m: MaskedQ, scores_shape: tuple[int, ...]) -> MaskInput:
    """Check what the mask expression means (module doc) and return the SOFTMAX_MASKED mask."""
    expr = m.mask
    shape = (expr.example.shape[0],) + tuple(scores_shape[1:])
    bad = (f"the attention mask added to the scores at '{expr.origin}' is not a padding mask of the "
           f"integer input '{expr.input}' (0 where it attends, <= finfo.min/2 where it masks)")
    hint = "pass the 0/1 attention mask as the model input and build the additive mask in the forward"
    results = []
    with torch.no_grad():
        for p in _probes(expr.example):
            e = expr.fn(p)
            if not isinstance(e, torch.Tensor) or not e.is_floating_point():
                raise ExportError(where, bad + f" (it is {getattr(e, 'dtype', type(e).__name__)})", hint)
            try:
                e = e.expand(shape)
            except RuntimeError:
                raise ExportError(where, bad + f" (shape {tuple(e.shape)} does not broadcast to the scores' "
                                               f"{shape})", hint) from None
            masked = e <= torch.finfo(e.dtype).min / 2
            if not torch.all(masked | (e == 0)):
                raise ExportError(where, bad + " (it holds values other than 0 and <= finfo.min/2)", hint)
            results.append((p, masked))
    for attend in (1, 0):
        for dims in _placements(expr.example.dim(), len(shape)):
            if all(_same(masked, _placed((p == 0) if attend else (p != 0), dims, shape)) for p, masked in results):
                return MaskInput(expr.input, dims, attend=attend)
    raise ExportError(where, bad + " (its masked positions are not the input's zeros or ones placed on the "
                                   "scores' axes)", hint)


def masked_softmax(where: str, x: Any, dim: int, shape: tuple[int, ...]) -> Pending:
    """SOFTMAX_MASKED of quantized scores carrying their mask expression."""
    return softmax_pending(where, x.q, dim, shape, masks=[read_mask(where, x, shape)])

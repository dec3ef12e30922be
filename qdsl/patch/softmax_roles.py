"""The ``scores``/``probs`` roles of any module: the input and the result of the softmax its
forward computes, directly or in the functions it calls.

Hugging Face's attention (``eager_attention_forward``) computes ``q·kᵀ·scale + mask``, then
``F.softmax``, inside a function no hook reaches, and returns neither the scores nor the
probabilities; the default ``sdpa`` attention hands the whole thing to
``F.scaled_dot_product_attention``.  Without editing the model (DESIGN §4), a forward
pre-hook / forward hook pair (:class:`SoftmaxRoles`) enters a
:class:`torch.overrides.TorchFunctionMode` for the duration of that module's forward only;
the mode intercepts ``F.softmax``, ``torch.softmax``, ``Tensor.softmax`` and
``F.scaled_dot_product_attention`` (decomposed into matmul, scale, mask, softmax, matmul:
float-equal to torch's within ~1e-6) and applies the ``scores`` quantizer to the softmax's
input and the ``probs`` quantizer to its result (:func:`quantized_softmax`).  One mode
serves every patched module: a stack of active modules, the innermost one's quantizers act
(a block and the attention inside it both carrying the roles quantize once).
Without autograd the decomposition runs in fewer passes with reused buffers
(``_sdpa_eval``), bit for bit the same result as the reference one (``_sdpa_reference``,
which training runs).

Masks.  A softmax input entry at or below ``finfo.min / 2`` (or ``-inf``) is a masked
position (Hugging Face adds ``(1 - mask)·finfo.min``; sdpa's bool masks become ``-inf``):
the ``scores`` quantizer neither observes nor quantizes it (a per-tensor scale calibrated on
``finfo.min`` would be useless), the softmax gives it probability 0, and a fully masked row
gets probability 0 everywhere, as the graph's SOFTMAX_MASKED defines (docs/qgraph.md §4.4;
float softmax would spread such a row uniformly).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from qdsl.patch.int_sim import grid_of, simulated_probs
from qdsl.spec.diagnostics import QdslError

__all__ = ["SoftmaxRoles", "TracingRoles", "quantized_softmax", "masked_positions", "SOFTMAX_FUNCTIONS"]

SOFTMAX_FUNCTIONS = (F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax)
"""The softmax entry points the roles intercept (``nn.Softmax`` calls ``F.softmax``)."""


def masked_positions(x: torch.Tensor) -> torch.Tensor:
    """Where a softmax input is masked: at or below ``finfo.min / 2`` (``-inf`` included)."""
    return x <= torch.finfo(x.dtype).min / 2


def _any(mask: torch.Tensor) -> bool:
    """``bool(mask.any())`` for a bool tensor, ~15x faster on CPU (a uint8 max)."""
    return bool(mask.numel()) and bool(mask.view(torch.uint8).max())


def _quantize_kept(q: Any, x: torch.Tensor, masked: torch.Tensor, who: str, any_masked: bool | None = None
                   ) -> torch.Tensor:
    """``q`` applied to the entries of ``x`` that are not masked; masked ones unchanged
    (``any_masked``: ``masked.any()`` if the caller knows it)."""
    if not (_any(masked) if any_masked is None else any_masked):
        return q(x)
    if getattr(q, "axis", None) is not None or getattr(q, "group_size", None):
        raise QdslError(f"'{who}': a masked softmax input needs a per-tensor 'scores' quantizer "
                        "(its masked positions are left out, which a per-channel scale cannot)")
    if _elementwise(q, x):
        # the same values without gathering the kept entries (nonzero, index and
        # masked_scatter cost several passes; evaluation of a padded batch)
        return torch.where(masked, x, q(x))
    keep = ~masked
    return x.masked_scatter(keep, q(x[keep]))


def _elementwise(q: Any, x: torch.Tensor) -> bool:
    """``q(x)`` quantizes every entry on its own with parameters that do not depend on
    ``x`` (a static or frozen per-tensor proxy, deterministic rounding, not observing, no
    finiteness check): then quantizing all of ``x`` and keeping the masked entries equals
    quantizing the kept ones.  A dynamic scale (the range of the kept entries), an observer
    that would see the masked ones, or stochastic rounding (random numbers drawn per entry)
    would not.

    With autograd (training), also: an integer format, no learned scale or threshold and
    no derived scale, so that the gradient reaches ``x`` alone, entry by entry (the plain
    straight-through estimator or the clipping-mask one of ``ste.fake_quant``).  Then
    ``where(masked, x, q(x))`` has the gather's gradient too: at a masked entry ``g`` from
    ``x`` plus ``+0`` from ``q`` (its share of ``g`` is the where's zero), at a kept one
    ``+0`` plus ``q``'s gradient of ``g``, the same two addends the gather's backward
    (``masked_fill`` and ``index_put`` into zeros) sums; nothing reaches a scale."""
    from qdsl.quantizers.formats.int import IntOps
    from qdsl.quantizers.proxy import TensorQuantizer

    if not (isinstance(q, TensorQuantizer) and not q.stateless and not q.observing and not q.check_finite
            and q._round_fn is None and q._round_mode != "stochastic" and not q.offset.numel()):
        return False
    if not (torch.is_grad_enabled() and x.requires_grad):
        return True
    return (isinstance(q._ops, IntOps) and not q.learned and not q.derived and q.sign_threshold is None
            and q.recipe.threshold != "learned")


def quantized_softmax(x: torch.Tensor, dim: int, sq: Any, pq: Any, who: str,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """``softmax(x, dim)`` with ``sq`` on its kept input entries and ``pq`` on its result
    (None: not quantized); masked positions get 0, a fully masked row 0 everywhere."""
    if dtype is not None:
        x = x.to(dtype)
    masked = masked_positions(x)
    any_masked = _any(masked)
    # a row is fully masked iff its largest entry is (a NaN entry is not masked and makes
    # the row's max NaN: not fully masked either); a float max is ~8x cheaper than all()
    rows = x.amax(dim=dim, keepdim=True) <= torch.finfo(x.dtype).min / 2 if any_masked else None
    if sq is not None:
        x = _quantize_kept(sq, x, masked, who, any_masked)
    p = torch.softmax(x, dim)
    if rows is not None and _any(rows):
        # masked entries are exactly 0 already (exp underflows); a fully masked row is not
        p = p.masked_fill(rows, 0.0)
    p = pq(p) if pq is not None else p
    if sq is not None and pq is not None and dim in (-1, x.dim() - 1):
        # frozen grids: the graph's SOFTMAX_MASKED itself, straight-through (qdsl.patch.int_sim)
        p = simulated_probs(x, ~masked, p, sq, pq)
    return p


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
          sq: Any, pq: Any, who: str) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as its documented reference formula, with the
    roles' quantizers around the softmax (:func:`_sdpa_eval` when nothing needs autograd)."""
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if enable_gqa and key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    if _eval_operands(query, key, value) and not (attn_mask is not None and attn_mask.requires_grad
                                                  and torch.is_grad_enabled()):
        return _sdpa_eval(query, key, value, attn_mask, dropout_p, is_causal, factor, sq, pq, who)
    return _sdpa_reference(query, key, value, attn_mask, dropout_p, is_causal, factor, sq, pq, who)


def _sdpa_reference(query, key, value, attn_mask, dropout_p, is_causal, factor, sq, pq, who) -> torch.Tensor:
    """The decomposition every path equals: matmul, scale, mask, :func:`quantized_softmax`, matmul."""
    length, s_len = query.shape[-2], key.shape[-2]
    scores = torch.matmul(query, key.transpose(-2, -1)) * factor
    neg = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    if is_causal:
        causal = torch.ones(length, s_len, dtype=torch.bool, device=scores.device).tril()
        scores = scores.where(causal, neg)
    if attn_mask is not None:
        # sdpa's bool mask: True = attend
        scores = scores.where(attn_mask, neg) if attn_mask.dtype == torch.bool else scores + attn_mask
    probs = quantized_softmax(scores, -1, sq, pq, who)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, value)


def _eval_operands(query, key, value) -> bool:
    """q, k, v (float32, CPU, no autograd, not traced) of one batch shape, 3-d or 4-d: the
    products of :func:`_sdpa_eval` are the batched ones ``torch.matmul`` makes of them."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                                                        or value.requires_grad)):
        return False
    if not (query.dtype is key.dtype is value.dtype is torch.float32) or query.device.type != "cpu" \
            or key.device.type != "cpu" or value.device.type != "cpu":
        return False
    d = query.dim()
    return d in (3, 4) and key.dim() == d and value.dim() == d and query.shape[:-2] == key.shape[:-2] \
        == value.shape[:-2] and key.shape[-1] == query.shape[-1] and value.shape[-2] == key.shape[-2]


def _sdpa_eval(query, key, value, attn_mask, dropout_p, is_causal, factor, sq, pq, who) -> torch.Tensor:
    """:func:`_sdpa_reference`'s result without autograd, bit for bit, in fewer passes.

    * The products: ``torch.matmul`` of 4-d operands is ``bmm`` of their 3-d reshapes, a
      copy where the two batch dims do not merge (Hugging Face's q, k, v are views of
      ``(B, L, H, D)``).  The same ``bmm`` runs here on the same operands, the copies
      written into reused buffers (:class:`_Workspace`), the scores too; the scale and
      the masks are applied in place.  (``bmm`` on each 3-d slice of the views, no copy at
      all, is not the same: MKL's result for a transposed ``k`` differs in the last bit for
      some small shapes.)
    * The masks: with a bool mask (or none), no causal mask, no dropout and a ``scores``
      quantizer that quantizes entry by entry (:func:`_kept_elementwise`), the masked
      positions are the mask's (checked: no score at or below ``finfo.min / 2``, no NaN).
      The quantized scores then take ``-inf`` there in one in-place ``minimum`` with a
      ``±inf`` bound (the reference's ``where(masked, x, q(x))`` gives the masked ``x``,
      ``-inf``), and the fully masked rows are the mask's (:func:`_softmax_bool_mask`).
      Otherwise :func:`quantized_softmax` runs as in the reference."""
    lead = query.shape[:-2]
    length, s_len, d_v = query.shape[-2], key.shape[-2], value.shape[-1]
    shape = (*lead, length, s_len)
    try:
        if attn_mask is not None and torch.broadcast_shapes(attn_mask.shape, shape) != shape:
            raise RuntimeError("the mask widens the scores")
    except RuntimeError:
        return _sdpa_reference(query, key, value, attn_mask, dropout_p, is_causal, factor, sq, pq, who)
    ws = _WS.get()
    bh = math.prod(lead)
    scores = ws.buffer("scores", shape)
    torch.bmm(ws.batched("q", query), ws.batched("k", key.transpose(-2, -1)), out=scores.view(bh, length, s_len))
    scores.mul_(factor)
    bool_mask = attn_mask is None or attn_mask.dtype == torch.bool
    if not is_causal and dropout_p == 0.0 and bool_mask and _kept_elementwise(sq, scores) and _none_below(scores):
        probs = _softmax_bool_mask(scores, attn_mask, sq, pq, ws)
    else:
        if is_causal:
            causal = torch.ones(length, s_len, dtype=torch.bool, device=scores.device).tril()
            scores.masked_fill_(causal.logical_not(), float("-inf"))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores.masked_fill_(attn_mask.logical_not(), float("-inf"))
            else:
                scores = scores + attn_mask  # (a float64 mask promotes, as in the reference)
        probs = quantized_softmax(scores, -1, sq, pq, who)
        if dropout_p > 0.0:
            probs = F.dropout(probs, p=dropout_p)
    return torch.bmm(probs.reshape(bh, length, s_len), ws.batched("v", value)).view(*lead, length, d_v)


def _kept_elementwise(sq: Any, scores: torch.Tensor) -> bool:
    """No ``scores`` quantizer, or one :func:`_quantize_kept` would apply to all of a masked
    tensor (per tensor, :func:`_elementwise`)."""
    return sq is None or (getattr(sq, "axis", None) is None and not getattr(sq, "group_size", None)
                          and _elementwise(sq, scores))


def _none_below(scores: torch.Tensor) -> bool:
    """No entry at or below ``finfo.min / 2`` and no NaN (a NaN min compares False)."""
    return bool(scores.numel() == 0 or scores.amin() > torch.finfo(scores.dtype).min / 2)


def _softmax_bool_mask(scores, attn_mask, sq, pq, ws) -> torch.Tensor:
    """:func:`quantized_softmax` of ``scores`` masked by ``attn_mask`` (bool, True = attend,
    or None) when the masked positions are exactly the mask's (see :func:`_sdpa_eval`)."""
    x = sq(scores) if sq is not None else scores
    rows = None
    if attn_mask is not None:
        if x is not scores and x.numel() and torch.isnan(x.amax()):
            # a NaN quantized score (a zero or infinite scale): minimum would not keep its bits
            x = torch.where(attn_mask, x, float("-inf"))
        else:
            torch.minimum(x, torch.where(attn_mask, float("inf"), float("-inf")), out=x)
        # a row is fully masked iff its mask row is all False
        rows = attn_mask.logical_not().all(-1, keepdim=True)
        if not _any(rows):
            rows = None
    # the probabilities go to a workspace buffer unless an observer is to see them
    observed = pq is not None and getattr(pq, "observing", True)
    p = torch.softmax(x, -1) if observed else torch.softmax(x, -1, out=ws.buffer("probs", x.shape))
    if rows is not None:
        p.masked_fill_(rows, 0.0)
    p = pq(p) if pq is not None else p
    if sq is not None and pq is not None and grid_of(sq) is not None and grid_of(pq) is not None:
        keep = (attn_mask if attn_mask is not None else torch.ones((), dtype=torch.bool)).expand(x.shape)
        p = simulated_probs(x, keep, p, sq, pq)
    return p


class _Workspace:
    """Per-thread buffers of :func:`_sdpa_eval` that no result leaves in, one per name,
    reallocated when the shape changes; above ``MAX_NUMEL`` floats a fresh tensor each call
    (long sequences: the buffer would stay allocated, the allocation is cheap next to the
    products)."""

    MAX_NUMEL = 1 << 21

    def __init__(self) -> None:
        self.bufs: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, shape: tuple) -> torch.Tensor:
        if math.prod(shape) > self.MAX_NUMEL:
            return torch.empty(shape, dtype=torch.float32)
        t = self.bufs.get(name)
        if t is None or t.shape != shape:
            t = self.bufs[name] = torch.empty(shape, dtype=torch.float32)
        return t

    def batched(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x.reshape(-1, *x.shape[-2:])`` as ``torch.matmul`` hands it to ``bmm``: a view
        where the leading dims merge, else a contiguous copy (written into a buffer here)."""
        try:
            return x.view(-1, *x.shape[-2:])
        except RuntimeError:
            buf = self.buffer(name, tuple(x.shape))
            buf.copy_(x)
            return buf.view(-1, *x.shape[-2:])


class _ThreadWorkspace(threading.local):
    def get(self) -> _Workspace:
        ws = getattr(self, "ws", None)
        if ws is None:
            ws = self.ws = _Workspace()
        return ws


_WS = _ThreadWorkspace()


def _softmax_call(func, args, kwargs) -> tuple[torch.Tensor, int, torch.dtype | None]:
    """The input, dim and dtype of a call of one of ``SOFTMAX_FUNCTIONS``."""
    names = ("input", "dim", "_stacklevel", "dtype") if func is F.softmax else ("input", "dim", "dtype")
    call = dict(zip(names, args))
    call.update(kwargs)
    x = call.get("input", call.get("self"))
    dim = call.get("dim")
    if dim is None:  # F.softmax's legacy implicit dim
        dim = 0 if x.dim() in (0, 1, 3) else 1
    return x, int(dim), call.get("dtype")


class _Mode(TorchFunctionMode):
    """The one mode: ``stack`` holds the active :class:`SoftmaxRoles`, innermost last."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[SoftmaxRoles] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.stack and (func in SOFTMAX_FUNCTIONS or func is F.scaled_dot_product_attention):
            roles = self.stack[-1]
            who = roles.fqn or "<model>"
            if func is F.scaled_dot_product_attention:
                return _sdpa(*args, **kwargs, sq=roles.sq, pq=roles.pq, who=who)
            x, dim, dtype = _softmax_call(func, args, kwargs)
            return quantized_softmax(x, dim, roles.sq, roles.pq, who, dtype)
        return func(*args, **kwargs)


_MODE = _Mode()


class SoftmaxRoles:
    """The hook pair of one module whose ``scores``/``probs`` quantizers (``sq``/``pq``,
    either None) act inside its forward; see the module docstring."""

    def __init__(self, fqn: str, sq: Any, pq: Any):
        self.fqn, self.sq, self.pq = fqn, sq, pq

    def install(self, module: torch.nn.Module) -> list[Any]:
        """Register the pair on ``module``; returns the hook handles."""
        return [module.register_forward_pre_hook(self._enter),
                module.register_forward_hook(self._leave, always_call=True)]

    def _enter(self, module, args):
        if not _MODE.stack:
            _MODE.__enter__()
        _MODE.stack.append(self)

    def _leave(self, module, args, output):
        # always_call: an exception in the forward still takes the module off the stack
        if _MODE.stack and _MODE.stack[-1] is self:
            _MODE.stack.pop()
            if not _MODE.stack:
                _MODE.__exit__(None, None, None)
        return None


class TracingRoles(TorchFunctionMode):
    """Export's counterpart (used by :class:`qdsl.patch.trace.MarkingTracer`): while a module
    with the roles is traced, a softmax of a traced value gets the ``scores`` marker on its
    input and the ``probs`` marker on its result (``mark(value, fqn, role)`` makes the node),
    and ``F.scaled_dot_product_attention`` is traced as its decomposition with the same
    markers.  Calls on real tensors (the example values the tracer computes) pass through."""

    def __init__(self, mark: Any) -> None:
        super().__init__()
        self.mark = mark
        self.stack: list[tuple[str, bool, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.stack and (func in SOFTMAX_FUNCTIONS or func is F.scaled_dot_product_attention) \
                and any(isinstance(a, torch.fx.Proxy) for a in args):
            fqn, s, p = self.stack[-1]
            if func is F.scaled_dot_product_attention:
                return self._sdpa(fqn, s, p, *args, **kwargs)
            x, dim, _dtype = _softmax_call(func, args, kwargs)  # dtype: the traced values are float32
            return self._softmax(fqn, s, p, x, dim)
        return func(*args, **kwargs)

    def _softmax(self, fqn: str, s: bool, p: bool, x: Any, dim: int) -> Any:
        if s:
            x = self.mark(x, fqn, "scores")
        y = F.softmax(x, dim)
        return self.mark(y, fqn, "probs") if p else y

    def _sdpa(self, fqn, s, p, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        if is_causal or enable_gqa:
            raise QdslError(f"'{fqn or '<model>'}': scaled_dot_product_attention with "
                            f"{'is_causal' if is_causal else 'enable_gqa'} has no integer lowering")
        factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        scores = torch.matmul(query, key.transpose(-2, -1)) * factor
        if attn_mask is not None:
            # a mask expression (qdsl.export.lower_mask) or refused there; sdpa's bool mask
            # (True = attend) as its additive form (the dtype check needs the example trace)
            if attn_mask.dtype == torch.bool:
                attn_mask = torch.where(attn_mask, 0.0, float("-inf"))
            scores = scores + attn_mask
        return torch.matmul(self._softmax(fqn, s, p, scores, -1), value)

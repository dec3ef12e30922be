"""The patch of one ``nn.MultiheadAttention``.

``F.multi_head_attention_forward`` reads the fused ``in_proj_weight`` and computes the
projections, the scores, the softmax and the head mixing inside one function, where no
hook reaches; an :class:`AttentionPatch` does what :class:`~qdsl.patch.recurrent.RecurrentPatch`
does for recurrent layers:

* its forward **pre-hook** computes the module's result with :func:`attention` (the same
  function as torch's, float-equal to it when no quantizer is set, with the quantizers in
  it), keeps it, and hands the module an empty batch (``N = 0``: free) so its own forward
  does no work; its forward **hook** (prepended) returns the kept result, with the
  ``output`` quantizer applied to the attention output.  No class is replaced, no
  ``forward`` rebound, the parameters stay where they are; ``remove()`` only removes the
  two hooks.
* ``out_proj`` is called as a module on the heads' concatenation, so it is an ordinary
  patched Linear (its own ``weight``/``bias``/``input`` quantizers; its ``input`` quantizes
  ``probs·v``, the graph's second MATMUL result).
* proxies (keys in ``model._qdsl.quantizers``): ``<fqn>:weight_q``, ``:weight_k``,
  ``:weight_v`` (the rows of ``in_proj_weight`` for q, k, v: ``granularity = channel`` is
  per row), ``:bias_q``/``_k``/``_v`` (a derived ``input*weight`` bias at
  ``s_input · s_weight``), ``:input`` (query, key and value: one scale for the three; a
  self-attention call, where they are one tensor, quantizes it once), ``:q``, ``:k``, ``:v`` (the
  projections), ``:scores`` (``q·kᵀ/sqrt(head_dim)``, before the mask), ``:probs``
  (the softmax, before dropout), ``:output``.

Masks: ``attn_mask`` (2-D or 3-D) and ``key_padding_mask``, bool (True = masked) or float
(added), are applied to the quantized scores; ``is_causal`` needs the ``attn_mask`` (as in
torch).  A fully masked row gets probability 0 at every position (torch: NaN), the value
the graph's SOFTMAX_MASKED gives it.  Dropout on the probabilities in training.  Refused at apply (E511): ``kdim``/``vdim``
other than ``embed_dim`` (separate q/k/v weights), ``add_bias_kv``, ``add_zero_attn``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from qdsl.patch.computed import ComputedPatch
from qdsl.patch.int_sim import grid_of, simulated_probs
from qdsl.patch.layer import proxy_state_key
from qdsl.resolve.plan import LayerPlan
from qdsl.spec.diagnostics import QdslError
from qdsl.spec.model import Role

__all__ = ["AttentionPatch", "is_attention", "unsupported_attention", "attention", "SLICES", "ACT_ROLES"]

SLICES = ("q", "k", "v")
"""The row blocks of ``in_proj_weight``/``in_proj_bias``, in torch's order."""

ACT_ROLES = (Role.Q, Role.K, Role.V, Role.SCORES, Role.PROBS)
"""The internal activations an :class:`AttentionPatch` quantizes."""


def is_attention(module: nn.Module) -> bool:
    """A torch attention layer qdsl patches with :class:`AttentionPatch`."""
    return isinstance(module, nn.MultiheadAttention)


def unsupported_attention(m: nn.MultiheadAttention) -> str | None:
    """Why qdsl cannot patch this MultiheadAttention, or None."""
    if not m._qkv_same_embed_dim:
        return (f"kdim={m.kdim}, vdim={m.vdim} differ from embed_dim={m.embed_dim} (separate q/k/v "
                "projection weights): qdsl quantizes the fused in_proj_weight only")
    if m.bias_k is not None:
        return "add_bias_kv=True (learned key/value rows appended to the sequence) has no role in qdsl"
    if m.add_zero_attn:
        return "add_zero_attn=True is not supported by qdsl"
    return None


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask (True = masked) as an additive ``-inf``/0 float mask; a float mask as is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def attention(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, heads: int,
              proj: Callable[[str, torch.Tensor], torch.Tensor], act: Callable[[Role, torch.Tensor], torch.Tensor],
              out_proj: Callable[[torch.Tensor], torch.Tensor], *, attn_mask: torch.Tensor | None = None,
              key_padding_mask: torch.Tensor | None = None, dropout: float = 0.0, training: bool = False,
              need_weights: bool = True, average_attn_weights: bool = True,
              sim: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, Any]:
    """Multi-head attention of batch-first ``(N, L, E)`` query and ``(N, S, E)`` key/value,
    torch's formula: ``proj(s, x)`` is the ``s`` in {q, k, v} projection, ``act(role, t)``
    the quantizer of an internal activation, ``out_proj`` the output projection.
    ``sim(scores, probs)``: the probabilities the integer graph computes from the
    quantized scores over the kept (not ``-inf``) positions (qdsl.patch.int_sim), or None
    for the float ones.
    Returns ``(output (N, L, E), weights (N, L, S) averaged or (N, H, L, S), or None)``."""
    n, length, e = xq.shape
    s_len = xk.shape[1]
    hd = e // heads
    q = act(Role.Q, proj("q", xq))
    k = act(Role.K, proj("k", xk))
    v = act(Role.V, proj("v", xv))
    # (N, L, E) -> (N, H, L, hd): the head split the graph lowers as RESHAPE + operand permutation
    q = q.reshape(n, length, heads, hd).transpose(1, 2)
    k = k.reshape(n, s_len, heads, hd).transpose(1, 2)
    v = v.reshape(n, s_len, heads, hd).transpose(1, 2)
    scores = act(Role.SCORES, torch.matmul(q, k.transpose(-2, -1)) * math.sqrt(1.0 / hd))
    add = _mask(attn_mask, scores.dtype)
    if add is not None:
        add = add.reshape(n, heads, length, s_len) if add.dim() == 3 else add
        scores = scores + add
    kpm = _mask(key_padding_mask, scores.dtype)
    if kpm is not None:
        scores = scores + kpm.reshape(n, 1, 1, s_len)
    probs = torch.softmax(scores, dim=-1)
    if add is not None or kpm is not None:
        # a fully masked row (float softmax: NaN) gets probability 0 everywhere, as the
        # graph's SOFTMAX_MASKED gives it (docs/qgraph.md §4.4)
        probs = probs.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
    probs = act(Role.PROBS, probs)
    if sim is not None:
        probs = sim(scores, probs)
    if training and dropout > 0.0:
        probs = F.dropout(probs, p=dropout)
    ctx = torch.matmul(probs, v).transpose(1, 2).reshape(n, length, e)
    out = out_proj(ctx)
    if not need_weights:
        return out, None
    return out, (probs.mean(dim=1) if average_attn_weights else probs)


class AttentionPatch(ComputedPatch):
    """See the module docstring."""

    def __init__(self, handle, plan: LayerPlan, module: nn.MultiheadAttention, make: Callable[[Role, str], Any]):
        # the tracer treats the module as a leaf and export lowers it (qdsl.export.lower_mha)
        super().__init__(handle, plan, module)
        proxy = functools.partial(self._proxy, make)
        has_bias = module.in_proj_bias is not None
        self.w = {s: proxy(Role.WEIGHT, f"_{s}") for s in SLICES}
        self.b = {s: proxy(Role.BIAS, f"_{s}") if has_bias else None for s in SLICES}
        self.iq_all = proxy(Role.INPUT, "")
        self.acts = {r: proxy(r, "") for r in ACT_ROLES}
        self.out = proxy(Role.OUTPUT, "")
        self._wcache: tuple | None = None  # (key, tensors the key names, {slice: (w, b)})
        self._key_refs: list = []

    # ----------------------------------------------------- LayerPatch's interface
    def param_proxies(self) -> list[Any]:
        return [self.w[s] for s in SLICES] + [self.b[s] for s in SLICES]

    def rows(self, name: str, s: str) -> torch.Tensor | None:
        """The ``s`` slice of ``in_proj_weight``/``in_proj_bias`` (``name``: weight, bias)."""
        t = self.master(f"in_proj_{name}")
        if t is None:
            return None
        e = int(self.module.embed_dim)
        i = SLICES.index(s)
        return t[i * e:(i + 1) * e]

    def freeze(self) -> None:
        """Activations first, then weights, then biases (a derived scale needs both)."""
        for q in [self.iq_all, *self.acts.values(), self.out]:
            if q is not None and not q.frozen:
                q.freeze()
        with torch.no_grad():
            for s in SLICES:
                wq, bq, xq = self.w[s], self.b[s], self.iq_all
                if wq is not None and not wq.frozen:
                    wq.freeze(self.rows("weight", s))
                if bq is None or bq.frozen:
                    continue
                if bq.derived:
                    if xq is None or wq is None or xq.dynamic:
                        continue
                    bq.set_derived_scale(xq.scale * wq.scale)
                bq.freeze(self.rows("bias", s))

    def refresh_now(self) -> None:
        self._wcache = None  # the next forward fake-quantizes the weights again

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_wcache"], state["_key_refs"] = None, []  # names this model's tensors by id()
        return state

    # ------------------------------------------------------------------ forward
    def _all_params(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Every slice's (fake-quantized) weight and bias (a forward takes them once: the
        cache key is one walk over nine proxies' state)."""
        key = self._cache_key()
        if key is None:
            return {t: self._quantized_rows(t) for t in SLICES}
        hit = self._wcache
        if hit is None or hit[0] != key:
            rows = {t: self._quantized_rows(t) for t in SLICES}
            # before freeze the proxies re-observed just now: the key of the state these
            # weights were computed with is the one after the calls (as LayerPatch.refresh)
            key = self._cache_key()
            hit = self._wcache = (key, self._key_refs, rows)
        return hit[2]

    def _cache_key(self) -> tuple | None:
        """The fake-quantized q/k/v weights and biases are reused while nothing they depend
        on changes: evaluation (no autograd through ``in_proj_*``), before freeze as after,
        as :class:`~qdsl.patch.layer.LayerPatch` caches a layer's weights (same key: the
        handle's generation, the masters' identity/version/dtype, every buffer and parameter
        of the weight, bias and input proxies).  None: not cacheable (a compiled region,
        autograd through the masters, or a derived bias following a dynamic input's scale)."""
        if torch.compiler.is_compiling():
            return None
        masters = [self.master("in_proj_weight"), self.master("in_proj_bias")]
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in masters):
            return None
        xq = self.iq_all
        if xq is not None and xq.dynamic and any(b is not None and b.derived for b in self.b.values()):
            return None
        # the input proxy only matters through a derived (input*weight) bias scale
        derived = xq is not None and any(b is not None and b.derived for b in self.b.values())
        key, self._key_refs = proxy_state_key([*self.w.values(), *self.b.values(), xq if derived else None])
        key.append(self.handle.generation)
        for t in masters:
            key += [id(t), t._version, t.dtype] if t is not None else [None]
        return tuple(key)

    def _quantized_rows(self, s: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        w, b = self.rows("weight", s), self.rows("bias", s)
        wq, bq, xq = self.w[s], self.b[s], self.iq_all
        if wq is not None:
            w = wq(w)
        if bq is not None and b is not None:
            if bq.derived and not bq.frozen:
                s_x = xq.current_scale() if xq is not None else None
                s_w = wq.current_scale() if wq is not None else None
                bq.set_derived_scale(None if s_x is None or s_w is None else s_x.detach() * s_w.detach())
            b = bq(b)
        return w, b

    def _sim(self, scores: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        sq, pq = self.acts[Role.SCORES], self.acts[Role.PROBS]
        if grid_of(sq) is None or grid_of(pq) is None:
            return probs  # no fixed grids (before freeze): nothing to simulate, no mask to find
        return simulated_probs(scores, ~torch.isneginf(scores), probs, sq, pq)

    def _act(self, role: Role, t: torch.Tensor) -> torch.Tensor:
        q = self.acts[role]
        return t if q is None else q(t)

    def _forward(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal):
        m = self.module
        if is_causal and attn_mask is None:
            raise QdslError(f"'{self.fqn or '<model>'}' (MultiheadAttention) was called with is_causal=True and no "
                            "attn_mask: pass the causal mask as attn_mask (torch needs it too)")
        unbatched = query.dim() == 2
        # one tensor for query/key/value is quantized once (self-attention)
        iq = self.iq_all or _identity
        xq = iq(query)
        xk = xq if key is query else iq(key)
        xv = xq if value is query else xk if value is key else iq(value)

        def batch_first(t: torch.Tensor) -> torch.Tensor:
            return t.unsqueeze(0) if unbatched else (t if m.batch_first else t.transpose(0, 1))
        if unbatched and key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
        params = self._all_params()

        def proj(s: str, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, *params[s])
        out, weights = attention(
            batch_first(xq), batch_first(xk), batch_first(xv), int(m.num_heads), proj, self._act, m.out_proj,
            attn_mask=attn_mask, key_padding_mask=key_padding_mask, dropout=float(m.dropout), training=m.training,
            need_weights=need_weights, average_attn_weights=average_attn_weights, sim=self._sim)
        if self.out is not None:
            out = self.out(out)
        if unbatched:
            out = out[0]
            weights = weights[0] if weights is not None else None
        elif not m.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _pre(self, module, args, kwargs):
        names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
                 "is_causal")
        defaults = (None, None, None, None, True, None, True, False)
        call = dict(zip(names, defaults))
        call.update(zip(names, args))
        call.update({k: v for k, v in kwargs.items() if k in call})
        q = call["query"]
        if not isinstance(q, torch.Tensor) or not isinstance(call["key"], torch.Tensor) \
                or not isinstance(call["value"], torch.Tensor):
            raise QdslError(f"'{self.fqn or '<model>'}' (MultiheadAttention) was called without query/key/value tensors")
        self._stash.append(self._forward(**call))
        # the module's own forward runs on an empty batch (no work); _post returns ours
        e = q.shape[-1]
        empty = q.new_zeros((0, 1, e) if module.batch_first else (1, 0, e))
        return (empty, empty, empty), {"need_weights": False}


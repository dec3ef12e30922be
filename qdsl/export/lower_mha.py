"""Lowering of a patched ``nn.MultiheadAttention`` (:class:`qdsl.patch.attention.AttentionPatch`).

The graph it writes is the patch's fake-quant forward, op for op::

    x ─QUANTIZE/REQUANTIZE (:input)─┬─ LINEAR in_proj_q (:q) ─ RESHAPE (N, L, H, d) ─┐
                                    ├─ LINEAR in_proj_k (:k) ─ RESHAPE ──────────────┴ MATMUL ÷sqrt(d) (:scores)
                                    └─ LINEAR in_proj_v (:v) ─ RESHAPE ─┐                 │
                                                                        │            SOFTMAX (:probs)
                                                                        └─────────── MATMUL (out_proj:input)
                                                                                          │
                                                      RESHAPE (N, L, E) ─ LINEAR out_proj (─ :output)

Each in-projection is a LINEAR over the rows of ``in_proj_weight`` of its slice, with the
slice's own weight and bias quantizers (their codes, exactly as the fake-quant model
uses them); the head split is a RESHAPE and an operand permutation of the MATMUL
(``(0, 2, 1, 3)`` for q and v, ``(0, 2, 3, 1)`` for kᵀ); the heads' merge is the second
MATMUL's output permutation and a RESHAPE.  The ``1/sqrt(head_dim)`` factor is folded
into the first MATMUL's requantization.

Refused with the module named: ``batch_first=False`` (the graph is batch first), a call
with ``attn_mask``/``key_padding_mask``/``is_causal`` (masks need graph inputs besides the
one the graph has), an internal activation without a quantizer, an attention-weights
result that is read (``need_weights``).  Cross-attention (key/value other values computed
from the one graph input, e.g. a memory) quantizes each with the ``input`` quantizer.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from qdsl.export.lower_attn import matmul_pending, softmax_pending
from qdsl.export.lower_layers import act_target, layer_pending
from qdsl.export.rules import reshape
from qdsl.export.values import ExportError, FloatVal, QVal
from qdsl.patch.attention import SLICES
from qdsl.spec.model import Role

__all__ = ["lower_attention", "SliceRecord"]


@attrs.define
class SliceRecord:
    """One q/k/v slice of ``in_proj`` as the layer patch :func:`layer_pending` reads."""

    fqn: str
    wq: Any
    bq: Any
    iq: Any
    plan: Any
    weight: Any
    bias: Any
    oq: Any = None
    bn_fqn: str | None = None

    def float_params(self):
        return self.weight, self.bias

    def master(self, name: str):
        return self.weight if name == "weight" else self.bias

    def _cacheable(self, w, b) -> None:
        return None


_MASK_KWARGS = ("attn_mask", "key_padding_mask", "is_causal")


def _target(lw, fqn: str, proxy, role: str):
    if proxy is None:
        raise ExportError(fqn, f"the attention's {role} is not quantized, so the integer graph cannot compute it",
                          f"quantize it: `{role} = a8` (or `input = a8`, which sets it) in a rule for '{fqn}'")
    return act_target(proxy, f"{fqn}:{role}")


def lower_attention(lw, node, m, args, kwargs) -> tuple[Any, Any]:
    """``(output, weights)`` of the MultiheadAttention call ``node`` (see the module doc)."""
    fqn = node.target
    patch = lw.handle.layers.get(fqn)
    if patch is None:
        raise ExportError(fqn, "MultiheadAttention is left in float, so it cannot be part of the integer graph",
                          "quantize it in the spec (its weight, input, q, k, v, scores and probs)")
    if not m.batch_first:
        raise ExportError(fqn, "a MultiheadAttention with batch_first=False has no integer lowering (the graph's "
                               "first axis is the batch)", "build it with batch_first=True")
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
    call = dict(zip(names, args))
    call.update(kwargs)
    masked = [k for k in _MASK_KWARGS if call.get(k) not in (None, False)]
    if masked:
        raise ExportError(fqn, f"a MultiheadAttention call with {', '.join(masked)} has no integer lowering yet "
                               "(a mask is a second graph input; the graph takes one)",
                          "export the model without masks, or run the masked call in the fake-quant model")
    # query, key and value: one input quantizer; one tensor (self-attention) is quantized once
    nodes = [node.args[i] if i < len(node.args) else node.kwargs.get(n) for i, n in enumerate(names[:3])]
    xs: list[QVal] = []
    for i, n in enumerate(names[:3]):
        same = next((j for j in range(i) if nodes[j] is nodes[i]), None)
        if same is not None:
            xs.append(xs[same])
            continue
        x = lw.quantize(call.get(n), fqn, "input") if patch.iq_all is not None else call.get(n)
        if not isinstance(x, QVal):
            raise ExportError(fqn, f"the attention's {n} is not quantized", f"add `input = a8` for '{fqn}' in the spec")
        if len(x.shape) != 3:
            raise ExportError(fqn, f"a MultiheadAttention on a rank-{len(x.shape)} {n} has no integer lowering",
                              "give it batched (N, L, E) inputs")
        xs.append(x)
    inputs = dict(zip(SLICES, xs))
    _, length, e = xs[0].shape
    s_len = xs[1].shape[1]
    heads = int(m.num_heads)
    hd = e // heads
    proj: dict[str, QVal] = {}
    for s in SLICES:
        where = f"{fqn}.in_proj_{s}"
        if patch.w[s] is None:
            raise ExportError(fqn, "the in_proj weight is left in float, so the projections cannot be integer LINEARs",
                              f"quantize it: `weight = w8` in a rule for '{fqn}'")
        rec = SliceRecord(where, patch.w[s], patch.b[s], patch.iq_all, patch.plan,
                          patch.rows("weight", s).detach(), None if patch.b[s] is None and patch.rows("bias", s) is None
                          else patch.rows("bias", s).detach())
        n = length if s == "q" else s_len
        pend = layer_pending(lw.b, where, m, rec, inputs[s], (-1, n, e))
        role = Role(s)
        v = pend.materialize(lw.b, _target(lw, fqn, patch.acts[role], role.value))
        proj[s] = reshape(lw, v, (-1, n, heads, hd), where)
    scores = matmul_pending(f"{fqn}.scores", proj["q"], (0, 2, 1, 3), proj["k"], (0, 2, 3, 1),
                            factor=math.sqrt(1.0 / hd))
    scores = scores.materialize(lw.b, _target(lw, fqn, patch.acts[Role.SCORES], "scores"))
    probs = softmax_pending(f"{fqn}.softmax", scores, -1, scores.shape)
    probs = probs.materialize(lw.b, _target(lw, fqn, patch.acts[Role.PROBS], "probs"))
    ctx = matmul_pending(f"{fqn}.context", probs, (0, 1, 2, 3), proj["v"], (0, 2, 1, 3), out_perm=(0, 2, 1, 3))
    op_fqn = f"{fqn}.out_proj"
    op_patch = lw.handle.layers.get(op_fqn)
    if op_patch is None or op_patch.wq is None or lw.handle.quantizer(op_fqn, "input") is None:
        raise ExportError(op_fqn, "out_proj is left in float or its input is not quantized",
                          f"quantize '{op_fqn}' (weight and input) in the spec")
    ctx = lw.quantize(ctx, op_fqn, "input")
    ctx = reshape(lw, ctx, (-1, length, e), op_fqn)
    out: Any = layer_pending(lw.b, op_fqn, m.out_proj, op_patch, ctx, (-1, length, e))
    if patch.out is not None:
        out = lw.quantize(out, fqn, "output")
    weights = FloatVal(fqn, (-1, length, s_len))  # read only through an error naming the module
    return out, weights

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

Masks make the SOFTMAX a SOFTMAX_MASKED (:mod:`qdsl.graph.ops.softmax_masked`) reading them
as they are: a ``key_padding_mask`` ``(N, S)`` graph input (bool: an I32 input of 0/1, True
= masked; float: an F32 input, 0 or -inf) broadcast over heads and queries; an
``attn_mask`` ``(L, S)`` or ``(N·H, L, S)``, a graph input (declared with its static shape:
its first dim is not the batch, so a 3-D one fixes the batch of the example) or a constant
(a buffer: bool, or float 0/-inf, becomes an I32 constant).  ``is_causal`` is a hint about
``attn_mask``, which the graph reads.  A float constant mask with other values is refused
here, a float graph input's at run time (both naming the module and the op).

``batch_first=False``: the graph's first axis is the batch and no op moves it, so the
query/key/value must be batch-first values read through ``transpose(0, 1)``
(:class:`~qdsl.export.lower_attn.SeqFirst`); the result is one too (lower.py runs the
last-axis and elementwise ops of a seq-first block on the batch-first values).

Refused with the module named: a seq-first call on a batch-first value, a mask computed
inside the model, an internal activation without a quantizer, an attention-weights result
that is read (``need_weights``).  Cross-attention (key/value other values computed from the
one graph input, e.g. a memory) quantizes each with the ``input`` quantizer.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import torch

from qdsl.export.lower_attn import MaskInput, SeqFirst, matmul_pending, softmax_pending
from qdsl.export.lower_layers import act_target, layer_pending
from qdsl.export.rules import reshape
from qdsl.export.values import ExportError, FloatVal, IdsVal, QVal
from qdsl.graph.ir import DType
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


def _arg_node(node, i: int, name: str):
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def _constant(lw, target: str) -> torch.Tensor:
    obj: Any = lw.model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _mask(lw, fqn: str, node, value: Any, which: str, heads: int, n_len: int, s_len: int) -> MaskInput:
    """The SOFTMAX_MASKED input for the call's ``which`` mask (see the module doc)."""
    where = f"{fqn}.softmax"
    if isinstance(value, str):  # a constant the model holds (lower.py passes its attribute path)
        t = _constant(lw, value).detach().cpu()
        shape = tuple(t.shape)
        if t.is_floating_point():
            bad = ~((t == 0) | torch.isneginf(t))
            if bad.any():
                raise ExportError(fqn, f"the float {which} '{value}' holds {float(t[bad][0]):g}: SOFTMAX_MASKED "
                                       f"('{where}') reads additive masks of 0 (attend) and -inf (masked) only",
                                  "pass a bool mask (True = masked), or a float one of 0 and -inf")
            t = torch.isneginf(t)
        data = (t != 0).numpy().astype(np.int32)
        name = lw.b.tensor(f"{fqn}:{which}", DType.I32, shape, data)
    elif isinstance(value, (IdsVal, FloatVal)) and value.name is not None and value.name in lw.input_names:
        name = value.name
        shape = tuple(int(d) for d in node.meta["qdsl_shape"])
        if isinstance(value, IdsVal) and lw.input_dtypes.get(value.name) not in (torch.bool, None):
            raise ExportError(fqn, f"the {which} '{value.name}' is an integer tensor: MultiheadAttention reads bool "
                                   "(True = masked) or float masks", "pass a bool mask")
    else:
        origin = getattr(value, "origin", "?")
        raise ExportError(fqn, f"the {which} is computed inside the model (from '{origin}'), so the graph cannot "
                               "read it", "pass the mask to the model as an input (export(model, (x, mask))) or "
                                          "hold it as a buffer")
    if which == "key_padding_mask":
        if len(shape) != 2 or shape[1] != s_len:
            raise ExportError(fqn, f"a key_padding_mask of shape {shape} has no integer lowering "
                                   f"(batched (N, {s_len}))")
        return MaskInput(name, (0, -1, -1, 1), 0)
    if len(shape) == 2 and shape == (n_len, s_len):
        dims = (-1, -1, 0, 1)
    elif len(shape) == 3 and shape[1:] == (n_len, s_len) and shape[0] % heads == 0:
        dims = (0, 0, 1, 2)
    else:
        raise ExportError(fqn, f"an attn_mask of shape {shape} has no integer lowering ((L, S) or (N·H, L, S))")
    if name in lw.input_names:  # its first dim is not the batch
        lw.b.redeclare(name, shape)
    return MaskInput(name, dims, 0)


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
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
    call = dict(zip(names, args))
    call.update(kwargs)
    if not m.batch_first:
        # (L, N, E) operands: batch-first graph values read through transpose(0, 1) (SeqFirst)
        for n in names[:3]:
            if not isinstance(call.get(n), SeqFirst):
                raise ExportError(fqn, f"a MultiheadAttention with batch_first=False reads its {n} with the batch "
                                       "second, which the graph (batch first) holds only as a batch-first value "
                                       "transposed by transpose(0, 1)",
                                  "build it with batch_first=True, or feed it x.transpose(0, 1) of a batch-first x")
            call[n] = call[n].value
    if call.get("is_causal") and call.get("attn_mask") is None:
        raise ExportError(fqn, "is_causal=True needs the causal mask as attn_mask (torch needs it too)")
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
    masks = [_mask(lw, fqn, _arg_node(node, i, which), call[which], which, heads, length, s_len)
             for i, which in ((3, "key_padding_mask"), (5, "attn_mask")) if call.get(which) is not None]
    probs = softmax_pending(f"{fqn}.softmax", scores, -1, scores.shape, masks)
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
    return (out if m.batch_first else SeqFirst(out)), weights

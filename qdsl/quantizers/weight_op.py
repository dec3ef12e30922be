"""A BN-folded weight's QAT fake quantization as one opaque op under ``torch.compile``.

In the live-statistics QAT form of a folded layer (:mod:`qdsl.qat.bn_fold`) the layer's
weight is ``Q(W·f)/f`` with ``f = γ/sqrt(σ²_run + ε)``, and ``Q``'s scale is derived from
``W·f`` itself on every step (a range reduction per channel, then the scale rule).  Traced
as aten ops, inductor generated one C++ kernel per folded layer for this (the fold
multiply, the range reduction, the power-of-two scale, the fake quantization and its
mask) and more in the backward; its compile cost is per generated kernel (gcc, about a
second each), which made pot-asic's compile time 2.14x compiled float's.
``qdsl::fold_weight_fq`` computes all of it with the eager kernels in one extern call, and
its backward is one extern call too (``qdsl::fold_weight_fq_backward``), so inductor
generates nothing for the weight.

Guarantees:

* values equal the eager QAT path (``patch.wq(W·f)/f`` with the proxy's observer, scale
  rule and fused fake quantization) bit for bit: the same eager functions compute them;
* gradients to ``W`` and ``γ`` are the ones eager autograd computes for that expression
  (clipping-mask STE, no gradient through the scale; the same aten ops in the same
  order);
* used only while compiling, and only for what it covers (:func:`folded` returns None
  otherwise and the caller traces the general path): an affine int format with the
  built-in half-even rounding and a non-learned built-in scale rule (``float``, ``pot``,
  ``pot_ceil``), a ``minmax``/``ema`` observer or an exact ``mse`` observer carrying its
  clip ratio, the QAT gradient path installed (``prepare_qat``), float32, no PTQ offset
  or fixed codes, no group granularity;
* a training forward still counts in the ``mse`` observer's buffers (in place, traced).

No double backward (the backward op has no derivative).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from qdsl.quantizers import functional as F
from qdsl.quantizers import range_search as RS

__all__ = ["fold_weight_fq", "folded", "applies"]


def _range(x: Tensor, ratio: Optional[Tensor], qmin: int, qmax: int, symmetric: bool, search_pot: bool,
           axis: Optional[int]) -> tuple[Tensor, Tensor]:
    # the stateless observer's range of x alone (observers.*.traced_range, less the counting)
    from qdsl.quantizers.observers import Observer

    rows = F.reduce_view(x.detach().float(), axis, None)
    shape = F.param_shape(tuple(x.shape), axis, None)
    if ratio is None:  # minmax / ema: the tensor's own finite min and max
        lo, hi = Observer._finite_minmax(rows)
    else:  # mse carrying its searched clip ratio
        lo0, hi0 = RS.channel_minmax(rows, symmetric, qmin)
        lo, hi = RS.range_from_ratio(lo0, hi0, ratio, qmin, qmax, symmetric=symmetric, pot=search_pot)
    return lo.reshape(shape).float(), hi.reshape(shape).float()


def _qparams(lo: Tensor, hi: Tensor, qmin: int, qmax: int, symmetric: bool, pot: str) -> tuple[Tensor, Tensor]:
    # formats.int.IntOps.qparams with the built-in scale rules (qdsl.quantizers.scales)
    raw, zpf = RS.range_to_qparams(lo, hi, qmin, qmax, symmetric=symmetric)
    scale = F.pot_scale(raw, pot) if pot else raw.to(torch.float32)
    if not symmetric:
        zpf = torch.clamp(qmin - torch.round(torch.clamp(lo, max=0.0) / scale), qmin, qmax)
    return scale, zpf.to(torch.int32)


def _factor(gamma: Optional[Tensor], inv_std: Tensor) -> Tensor:
    # bn_fold.fold_factor, then _QatFold.refresh's guard against a zero γ
    f = inv_std if gamma is None else gamma * inv_std
    return torch.where(f == 0, torch.full_like(f, torch.finfo(f.dtype).tiny), f)


def _column(f: Tensor, w: Tensor) -> Tensor:
    return f.reshape(-1, *([1] * (w.dim() - 1)))


def _like(t: Tensor, ref: Tensor) -> Tensor:
    """``t`` with ``torch.empty_like(ref)``'s strides (what the fake implementations
    promise; the real ones may be handed any dense layout, ``flexible_layout``)."""
    if t.stride() == ref.stride():
        return t
    out = torch.empty_like(ref, dtype=t.dtype)
    out.copy_(t)
    return out


# flexible_layout: inductor hands the op the weight in the layout it has (a channels-last
# copy for the convolution) instead of copying it back, and uses the output as it comes
_TAGS = (torch.Tag.flexible_layout,)


@torch.library.custom_op("qdsl::fold_weight_fq", mutates_args=(), tags=_TAGS)
def fold_weight_fq(w: Tensor, gamma: Optional[Tensor], inv_std: Tensor, ratio: Optional[Tensor], qmin: int,
                   qmax: int, symmetric: bool, pot: str, search_pot: bool,
                   axis: Optional[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(Q(W·f)/f, scale, zero point, Q(W·f), clipping mask, f)`` for ``f = γ·inv_std``
    (a zero ``f`` taken as the smallest normal float): ``Q`` quantizes per ``axis`` (None:
    per tensor) on ``qmin..qmax`` with the range of ``W·f`` (its min/max, or ``ratio`` ×
    it with ``search_pot`` as the ``mse`` observer carries it) and the scale rule ``pot``
    (``""``: float, ``"round"``, ``"ceil"``)."""
    from qdsl.quantizers import ste

    f = _factor(gamma, inv_std)
    fr = _column(f, w)
    x = torch.mul(w, fr, out=torch.empty_like(w))
    lo, hi = _range(x, ratio, qmin, qmax, symmetric, search_pot, axis)
    scale, zp = _qparams(lo, hi, qmin, qmax, symmetric, pot)
    xhat, mask = ste.fused_fake_quant_mask(x, scale, None if symmetric else zp, qmin, qmax, axis)
    xhat, mask = _like(xhat, w), _like(mask, w)
    return torch.div(xhat, fr, out=torch.empty_like(w)), scale, zp, xhat, mask, f


@fold_weight_fq.register_fake
def _fake(w, gamma, inv_std, ratio, qmin, qmax, symmetric, pot, search_pot, axis):
    shape = F.param_shape(tuple(w.shape), axis, None)
    return (torch.empty_like(w), w.new_empty(shape), w.new_empty(shape, dtype=torch.int32), torch.empty_like(w),
            torch.empty_like(w, dtype=torch.bool), torch.empty_like(inv_std))


@torch.library.custom_op("qdsl::fold_weight_fq_backward", mutates_args=(), tags=_TAGS)
def fold_weight_fq_backward(g: Tensor, w: Tensor, gamma: Optional[Tensor], inv_std: Tensor, xhat: Tensor,
                            mask: Tensor, f: Tensor, per_tensor: bool) -> tuple[Tensor, Tensor]:
    """``(dL/dW, dL/dγ)`` of ``Q(W·f)/f`` as eager autograd computes them (``dL/dγ`` is
    empty without ``γ``)."""
    fr = _column(f, w)
    gx = g / fr  # DivBackward, to the numerator
    gfr = (-g * ((xhat / fr) / fr)).sum_to_size(fr.shape)  # DivBackward, to the denominator
    # the clipping-mask STE of ste.fake_quant's fused eager path (per tensor torch's kernel)
    gq = gx * mask if per_tensor else torch.where(mask, gx, gx.new_zeros(()))
    gw = torch.mul(gq, fr, out=torch.empty_like(w))  # MulBackward, to W
    gfr = gfr + (gq * w).sum_to_size(fr.shape)  # MulBackward, to f
    if gamma is None:
        return gw, g.new_empty(0)
    f0 = gamma * inv_std
    gf = torch.where(f0 == 0, gfr.new_zeros(()), gfr.reshape(f.shape))  # the zero-γ guard
    return gw, gf * inv_std


@fold_weight_fq_backward.register_fake
def _fake_backward(g, w, gamma, inv_std, xhat, mask, f, per_tensor):
    return torch.empty_like(w), (torch.empty_like(gamma) if gamma is not None else w.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    w, gamma, inv_std, _ratio, _qmin, _qmax, _sym, _pot, _spot, axis = inputs
    _out, scale, zp, xhat, mask, f = output
    ctx.per_tensor = axis is None
    ctx.has_gamma = gamma is not None
    ctx.save_for_backward(w, gamma, inv_std, xhat, mask, f)
    ctx.mark_non_differentiable(scale, zp, xhat, mask, f)


def _backward(ctx, g, *_unused):
    w, gamma, inv_std, xhat, mask, f = ctx.saved_tensors
    gw, gg = fold_weight_fq_backward(g, w, gamma if ctx.has_gamma else None, inv_std, xhat, mask, f,
                                     ctx.per_tensor)
    return gw, (gg if ctx.has_gamma else None), None, None, None, None, None, None, None, None


fold_weight_fq.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------- the proxy side
def _carried_ratio(q, n_slots: int):
    """``(ok, ratio)``: the observer's range as the op computes it (ratio None: min/max)."""
    from qdsl.quantizers import observers as O

    obs = q.observer
    if type(obs) in (O.MinMaxObserver, O.EmaObserver):
        return True, None
    if (type(obs) is O.MseObserver and obs._exact and not obs._search_requested
            and obs.clip_ratio.numel() == n_slots):
        return True, obs.clip_ratio
    return False, None


def applies(q, w: Tensor) -> bool:
    """Does ``q``'s training forward on ``W·f`` (``w``'s shape and dtype) equal what the op
    computes?  (The conditions, in the order ``TensorQuantizer.forward`` meets them.)"""
    from qdsl.quantizers import scales as S
    from qdsl.quantizers.formats.int import IntOps
    from qdsl.quantizers.proxy_grad import qat_grad_path

    if (q is None or not q.enabled or q.observing or q.frozen or not q.stateless or q.dynamic or q.derived
            or q.token or q.group_size is not None or q.sign_threshold is not None or q.learned):
        return False
    if w.dtype is not torch.float32 or q.offset.numel() or q.codes.numel():
        return False
    if type(q._ops) is not IntOps or q._round_fn is not None or q._round_mode != "half_even":
        return False
    if type(q.scale_rule) not in (S.FloatScale, S.PotScale, S.PotCeilScale) or q.grad_path is not qat_grad_path:
        return False
    if q.qmax - q.qmin >= 2**16 or (q.axis is not None and not -w.dim() <= q.axis < w.dim()):
        return False
    n = 1 if q.axis is None else w.shape[q.axis]
    return _carried_ratio(q, n)[0]


def folded(q, w: Tensor, bn) -> Optional[Tensor]:
    """``q(W·f)/f`` for the live-statistics fold of ``bn`` as one op (see the module
    docstring), or None where the op does not apply (trace the general path then)."""
    if not applies(q, w):
        return None
    from qdsl.qat.bn_fold import _inv_std
    from qdsl.quantizers import scales as S

    gamma = bn.weight
    training = torch.is_grad_enabled() and (w.requires_grad or (gamma is not None and gamma.requires_grad))
    axis = None if q.axis is None else q.axis % w.dim()
    _, ratio = _carried_ratio(q, 1 if axis is None else w.shape[axis])
    obs = q.observer
    if ratio is not None:
        obs.traced_count(training)
    rule = type(q.scale_rule)
    pot = "" if rule is S.FloatScale else q.scale_rule._mode
    search_pot = bool(getattr(obs.ctx, "pot", False))
    inv_std = _inv_std(bn.running_var, float(bn.eps)) if torch.compiler.is_compiling() else \
        torch.rsqrt(bn.running_var + bn.eps)
    out, scale, _zp, _xhat, _mask, _f = fold_weight_fq(w, gamma, inv_std, ratio, int(q.qmin), int(q.qmax),
                                                        bool(q.recipe.symmetric), pot, search_pot, axis)
    q._last_scale = scale
    return out

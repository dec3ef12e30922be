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

``qdsl::mx_weight_fq`` (below) does the same for a minifloat / MX weight quantizer (per-block
shared power-of-two scale, minifloat elements), BN-folded (:func:`folded` falls back to it)
or not (:func:`mx_plain`, called by ``TensorQuantizer`` for a weight in a compiled training
forward, e.g. a Linear head); the int cases above are unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from qdsl.quantizers import functional as F
from qdsl.quantizers import range_search as RS

__all__ = ["fold_weight_fq", "folded", "applies", "mx_weight_fq", "mx_applies", "mx_folded", "mx_plain"]


# The fold factor's inverse std is a custom op, opaque to the compiler, for one reason: a
# compiled training step must *save* it for backward.  Written with aten ops, AOTAutograd's
# partitioner recomputes ``rsqrt(running_var + eps)`` in the backward from the
# ``running_var`` buffer itself (buffers and parameters are "free to save": they outlive
# the step), but the BatchNorm updates that buffer in place later in the same forward, so
# the backward kept a tensor that changes before it runs (under inductor: autograd's
# "modified by an inplace operation" error; tests/qat/test_compile.py).  An op outside the partitioner's recompute
# allowlist is saved, never recomputed; the running statistics are a buffer with no
# gradient, so the op needs no backward.  Eager computes the same expression directly.
@torch.library.custom_op("qdsl::bn_inv_std", mutates_args=())
def bn_inv_std(running_var: Tensor, eps: float) -> Tensor:
    return torch.rsqrt(running_var + eps)


@bn_inv_std.register_fake
def _inv_std_fake(running_var: Tensor, eps: float) -> Tensor:
    return torch.empty_like(running_var)


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
        return mx_folded(q, w, bn)
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
    inv_std = bn_inv_std(bn.running_var, float(bn.eps)) if torch.compiler.is_compiling() else \
        torch.rsqrt(bn.running_var + bn.eps)
    out, scale, _zp, _xhat, _mask, _f = fold_weight_fq(w, gamma, inv_std, ratio, int(q.qmin), int(q.qmax),
                                                        bool(q.recipe.symmetric), pot, search_pot, axis)
    q._last_scale = scale
    return out



# ============================================================ minifloat / MX weights
# ``qdsl::mx_weight_fq``: the same for a minifloat weight quantizer (OCP MX: per-block
# power-of-two shared scale, minifloat elements; qdsl.quantizers.formats.minifloat), folded
# (``Q(W·f)/f``) or not (``Q(W)``, e.g. a Linear head).  Traced, its range, shared exponent,
# block-wise rounding and clipping mask were 3 forward and 1-2 backward inductor kernels per
# layer (mxfp4's compile time 2.0-2.2x compiled float's); as one extern op they are none.
#
# Values: the eager QAT expression bit for bit, computed by the same eager functions - the
# minmax observer's range of the weight's scale slots (Observer._minmax on
# functional.reduce_view), MinifloatOps._scale with the quantizer's scale rule, MinifloatOps.fake
# (x / s on the group-expanded scale, minifloat_round or the fp8 cast path), and
# FormatOps.qat_value's ``x̂ + (sur - sur)`` with ``sur = x·(|x| <= s·max_normal)`` (which
# turns a -0 into +0, as eager does).  Gradient: ``g·mask`` to ``x`` (MulBackward of
# ``x·mask``), then the fold's Div/Mul backward (qdsl::fold_weight_fq_backward's formulas).
# Used only while compiling a training forward with the QAT gradient path installed, for a
# minifloat format with half-even rounding, a minmax/ema observer (not mse: its search), a
# built-in non-learned scale rule (float, pot, pot_ceil, fp8_e4m3, fp8_e5m2), float32, no
# PTQ offset or fixed codes.
_RULES: dict = {}


def _rule_name(rule) -> Optional[str]:
    from qdsl.quantizers import scales as S
    from qdsl.quantizers.formats import minifloat as MF

    return {S.FloatScale: "float", S.PotScale: "pot", S.PotCeilScale: "pot_ceil",
            MF.E4M3Scale: "fp8_e4m3", MF.E5M2Scale: "fp8_e5m2"}.get(type(rule))


def _rule(name: str):
    rule = _RULES.get(name)
    if rule is None:
        from qdsl.quantizers import scales as S
        from qdsl.quantizers.formats import minifloat as MF

        cls = {"float": S.FloatScale, "pot": S.PotScale, "pot_ceil": S.PotCeilScale,
               "fp8_e4m3": MF.E4M3Scale, "fp8_e5m2": MF.E5M2Scale}[name]
        rule = _RULES[name] = cls(None)  # stateless modules: a function of the raw scale
    return rule


class _Slots:
    """What MinifloatOps' eager ``_scale``/``fake`` read of a quantizer (format, slots,
    half-even rounding)."""

    _round_mode, _round_fn, generator = "half_even", None, None

    def __init__(self, fmt, axis, group_size):
        self.format, self.axis, self.group_size = fmt, axis, group_size


def _mx_value(x: Tensor, fmt_name: str, group_size: Optional[int], axis: Optional[int],
              rule: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(x̂ + 0·surrogate, scale, clipping mask)`` of the eager QAT path (see above)."""
    from qdsl.quantizers.formats.minifloat import MinifloatOps
    from qdsl.quantizers.observers import Observer
    from qdsl.spec.formats import minifloat_format

    fmt = minifloat_format(fmt_name)
    q = _Slots(fmt, axis, group_size)
    x = x.detach()
    # the observer's range (reset, one observation: Observer._rows, MinMaxObserver.forward)
    lo, hi = Observer._minmax(F.reduce_view(x.float(), axis, group_size))
    shape = F.param_shape(tuple(x.shape), axis, group_size)
    lo, hi = lo.reshape(shape).float(), hi.reshape(shape).float()
    # MinifloatOps.qparams (x given, not compiling, no mse search)
    scale = MinifloatOps._scale(q, torch.maximum(-lo, hi), _rule(rule))
    # FormatOps.qat_value, a weight without a learned scale
    value = _MF_OPS.fake(q, x, scale, None, None)
    s_view = F.param_view(scale.to(x.dtype), x, axis, group_size)
    mask = x.abs() <= s_view * fmt.max_normal
    sur = x * mask
    return value + (sur - sur), scale, mask


class _LazyOps:
    def __getattr__(self, name):
        from qdsl.quantizers.formats.minifloat import MinifloatOps

        return getattr(MinifloatOps(), name)


_MF_OPS = _LazyOps()


@torch.library.custom_op("qdsl::mx_weight_fq", mutates_args=(), tags=_TAGS)
def mx_weight_fq(w: Tensor, gamma: Optional[Tensor], inv_std: Optional[Tensor], fmt: str,
                 group_size: Optional[int], axis: Optional[int],
                 rule: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(out, scale, numerator, clipping mask, f)``: without ``inv_std`` ``out = Q(W)``
    (numerator and ``f`` empty); with it ``out = Q(W·f)/f`` for ``f = γ·inv_std`` (a zero
    ``f`` taken as the smallest normal float), the numerator ``Q(W·f)``.  ``Q``: the minifloat
    ``fmt`` (its name) per ``group_size`` block of each flattened row (else per ``axis``,
    None: per tensor), its scale from the slot's finite max-abs by the scale ``rule``."""
    if inv_std is None:
        out, scale, mask = _mx_value(w, fmt, group_size, axis, rule)
        return _like(out, w), scale, w.new_empty(0), _like(mask, w), w.new_empty(0)
    f = _factor(gamma, inv_std)
    fr = _column(f, w)
    x = torch.mul(w, fr, out=torch.empty_like(w))
    xhat, scale, mask = _mx_value(x, fmt, group_size, axis, rule)
    xhat, mask = _like(xhat, w), _like(mask, w)
    return torch.div(xhat, fr, out=torch.empty_like(w)), scale, xhat, mask, f


@mx_weight_fq.register_fake
def _mx_fake(w, gamma, inv_std, fmt, group_size, axis, rule):
    shape = F.param_shape(tuple(w.shape), axis, group_size)
    folded_ = inv_std is not None
    return (torch.empty_like(w), w.new_empty(shape), torch.empty_like(w) if folded_ else w.new_empty(0),
            torch.empty_like(w, dtype=torch.bool), torch.empty_like(inv_std) if folded_ else w.new_empty(0))


@torch.library.custom_op("qdsl::mx_weight_fq_backward", mutates_args=(), tags=_TAGS)
def mx_weight_fq_backward(g: Tensor, w: Tensor, gamma: Optional[Tensor], inv_std: Optional[Tensor], xhat: Tensor,
                          mask: Tensor, f: Tensor) -> tuple[Tensor, Tensor]:
    """``(dL/dW, dL/dγ)`` as eager autograd computes them: ``g·mask`` unfolded; folded, the
    fold's backward with that mask (fold_weight_fq_backward's per-tensor form is
    ``g·mask``); ``dL/dγ`` empty without ``γ``."""
    if inv_std is None:
        return torch.mul(g, mask, out=torch.empty_like(w)), g.new_empty(0)
    return fold_weight_fq_backward(g, w, gamma, inv_std, xhat, mask, f, True)


@mx_weight_fq_backward.register_fake
def _mx_fake_backward(g, w, gamma, inv_std, xhat, mask, f):
    has = gamma is not None and inv_std is not None
    return torch.empty_like(w), (torch.empty_like(gamma) if has else w.new_empty(0))


def _mx_setup_context(ctx, inputs, output) -> None:
    w, gamma, inv_std = inputs[:3]
    _out, scale, xhat, mask, f = output
    ctx.has_gamma = gamma is not None and inv_std is not None
    ctx.folded = inv_std is not None
    ctx.save_for_backward(w, gamma, inv_std, xhat, mask, f)
    ctx.mark_non_differentiable(scale, xhat, mask, f)


def _mx_backward(ctx, g, *_unused):
    w, gamma, inv_std, xhat, mask, f = ctx.saved_tensors
    gw, gg = mx_weight_fq_backward(g, w, gamma if ctx.has_gamma else None, inv_std if ctx.folded else None,
                                   xhat, mask, f)
    return gw, (gg if ctx.has_gamma else None), None, None, None, None, None


mx_weight_fq.register_autograd(_mx_backward, setup_context=_mx_setup_context)


def mx_applies(q, w: Tensor) -> bool:
    """Does ``q``'s QAT training forward on a tensor like ``w`` equal what
    ``qdsl::mx_weight_fq`` computes?  (``TensorQuantizer.forward``'s conditions in order.)"""
    from qdsl.quantizers import observers as O
    from qdsl.quantizers.formats.minifloat import MinifloatOps
    from qdsl.quantizers.proxy_grad import qat_grad_path
    from qdsl.spec.builtins import MseParams
    from qdsl.spec.formats import minifloat_format

    if (q is None or not q.enabled or q.observing or q.frozen or not q.stateless or q.dynamic or q.derived
            or q.token or q.sign_threshold is not None or q.learned):
        return False
    if w.dtype is not torch.float32 or q.offset.numel() or q.codes.numel():
        return False
    if type(q._ops) is not MinifloatOps or q._round_fn is not None or q._round_mode != "half_even":
        return False
    if minifloat_format(q.format.name) != q.format or q.grad_path is not qat_grad_path:
        return False
    if type(q.observer) not in (O.MinMaxObserver, O.EmaObserver) or isinstance(q.recipe.observer_params, MseParams):
        return False
    if _rule_name(q.scale_rule) is None:
        return False
    if q.group_size is not None:
        return w.dim() >= 2
    return q.axis is None or -w.dim() <= q.axis < w.dim()


def _mx_call(q, w: Tensor, gamma, inv_std) -> Tensor:
    axis = None if q.axis is None or q.group_size is not None else q.axis % w.dim()
    out, scale, _xhat, _mask, _f = mx_weight_fq(w, gamma, inv_std, q.format.name, q.group_size, axis,
                                                _rule_name(q.scale_rule))
    q._last_scale = scale
    return out


def mx_folded(q, w: Tensor, bn) -> Optional[Tensor]:
    """``q(W·f)/f`` of a minifloat ``q`` for the live-statistics fold of ``bn`` as one op, in a
    training forward; None where it does not apply."""
    gamma = bn.weight
    training = torch.is_grad_enabled() and (w.requires_grad or (gamma is not None and gamma.requires_grad))
    if not training or not mx_applies(q, w):
        return None

    inv_std = bn_inv_std(bn.running_var, float(bn.eps)) if torch.compiler.is_compiling() else \
        torch.rsqrt(bn.running_var + bn.eps)
    return _mx_call(q, w, gamma, inv_std)


def mx_plain(q, x: Tensor) -> Optional[Tensor]:
    """``q(x)`` of a minifloat weight quantizer in a training forward as one op (a layer
    without a folded BN); None where it does not apply."""
    if not (torch.is_grad_enabled() and x.requires_grad) or not mx_applies(q, x):
        return None
    return _mx_call(q, x, None, None)

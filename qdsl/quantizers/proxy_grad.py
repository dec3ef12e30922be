"""The QAT gradient path of ``TensorQuantizer``: which STE each kind of quantizer trains with.

``TensorQuantizer`` (qdsl/quantizers/proxy.py) always computes *values* with
``qdsl.quantizers.functional``; when autograd needs a gradient it calls its own hook
``proxy.grad_path(proxy, x, scale, zero_point, threshold)``.  :func:`install` puts
:func:`qat_grad_path` there on the proxies it is given - one proxy, or every proxy of a
model - and nowhere else: importing a module changes no model's gradients.  A proxy
whose scale rule is learned gets it when built (LSQ needs it);
``qdsl.qat.prepare_qat``, ``fit`` and ``LeanOptimizer`` install it on their model's
proxies.  Guarantees:

* the value returned equals the proxy's own fake-quantized value bit for bit (the
  surrogates below either compute it with the same ``functional`` call or add a term
  that is exactly zero in the forward pass);
* gradients, by kind and role (closed forms in :mod:`qdsl.quantizers.ste`):

  ============  ==========  ======================================================
  kind          role        gradient
  ============  ==========  ======================================================
  int           any         clipping-mask STE to x; LSQ/LSQ+ to a learned scale
  binary        weight      XNOR-Net: α = mean|W| differentiable, sign clipped |W|<=1
  binary        activation  BNN clipped STE (|x| <= s); {0, 1}: mask on [0, s]
  ternary       weight      TWN: codes straight-through, α over kept weights
  ternary       activation  identity inside |x| <= s
  pot           any         identity where |w| <= s, zero where clipped
  ============  ==========  ======================================================

* a learned scale rule is told how many elements share each scale (LSQ's
  ``1/sqrt(numel·qmax)``) on every call, from the tensor actually quantized.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qdsl.quantizers import ste
from qdsl.quantizers import functional as F
from qdsl.spec.model import Kind, Role

__all__ = ["qat_grad_path", "install", "uninstall"]


def _zero_gain(sur: Tensor) -> Tensor:
    # exactly 0 in the forward pass, the surrogate's gradient in the backward pass
    return sur - sur.detach()


class _MaskedValue(torch.autograd.Function):
    """Activation of a binary/ternary/pot proxy with a fixed scale: the proxy's value,
    gradient ``g·mask`` with mask ``|x| <= s`` (BNN's clipped STE), or ``0 <= x <= s``
    for unsigned {0, 1}."""

    @staticmethod
    def forward(ctx, x, q, scale, zero_point, threshold):
        value = q._fake(x, scale, zero_point, threshold)
        s = F.param_view(scale.to(x.dtype), x, q.axis, q.group_size)
        if q.kind is Kind.BINARY and not q.recipe.signed:
            mask = (x >= 0) & (x <= s)
        else:
            mask = x.abs() <= s
        ctx.save_for_backward(mask)
        return value

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask, None, None, None, None


class _XnorWeight(torch.autograd.Function):
    """Binary weight with the proxy's value ``α·sign(W)`` and XNOR-Net's gradient, in one
    node: ``Σ_j g_j sign(W_j)/n · sign(W_i) + α g_i 1{|W_i| <= 1}`` per slice along
    ``axis`` with ``α = mean|W|`` (the closed form of ``ste.binary_weight``)."""

    @staticmethod
    def forward(ctx, w, value, axis):
        ctx.save_for_backward(w)
        ctx.axis = axis
        return value

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        axis = ctx.axis
        dims = tuple(range(w.dim())) if axis is None else tuple(d for d in range(w.dim()) if d != axis % w.dim())
        keep = axis is not None
        sgn = torch.where(w >= 0, 1.0, -1.0).to(w.dtype)
        n = w.numel() // (w.shape[axis] if keep else 1)
        alpha = w.abs().mean(dim=dims, keepdim=keep)
        gw = (g * sgn).sum(dim=dims, keepdim=keep) * sgn / n + alpha * g * (w.abs() <= 1)
        return gw, None, None


def qat_grad_path(q, x: Tensor, scale: Tensor, zero_point: Tensor, threshold) -> Tensor:
    """Fake-quantize ``x`` with proxy ``q``'s parameters and the QAT surrogate gradient."""
    rule = q.scale_rule
    if getattr(rule, "learned", False) and hasattr(rule, "bind"):
        rule.bind(x.shape, per_sample=q.role in (Role.INPUT, Role.OUTPUT), slots=max(1, scale.numel()))
    kind, axis, group = q.kind, q.axis, q.group_size
    is_weight = q.role in (Role.WEIGHT, Role.BIAS)
    if kind is Kind.INT:
        if q._round_fn is not None:  # a user rounding: their values, the clipping-mask STE
            value = q._fake(x.detach(), scale.detach(), zero_point, threshold)
            sur = ste.fake_quant(x, scale, None if q.recipe.symmetric else zero_point, q.qmin, q.qmax,
                                 rounding="half_even", axis=axis, group_size=group)
            return value + _zero_gain(sur)
        zp = None if q.recipe.symmetric else zero_point
        return ste.fake_quant(x, scale, zp, q.qmin, q.qmax, rounding=q._round_mode, axis=axis,
                              group_size=group)
    if not is_weight and not scale.requires_grad:
        # activations are large: one autograd node, value and mask computed once
        return _MaskedValue.apply(x, q, scale, zero_point, threshold)
    value = q._fake(x.detach(), scale.detach(), zero_point, threshold)
    if kind is Kind.BINARY and q.recipe.signed and is_weight and group is None and not scale.requires_grad:
        return _XnorWeight.apply(x, value, axis)
    s_view = F.param_view(scale.to(x.dtype), x, axis, group)
    if kind is Kind.BINARY:
        if not q.recipe.signed:
            sur = ste.unsigned_binary(x, s_view)
        elif is_weight and group is None:
            sur = ste.binary_weight(x, axis)
        else:
            sur = ste.binary_act(x, s_view)
    elif kind is Kind.TERNARY:
        if is_weight and group is None:
            sur = ste.ternary_weight(x, axis)
        else:
            sur = x * (x.detach().abs() <= s_view.detach())
    elif kind is Kind.POT:
        sur = x * (x.detach().abs() <= s_view.detach())
        if scale.requires_grad:  # a learned scale of pot weights: value/s per element
            sur = sur + s_view * (value / s_view.detach()).detach()
    else:  # pragma: no cover - the proxy never builds float quantizers
        raise AssertionError(kind)
    if scale.requires_grad and kind is not Kind.POT:
        # learned α: d(α·code)/dα = code
        sur = sur + s_view * (value / s_view.detach().clamp_min(1e-30)).detach()
    return value + _zero_gain(sur)


def _proxies(target) -> list:
    from qdsl.quantizers.proxy import TensorQuantizer

    if isinstance(target, TensorQuantizer):
        return [target]
    if isinstance(target, torch.nn.Module):
        return [m for m in target.modules() if isinstance(m, TensorQuantizer)]
    return [q for t in target for q in _proxies(t)]


def install(target) -> int:
    """Make the proxies of ``target`` (a ``TensorQuantizer``, a module such as a patched
    model, or an iterable of them) train with :func:`qat_grad_path`; idempotent.
    Returns how many proxies it set; no other proxy changes."""
    proxies = _proxies(target)
    for q in proxies:
        q.grad_path = qat_grad_path
    return len(proxies)


def uninstall(target) -> int:
    """Back to the plain identity STE for the proxies of ``target`` (as in :func:`install`)."""
    proxies = _proxies(target)
    for q in proxies:
        q.grad_path = None
    return len(proxies)

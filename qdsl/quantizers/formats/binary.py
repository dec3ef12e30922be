"""Binary: ``α·sign(x)`` (signed, XNOR-Net) or ``α·[x >= α/2]`` (unsigned {0, 1})."""

from __future__ import annotations

import torch

from qdsl.quantizers import functional as F
from qdsl.quantizers import ste
from qdsl.quantizers.formats.base import FormatOps, NotExportable, WeightInts, is_weight

__all__ = ["BinaryOps"]


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


class BinaryOps(FormatOps):
    """QAT gradients: weights XNOR-Net (α = mean|W| differentiable, sign clipped |W| <= 1);
    activations BNN's clipped STE (|x| <= s), {0, 1} codes the mask on [0, s]."""

    def qat_value(self, q, x, scale, zp, thr):
        if q.recipe.signed and is_weight(q) and q.group_size is None and not scale.requires_grad:
            return _XnorWeight.apply(x, q._fake(x.detach(), scale.detach(), zp, thr), q.axis)
        return super().qat_value(q, x, scale, zp, thr)

    def activation_mask(self, q, x, s):
        return x.abs() <= s if q.recipe.signed else (x >= 0) & (x <= s)

    def qat_surrogate(self, q, x, s_view):
        if not q.recipe.signed:
            return ste.unsigned_binary(x, s_view)
        if is_weight(q) and q.group_size is None:
            return ste.binary_weight(x, q.axis)
        return ste.binary_act(x, s_view)

    def fake(self, q, x, scale, zp, thr):
        return F.fake_quant_binary(x, scale.to(x.dtype), q.recipe.signed, q.axis, q.group_size)

    def codes(self, q, x, scale, zp, thr):
        return F.binary_codes(x, scale, q.recipe.signed, q.axis, q.group_size)

    def lower_weight(self, q, codes, scale):
        if not q.recipe.signed:
            raise NotExportable("unsigned {0, 1} binary weights have no XNOR lowering", "use signed binary weights")
        return WeightInts(codes, scale, "BIN")

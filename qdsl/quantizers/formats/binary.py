"""Binary: ``α·sign(x)`` (signed, XNOR-Net) or ``α·[x >= α/2]`` (unsigned {0, 1}).

A signed binary activation with ``threshold = learned`` (ReActNet's RSign) binarises at a
learned per-channel threshold ``t`` (``q.sign_threshold``, channel axis 1 of an N,C,...
or N,F tensor): code ``+1`` where ``x >= t[c]``, ``-1`` where ``x < t[c]`` (a NaN is +1, as
at ``t = 0``); the tie ``x == t[c]`` is +1, the same rule as ``sign(0) = +1`` and as the
integer graph's comparison (qdsl/export/lower_threshold.py).  ``t`` starts at the
per-channel mean of the first batch the quantizer sees, so about half the codes start at
each sign even after a ReLU.  Gradients: to ``x`` the clipped STE ``g·[|x - t| <= s]``
(the BNN rule shifted by ``t``), to ``t`` its negative summed over each channel.
"""

from __future__ import annotations

import torch

from qdsl.quantizers import functional as F
from qdsl.quantizers import ste
from qdsl.quantizers.formats.base import FormatOps, NotExportable, WeightInts, is_weight, zero_gain

__all__ = ["BinaryOps", "threshold_view"]


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


def _channel_axis(x: torch.Tensor) -> int:
    return 1 if x.dim() >= 2 else 0


def threshold_view(q, x: torch.Tensor) -> torch.Tensor | None:
    """The learned threshold broadcast against ``x`` (``[1, C, 1, ...]``), or None."""
    t = getattr(q, "sign_threshold", None)
    if t is None or is_weight(q) or t.numel() == 0:
        return None
    shape = [1] * x.dim()
    shape[_channel_axis(x)] = -1
    return t.to(x.dtype).view(shape)


class _ThresholdSign(torch.autograd.Function):
    """``α·(+1 if x >= t[c] else -1)``; gradient ``g·[|x - t| <= s]`` to ``x`` and minus its
    per-channel sum to ``t`` (``s`` the scale view: the BNN clip around the threshold)."""

    @staticmethod
    def forward(ctx, x, t, tv, s, value):
        ctx.save_for_backward((x - tv).abs() <= s)
        ctx.axis = _channel_axis(x)
        return value

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        gx = g * mask
        dims = tuple(d for d in range(gx.dim()) if d != ctx.axis)
        return gx, -gx.sum(dim=dims), None, None, None


class BinaryOps(FormatOps):
    """QAT gradients: weights XNOR-Net (α = mean|W| differentiable, sign clipped |W| <= 1);
    activations BNN's clipped STE (|x| <= s), {0, 1} codes the mask on [0, s]."""

    def init_threshold(self, q, x: torch.Tensor) -> None:
        """Size and set a learned threshold from its first batch: the per-channel mean."""
        with torch.no_grad():
            xf = x.detach().float()
            ax = _channel_axis(xf)
            dims = tuple(d for d in range(xf.dim()) if d != ax)
            t = xf.nan_to_num(0.0, 0.0, 0.0).mean(dim=dims) if dims else xf.clone()
            q.sign_threshold.data = t.to(q.sign_threshold.device).contiguous()

    def qat_value(self, q, x, scale, zp, thr):
        tv = threshold_view(q, x)
        if tv is not None:
            value = q._fake(x.detach(), scale.detach(), zp, thr)
            s_view = F.param_view(scale.detach().to(x.dtype), x, q.axis, q.group_size)
            out = _ThresholdSign.apply(x, q.sign_threshold, tv.detach(), s_view, value)
            if scale.requires_grad:
                sv = F.param_view(scale.to(x.dtype), x, q.axis, q.group_size)
                out = out + zero_gain(self.scale_surrogate(sv, value))
            return out
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
        tv = threshold_view(q, x)
        # x == t[c] (and NaN) -> +α
        return F.fake_quant_binary(x, scale.to(x.dtype), q.recipe.signed, q.axis, q.group_size, threshold=tv)

    def codes(self, q, x, scale, zp, thr):
        tv = threshold_view(q, x)
        if tv is not None:
            return torch.where(x < tv, -1, 1).to(torch.int8)
        return F.binary_codes(x, scale, q.recipe.signed, q.axis, q.group_size)

    def lower_weight(self, q, codes, scale):
        if not q.recipe.signed:
            raise NotExportable("unsigned {0, 1} binary weights have no XNOR lowering", "use signed binary weights")
        return WeightInts(codes, scale, "BIN")

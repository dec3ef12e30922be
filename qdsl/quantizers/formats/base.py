"""The torch protocol of a number format, and the defaults symmetric formats share.

A :class:`FormatOps` answers, for one :class:`~qdsl.quantizers.proxy.TensorQuantizer`
``q`` (its recipe, role, ``qmin``/``qmax``, axis, group size, rounding):

* ``qparams(q, x, lo, hi, rule)`` - ``(scale, zero_point, threshold)`` from an observed
  range ``lo..hi`` and the scale rule;
* ``learned_threshold(scale)`` - the threshold a learned scale implies (ternary);
* ``init_threshold(q, x)`` - a learned binarisation threshold's first value (binary);
* ``fake(q, x, scale, zp, thr)`` - fake quantization x̂ (the values the codes decode to);
* ``codes(q, x, scale, zp, thr)`` - the integer codes ``int_repr`` returns;
* ``fast_path`` - the frozen quantizer may use the proxy's fused affine fast path;
* ``lower_weight(q, codes, scale)`` - the weight's integer-graph constants
  (:class:`WeightInts`) or :class:`NotExportable`.

Gradients: the proxy's default is the plain straight-through estimator for every format
(value x̂, identity gradient).  QAT (``qdsl.quantizers.proxy_grad``) asks the format:

* ``qat_value(q, x, scale, zp, thr)`` - x̂ bit for bit, with the format's QAT surrogate
  gradient to ``x`` and to a learned ``scale``.  The default is the clipping-mask STE:
  an activation with a fixed scale is one autograd node with gradient ``g·activation_mask``;
  otherwise x̂ plus a zero-valued term carrying ``qat_surrogate`` (identity where
  ``|x| <= s``) and, for a learned scale, ``scale_surrogate`` (d(s·code)/ds = code).
  A format overrides any of the three hooks, or ``qat_value`` itself (int: LSQ).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from qdsl.quantizers import functional as F

__all__ = ["FormatOps", "WeightInts", "NotExportable", "packed_int_dtype", "TINY", "zero_gain", "is_weight"]

TINY = 1e-12
"""Smallest magnitude scale a symmetric format derives from a range (never 0)."""


class WeightInts(NamedTuple):
    """A weight as integer-graph constants: ``value = codes · scale`` per output channel."""

    codes: np.ndarray
    scale: np.ndarray
    dtype: str
    """The name of a ``qdsl.graph.ir.DType`` member (``"I4"``, ``"BIN"``)."""


class NotExportable(Exception):
    """This format (or this configuration of it) has no integer-graph lowering."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message, self.hint = message, hint


def packed_int_dtype(bits: int, signed: bool) -> str:
    """The narrowest packed constant dtype for ``bits``-bit codes (2, 4 or 8 bits)."""
    for width in (2, 4, 8):
        if bits <= width:
            return f"{'I' if signed else 'U'}{width}"
    raise NotExportable(f"{bits}-bit weights are wider than 8 bits", "use weight bits <= 8")


def zero_gain(sur: torch.Tensor) -> torch.Tensor:
    """Exactly 0 in the forward pass, the surrogate's gradient in the backward pass."""
    return sur - sur.detach()


def is_weight(q: Any) -> bool:
    """The quantizer's tensor is a parameter (weight/bias), not an activation."""
    return q.role.is_param


class _MaskedValue(torch.autograd.Function):
    """Activation with a fixed scale: the proxy's value, gradient ``g·mask`` with the
    format's ``activation_mask`` (value and mask computed once: activations are large)."""

    @staticmethod
    def forward(ctx, x, ops, q, scale, zero_point, threshold):
        value = q._fake(x, scale, zero_point, threshold)
        s = F.param_view(scale.to(x.dtype), x, q.axis, q.group_size)
        ctx.save_for_backward(ops.activation_mask(q, x, s))
        return value

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask, None, None, None, None, None


class FormatOps:
    """Defaults for a symmetric format with one scale and no zero point: the scale is
    the range's largest magnitude (``hi`` for unsigned codes), passed through the rule."""

    fast_path = False

    def qparams(self, q: Any, x: torch.Tensor | None, lo: torch.Tensor, hi: torch.Tensor, rule: Any):
        raw, thr = self.raw_scale(q, x, lo, hi)
        scale = rule(torch.clamp(raw, min=TINY))
        if thr is None:
            thr = self.learned_threshold(scale)
        zp = torch.zeros(scale.shape, dtype=torch.int32, device=scale.device)
        return scale, zp, thr

    def raw_scale(self, q: Any, x: torch.Tensor | None, lo: torch.Tensor, hi: torch.Tensor):
        """``(raw scale, threshold or None)`` before the scale rule."""
        return (torch.maximum(-lo, hi) if q.qmin < 0 else hi), None

    def learned_threshold(self, scale: torch.Tensor) -> torch.Tensor | None:
        return None

    def init_threshold(self, q: Any, x: torch.Tensor) -> None:
        """Size and set ``q.sign_threshold`` from its first batch (a format whose facts say
        ``learned_threshold``: binary)."""
        raise NotImplementedError(f"{q.format.name} has no learned threshold")

    def fake(self, q: Any, x: torch.Tensor, scale, zp, thr) -> torch.Tensor:
        raise NotImplementedError

    def codes(self, q: Any, x: torch.Tensor, scale, zp, thr) -> torch.Tensor:
        raise NotImplementedError

    def lower_weight(self, q: Any, codes: np.ndarray, scale: np.ndarray) -> WeightInts:
        raise NotExportable(f"{q.format.name} weights have no integer lowering")

    def qat_value(self, q: Any, x: torch.Tensor, scale: torch.Tensor, zp, thr) -> torch.Tensor:
        """x̂ with the format's QAT surrogate gradient (see the module docstring)."""
        if not is_weight(q) and not scale.requires_grad:
            return _MaskedValue.apply(x, self, q, scale, zp, thr)
        value = q._fake(x.detach(), scale.detach(), zp, thr)
        s_view = F.param_view(scale.to(x.dtype), x, q.axis, q.group_size)
        sur = self.qat_surrogate(q, x, s_view)
        if scale.requires_grad:
            sur = sur + self.scale_surrogate(s_view, value)
        return value + zero_gain(sur)

    def activation_mask(self, q: Any, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Where an activation with a fixed scale ``s`` passes its gradient: ``|x| <= s``."""
        return x.abs() <= s

    def qat_surrogate(self, q: Any, x: torch.Tensor, s_view: torch.Tensor) -> torch.Tensor:
        """A tensor whose gradient to ``x`` is the format's: identity where ``|x| <= s``."""
        return x * (x.detach().abs() <= s_view.detach())

    def scale_surrogate(self, s_view: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A learned scale's gradient term: d(s·code)/ds = code = x̂/s."""
        return s_view * (value / s_view.detach().clamp_min(1e-30)).detach()

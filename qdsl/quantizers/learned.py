"""Learned scale rules for QAT: ``learned`` (LSQ) and ``learned_pot`` (learned log2 scale).

They follow the scale-rule protocol of :mod:`qdsl.quantizers.parts`: an ``nn.Module``
with ``learned = True`` whose ``forward(raw)`` returns the scale to use.  The first call
with a raw (observer-derived) scale initialises the parameter from it; later calls may
pass ``None`` and get the learned value.  Guarantees:

* ``learned``: the scale *is* the parameter ``scale`` (clamped to ``>= eps`` so a large
  step can never make it zero or negative).  Its gradient is LSQ's, because the proxy's
  fake quantization is :func:`qdsl.quantizers.ste.fake_quant` in training, multiplied by
  ``1/sqrt(numel·qmax)`` (:func:`qdsl.quantizers.ste.lsq_grad_factor`); ``numel`` = elements per
  scale, which the proxy tells the rule with :meth:`LearnedScale.bind` (read when the
  gradient is computed, so the first call is right too; per sample for
  activations, per channel/tensor for weights).
* ``learned_pot``: the parameter is ``log2_scale``; the scale is
  ``2^round(log2_scale)``, rounded exactly like ``functional.pot_scale`` (so export sees
  a true power of two), with a straight-through round: ``ds/dt = s·ln 2``.  The same
  LSQ gradient scaling applies (to ``t``'s gradient).
* Parameters are sized on initialisation; loading a ``state_dict`` into a fresh rule
  resizes them, so save/load round-trips before and after calibration.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qdsl.quantizers import ste
from qdsl.quantizers import functional as F

__all__ = ["LearnedScale", "LearnedPotScale"]


class _LsqGrad(torch.autograd.Function):
    # identity forward; the gradient is scaled by the rule's LSQ factor read at backward
    # time, because the proxy binds the element count (bind) after asking for the scale
    @staticmethod
    def forward(ctx, p: torch.Tensor, rule: "LearnedScale") -> torch.Tensor:
        ctx.rule = rule
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.rule.grad_factor, None


class LearnedScale(nn.Module):
    """LSQ: the scale is a learned ``nn.Parameter`` initialised from the observer."""

    learned = True
    pot = False
    eps = 1e-12
    _param = "scale"

    def __init__(self, ctx=None):
        super().__init__()
        self.ctx = ctx
        self.qmax = max(1, int(getattr(ctx, "qmax", 1) or 1))
        self.register_parameter(self._param, nn.Parameter(torch.ones(())))
        self.register_buffer("initialized", torch.tensor(False))
        self.numel = 1
        """Elements sharing one scale (set by :meth:`bind`), for LSQ's gradient scale."""

    # -- protocol ---------------------------------------------------------------------
    def bind(self, x_shape, per_sample: bool, slots: int = 1) -> None:
        """Record how many elements share one scale: ``prod(shape[1:])`` for activations
        (``per_sample``), ``prod(shape)`` for parameters, divided by the number of slots."""
        shape = tuple(x_shape)[1:] if per_sample and len(x_shape) > 1 else tuple(x_shape)
        self.numel = max(1, math.prod(shape) // max(1, int(slots)))

    @property
    def grad_factor(self) -> float:
        return ste.lsq_grad_factor(self.numel, self.qmax)

    def initialize(self, raw: torch.Tensor) -> None:
        """Set the parameter from an observer-derived scale (keeps the Parameter object)."""
        with torch.no_grad():
            value = self._from_raw(raw.detach().to(torch.float32))
            p = getattr(self, self._param)
            p.data = value.clone()
            self.initialized.fill_(True)

    def forward(self, raw: torch.Tensor | None = None) -> torch.Tensor:
        if raw is not None and not bool(self.initialized):
            self.initialize(raw)
        return self._scale(_LsqGrad.apply(getattr(self, self._param), self))

    # -- variants ---------------------------------------------------------------------
    def _from_raw(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.clamp_min(self.eps)

    def _scale(self, p: torch.Tensor) -> torch.Tensor:
        return p.clamp_min(self.eps)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        saved = state_dict.get(prefix + self._param)
        p = getattr(self, self._param)
        if saved is not None and saved.shape != p.shape:
            p.data = torch.empty(saved.shape, dtype=p.dtype, device=p.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"qmax={self.qmax}, numel={self.numel}"


class LearnedPotScale(LearnedScale):
    """Learns ``log2_scale``; the scale is ``2^round(log2_scale)`` with a straight-through round."""

    pot = True
    _param = "log2_scale"

    def _from_raw(self, raw: torch.Tensor) -> torch.Tensor:
        # start at the exponent functional.pot_scale would pick for this raw scale, so
        # the first learned forward equals the PTQ ``pot`` result exactly
        return torch.log2(F.pot_scale(raw.clamp_min(self.eps)))

    def _scale(self, t: torch.Tensor) -> torch.Tensor:
        return ste.pot_scale(t)

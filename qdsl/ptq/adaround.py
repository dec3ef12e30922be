"""AdaRound's soft rounding of one weight tensor on a fixed grid (Nagel et al., 2020,
"Up or down? Adaptive rounding for post-training quantization").

The grid (scale ``s``, zero point ``z``, code range ``qmin..qmax``) is the one the weight
proxy's observer chose; only the rounding direction of each weight is learned::

    w_floor = floor(w · (1/s))                      (1/s: the proxy's reciprocal form)
    h(V)    = clamp(σ(V) · (ζ − γ) + γ, 0, 1)        ζ = 1.1, γ = −0.1  (rectified sigmoid)
    ŵ(V)    = (clamp(w_floor + h(V) + z, qmin, qmax) − z) · s
    reg(V)  = mean(1 − |2·h(V) − 1|^β)               β annealed from 20 to 2

``V`` starts where ``h(V)`` equals the fractional part of ``w/s`` (so ``ŵ`` starts at
``w`` inside the range), the optimiser moves it, and the regulariser, once the warm-up is
over, pushes every ``h`` to 0 or 1 as ``β`` falls.  The hard codes are
``clamp(w_floor + [V >= 0] + z, qmin, qmax)`` (``h >= 1/2`` exactly when ``V >= 0``):
each code is the floor or the ceiling of ``w/s``, never further away (unlike GPTQ's).

The stretch beyond [0, 1] (ζ, γ) gives ``h`` a non-vanishing gradient until it reaches
0 or 1 exactly, where the clamp holds it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qdsl.quantizers.functional import param_view, reciprocal

__all__ = ["ZETA", "GAMMA", "rectified_sigmoid", "initial_logits", "rounding_regulariser", "beta_schedule",
           "SoftRounding"]

ZETA, GAMMA = 1.1, -0.1
"""The rectified sigmoid's stretch (AdaRound's values)."""


def rectified_sigmoid(v: torch.Tensor) -> torch.Tensor:
    """``clamp(σ(v)·(ζ−γ)+γ, 0, 1)``: the soft rounding offset in [0, 1].

    >>> rectified_sigmoid(torch.tensor([-10.0, 0.0, 10.0])).tolist()
    [0.0, 0.5, 1.0]
    """
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def initial_logits(rest: torch.Tensor) -> torch.Tensor:
    """``V`` with ``rectified_sigmoid(V) == rest`` for ``rest`` in (0, 1) (the inverse of
    the stretched sigmoid; 0 and 1 map to finite logits just inside the clamp).

    >>> r = torch.tensor([0.1, 0.5, 0.9])
    >>> torch.allclose(rectified_sigmoid(initial_logits(r)), r)
    True
    """
    p = ((rest - GAMMA) / (ZETA - GAMMA)).clamp(1e-4, 1 - 1e-4)
    return torch.log(p) - torch.log1p(-p)


def rounding_regulariser(h: torch.Tensor, beta: float) -> torch.Tensor:
    """``mean(1 − |2h − 1|^β)``: 0 when every ``h`` is 0 or 1, largest at ``h = 1/2``.

    >>> float(rounding_regulariser(torch.tensor([0.0, 1.0]), 2.0))
    0.0
    >>> float(rounding_regulariser(torch.tensor([0.5]), 2.0))
    1.0
    """
    return (1.0 - (2.0 * h - 1.0).abs().pow(beta)).mean()


def beta_schedule(step: int, total: int, *, warmup: float = 0.2, start: float = 20.0, end: float = 2.0) -> float | None:
    """AdaRound's annealing: None (no regulariser) for the first ``warmup`` fraction of
    the steps, then ``β`` falling linearly (in the remaining fraction) from ``start`` to
    ``end``; a large ``β`` only penalises ``h`` near 1/2, a small one everything not yet
    0 or 1.

    >>> [beta_schedule(i, 10) for i in (0, 1, 2, 9)]
    [None, None, 20.0, 2.0]
    """
    first = int(math.ceil(warmup * total))
    if step < first:
        return None
    span = max(total - 1 - first, 1)
    frac = min((step - first) / span, 1.0)
    return start + (end - start) * frac


class SoftRounding(nn.Module):
    """The learnable rounding of one weight tensor (see the module docstring).

    ``scale``/``zero_point`` are ``[]`` (per tensor) or ``[C]`` along ``axis`` (per output
    channel).  ``forward()`` is the soft fake-quantized weight (differentiable in
    ``self.v``); :meth:`hard_codes` the integer codes to store in the weight proxy.

    >>> w = torch.tensor([[0.26, -0.74], [0.2, 0.1]])
    >>> sr = SoftRounding(w, torch.tensor([0.5, 0.25]), torch.zeros(2, dtype=torch.int32), -2, 1, axis=0)
    >>> torch.allclose(sr(), w, atol=1e-6), sr.hard_codes().tolist()
    (True, [[1, -1], [1, 0]])
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int,
                 axis: int | None = None):
        super().__init__()
        w = weight.detach().to(torch.float32)
        scale = torch.as_tensor(scale, dtype=torch.float32).detach()
        zp = torch.as_tensor(zero_point).detach().to(torch.float32)
        s = param_view(scale, w, axis) if scale.dim() else scale
        z = param_view(zp, w, axis) if zp.dim() else zp
        ws = w * (param_view(reciprocal(scale), w, axis) if scale.dim() else reciprocal(scale))
        floor = torch.floor(ws)
        self.register_buffer("floor", floor)
        self.register_buffer("s", s)
        self.register_buffer("z", z)
        self.qmin, self.qmax = float(qmin), float(qmax)
        self.v = nn.Parameter(initial_logits(ws - floor))

    def h(self) -> torch.Tensor:
        return rectified_sigmoid(self.v)

    def forward(self) -> torch.Tensor:
        codes = torch.clamp(self.floor + self.h() + self.z, self.qmin, self.qmax)
        return (codes - self.z) * self.s

    def regulariser(self, beta: float) -> torch.Tensor:
        return rounding_regulariser(self.h(), beta)

    def hard_codes(self) -> torch.Tensor:
        up = (self.v.detach() >= 0).to(torch.float32)
        return torch.clamp(self.floor + up + self.z, self.qmin, self.qmax).to(torch.int64)

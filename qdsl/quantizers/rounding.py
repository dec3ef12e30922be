"""Built-in roundings as registry parts: ``fn(x, generator=None) -> rounded x``.

They are :func:`qdsl.quantizers.functional.round_` in each mode; the proxy recognises
them and calls ``functional`` directly.  A user rounding registered with
``@regs.roundings.register("name")`` must have the same signature and return integral
float values.

>>> t = torch.tensor([0.5, 1.5, -0.5])
>>> half_even(t).tolist(), half_away(t).tolist(), floor(t).tolist()
([0.0, 2.0, -0.0], [1.0, 2.0, -1.0], [0.0, 1.0, -1.0])
"""

from __future__ import annotations

import torch

from qdsl.quantizers.functional import round_

__all__ = ["half_even", "half_away", "floor", "stochastic"]


def half_even(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Ties to even (``torch.round``; what torch's fake-quantize kernels do)."""
    return round_(x, "half_even")


def half_away(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Ties away from zero (gemmlowp's rounding)."""
    return round_(x, "half_away")


def floor(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Towards minus infinity."""
    return round_(x, "floor")


def stochastic(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``floor(x) + [u < frac(x)]``, ``u ~ U[0, 1)``: unbiased in expectation."""
    return round_(x, "stochastic", generator)

"""Built-in scale rules: a raw (observer-derived) scale -> the scale actually used.

Protocol (see :mod:`qdsl.quantizers.parts`): ``rule(ctx)`` is an ``nn.Module`` whose
``forward(raw)`` returns a scale of the same shape.  ``float`` keeps it, ``pot`` rounds
it to the nearest power of two in the log domain (``functional.pot_scale``: the
boundary is ``2^k·√2``; up to √2 smaller, so the largest values may clip) and
``pot_ceil`` to the next power of two at or above it (never clips, up to 2× coarser).
The learned rules (``learned``, ``learned_pot``) are provided by :mod:`qdsl.quantizers.learned`.

>>> from qdsl.quantizers.observers import _ctx
>>> raw = torch.tensor([0.1, 0.3])
>>> FloatScale(_ctx())(raw).tolist() == raw.tolist(), PotScale(_ctx())(raw).tolist(), PotCeilScale(_ctx())(raw).tolist()
(True, [0.125, 0.25], [0.125, 0.5])
"""

from __future__ import annotations

import torch
from torch import nn

from qdsl.quantizers import functional as F

__all__ = ["FloatScale", "PotScale", "PotCeilScale"]


class FloatScale(nn.Module):
    """Any positive float32 scale."""

    learned = False
    pot = False

    def __init__(self, ctx=None):
        super().__init__()

    def forward(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.to(torch.float32)


class PotScale(FloatScale):
    """``2^round(log2 raw)`` (log-domain nearest; see the module docstring)."""

    pot = True
    _mode = "round"

    def forward(self, raw: torch.Tensor) -> torch.Tensor:
        return F.pot_scale(raw, self._mode)


class PotCeilScale(PotScale):
    """The smallest power of two ``>= raw``."""

    _mode = "ceil"

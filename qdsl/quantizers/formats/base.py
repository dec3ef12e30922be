"""The torch protocol of a number format, and the defaults symmetric formats share.

A :class:`FormatOps` answers, for one :class:`~qdsl.quantizers.proxy.TensorQuantizer`
``q`` (its recipe, role, ``qmin``/``qmax``, axis, group size, rounding):

* ``qparams(q, x, lo, hi, rule)`` - ``(scale, zero_point, threshold)`` from an observed
  range ``lo..hi`` and the scale rule;
* ``learned_threshold(scale)`` - the threshold a learned scale implies (ternary);
* ``fake(q, x, scale, zp, thr)`` - fake quantization x̂ (the values the codes decode to);
* ``codes(q, x, scale, zp, thr)`` - the integer codes ``int_repr`` returns;
* ``fast_path`` - the frozen quantizer may use the proxy's fused affine fast path;
* ``lower_weight(q, codes, scale)`` - the weight's integer-graph constants
  (:class:`WeightInts`) or :class:`NotExportable`.

Gradients: the proxy's default is the plain straight-through estimator for every format
(value x̂, identity gradient); QAT installs its own gradient forms.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["FormatOps", "WeightInts", "NotExportable", "packed_int_dtype", "TINY"]

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

    def fake(self, q: Any, x: torch.Tensor, scale, zp, thr) -> torch.Tensor:
        raise NotImplementedError

    def codes(self, q: Any, x: torch.Tensor, scale, zp, thr) -> torch.Tensor:
        raise NotImplementedError

    def lower_weight(self, q: Any, codes: np.ndarray, scale: np.ndarray) -> WeightInts:
        raise NotExportable(f"{q.format.name} weights have no integer lowering")

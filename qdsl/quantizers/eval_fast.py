"""Evaluation fast paths of :class:`~qdsl.quantizers.proxy.TensorQuantizer`: no autograd,
not compiled, values equal to the general path's bit for bit
(``tests/quantizers/test_eval_fast_paths.py`` compares them).

Two things cost an evaluation forward before the elementwise passes themselves, and
matter on small layers (a transformer encoder's 29 activation quantizers per layer pair):

* **A dynamic per-tensor int quantizer's scale** (:func:`dynamic_int_params`): the general
  path derives scale and zero point from the batch range in ~40 tensor ops on one or two
  numbers (each a dispatch of several microseconds).  Here the range comes from one
  ``aminmax`` and the scale and zero point from binary32 scalar arithmetic (numpy
  ``float32``: each operation rounds once to binary32, as torch's float32 kernels do),
  the formula of :func:`qdsl.quantizers.range_search.range_to_qparams` and
  :class:`qdsl.quantizers.formats.int.IntOps` step by step.
* **One tensor quantized by several readers** (:class:`SharedInputs`): a BERT layer's
  query, key and value Linears each quantize the same hidden states with their own
  input quantizer; with identical parameters (dynamic: the same recipe; static: the same
  calibrated scale and zero point) the fake-quantized tensor is the same, so it is
  computed once.  The tensor is shared by reference among those readers (input
  quantizers only: Linear/Conv/attention read their input without writing it); an
  in-place edit of either tensor (its version counter) ends the sharing.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

__all__ = ["SharedInputs", "dynamic_int_params", "views_fingerprint", "SHARED"]

_F32 = np.float32
_TINY32 = float(np.float32(1e-12))
"""``range_search._TINY`` as ``torch.clamp(float32, min=1e-12)`` compares it: in binary32."""


_WIDE = 3.0e38
"""Ranges at least this wide (binary32's largest value is 3.4e38) are left to the tensor
path: their width may overflow binary32, where numpy would warn."""


def dynamic_int_params(lo: float, hi: float, qmin: int, qmax: int, symmetric: bool) -> tuple[float, int] | None:
    """``(scale, zero_point)`` of the range ``lo..hi`` (finite binary32 values held in Python
    floats) for an int quantizer with a ``float`` scale rule: the values
    ``IntOps.qparams(range_to_qparams(lo, hi))`` computes in float32 tensors.  None for a
    range :data:`_WIDE` or wider.

    >>> dynamic_int_params(-1.0, 2.0, 0, 255, False)
    (0.0117647061124444, 85)
    """
    lo0, hi0 = min(lo, 0.0), max(hi, 0.0)
    if hi0 - lo0 >= _WIDE:
        return None
    if symmetric:
        if qmin < 0:
            amax = max(-lo0, hi0)
        else:
            amax = hi0 if hi0 > 0 else -lo0
        raw = _F32(amax) / _F32(qmax)
    else:
        raw = (_F32(hi0) - _F32(lo0)) / _F32(qmax - qmin)
    scale = max(float(raw), _TINY32)
    if symmetric:
        return scale, 0
    # IntOps: the zero point of the scale actually used, qmin - round(min(lo, 0) / s), clamped
    r = np.round(_F32(lo0) / _F32(scale))
    zp = float(_F32(qmin) - r)
    return scale, int(min(max(zp, qmin), qmax))


def reciprocal(scale: float) -> float:
    """``functional.reciprocal`` of a binary32 value held in a Python float."""
    return float(_F32(1.0) / _F32(scale))


def views_fingerprint(s: Any, inv: Any, lo: Any, hi: Any) -> tuple | None:
    """What the fast path's result depends on besides the input, for views with one scale
    and Python clamp bounds (the values, so two quantizers calibrated alike match); None
    for per-channel views (never shared)."""
    if not (isinstance(lo, int) and isinstance(hi, int)):
        return None
    if isinstance(s, torch.Tensor):
        if s.numel() != 1 or not isinstance(inv, torch.Tensor) or inv.numel() != 1:
            return None
        s, inv = float(s), float(inv)
    if not (math.isfinite(s) and math.isfinite(inv)):
        return None
    return ("affine", s, inv, lo, hi)


class SharedInputs:
    """Recently fake-quantized input tensors, by the input tensor (identity and version
    counter) and the quantizer's :func:`views_fingerprint`.

    Bounded (``size`` input tensors, ``per_tensor`` fingerprints each, per thread): it only
    has to span the readers of one tensor, which run one after another; an entry also goes
    when its input tensor is freed.  Holding the result keeps at most that many
    activation-sized tensors alive."""

    def __init__(self, size: int = 2, per_tensor: int = 2) -> None:
        self.size = size
        self.per_tensor = per_tensor
        self._local = threading.local()

    def _entries(self) -> OrderedDict:
        e = getattr(self._local, "entries", None)
        if e is None:
            e = self._local.entries = OrderedDict()
        return e

    def get(self, x: torch.Tensor, fp: tuple) -> tuple[torch.Tensor, Any] | None:
        """``(result, aux)`` stored for ``x`` (unchanged) and ``fp``, if the result is unchanged."""
        e = self._entries().get(id(x))
        if e is None or e[0]() is not x or e[1] != x._version:
            return None
        hit = e[2].get(fp)
        if hit is None or hit[0]._version != hit[1]:
            return None
        return hit[0], hit[2]

    def put(self, x: torch.Tensor, fp: tuple, out: torch.Tensor, aux: Any = None) -> None:
        """Remember ``out`` (and ``aux``: the scale it used) as the result for ``x``, ``fp``."""
        entries = self._entries()
        k = id(x)
        e = entries.get(k)
        if e is None or e[0]() is not x or e[1] != x._version:
            def drop(ref, k=k, entries=entries):
                cur = entries.get(k)
                if cur is not None and cur[0] is ref:
                    entries.pop(k, None)
            e = entries[k] = [weakref.ref(x, drop), x._version, {}]
        outs = e[2]
        outs[fp] = (out, out._version, aux)
        while len(outs) > self.per_tensor:
            outs.pop(next(iter(outs)))
        entries.move_to_end(k)
        while len(entries) > self.size:
            entries.popitem(last=False)

    def clear(self) -> None:
        self._entries().clear()


SHARED = SharedInputs()
"""The input quantizers' shared results (a cache: it only ever returns values equal to a
recomputation)."""

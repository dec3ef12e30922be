"""Lowering of ``nn.Upsample`` / ``F.interpolate`` (nearest, linear, bilinear) to RESIZE.

RESIZE (docs/qgraph.md §4.4) reads two taps per output position and spatial axis; this
module derives them from the call's options:

* nearest (and nearest-exact): the source index of every output position is torch's own,
  read off by running the call on a probe tensor whose values are the positions along one
  axis (exact in binary32 below 2^24), so it is bit-identical whatever torch's float rule;
  weights 0, ``frac_bits`` 0.  The result is a copy of input codes: on a quantized value at the
  same grid (the identity stage) exact, and on a pending layer result the value is first
  materialized at the next quantizer's grid (nearest commutes with quantization);
* linear / bilinear: torch's source coordinate in exact rational arithmetic,
  ``src = r·(j + 1/2) - 1/2`` clamped at 0 (``align_corners`` False; ``r = 1/scale_factor``
  when a scale factor is given, else ``in/out``), or ``src = r·j`` with ``r = (in-1)/(out-1)``
  (``align_corners`` True); ``i0 = min(floor(src), in - 1)``, ``λ = src - i0`` and the second tap's
  weight ``floor(λ·2^F + 1/2)`` with ``F`` = :data:`FRAC_BITS`.  The output stage's factor is
  ``s_in / (s_out · 2^(F·rank))``, so the interpolation rounds once, at the output quantizer.
  A pending layer result is read as its raw int32 accumulator (as an average pool reads it).

Anything else (bicubic, area, antialias, 3-D) is an :class:`ExportError` naming the call.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Callable

import attrs
import numpy as np
import torch
from torch import nn

from qdsl.export.lower_layers import raw
from qdsl.export.values import Builder, ExportError, Pending, QVal, Target
from qdsl.graph.ir import DType, OpType, Rescale
from qdsl.graph.ops.resize import MAX_FRAC_BITS
from qdsl.graph.requant import make_rescale

__all__ = ["FRAC_BITS", "ResizeCall", "module_call", "function_call", "linear_taps", "resize_value"]

FRAC_BITS = MAX_FRAC_BITS
"""Fraction bits of the linear weights: the weight error is at most 2^-12, i.e. below 0.07 of an
input LSB per axis for 8-bit codes (docs/qgraph.md §4.4)."""

_INTERPOLATE_ARGS = ("size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")


@attrs.frozen
class ResizeCall:
    """One upsample call: its options and a function that runs it on a float tensor."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    mode: str
    align_corners: bool = attrs.field(converter=bool)
    scale_factor: Any
    recompute: bool | None
    """``recompute_scale_factor``: when set, torch derives the coordinates from the sizes."""
    antialias: bool


def module_call(m: nn.Module) -> ResizeCall:
    """An ``nn.Upsample`` (or UpsamplingNearest2d / UpsamplingBilinear2d) module's call; its
    ``forward`` is taken directly, so qdsl's hooks do not run on the probes."""
    return ResizeCall(m.forward, m.mode, m.align_corners, m.scale_factor, getattr(m, "recompute_scale_factor", None),
                      False)


def function_call(fn, args, kwargs) -> ResizeCall:
    """An ``F.interpolate(x, ...)`` call."""
    opts = dict(zip(_INTERPOLATE_ARGS, args[1:]))
    opts.update(kwargs)
    rest, kw = tuple(args[1:]), dict(kwargs)
    return ResizeCall(lambda t: fn(t, *rest, **kw), opts.get("mode", "nearest"), opts.get("align_corners"),
                      opts.get("scale_factor"), opts.get("recompute_scale_factor"), bool(opts.get("antialias", False)))


def _nearest_taps(call: ResizeCall, in_shape, out_spatial) -> list[list[int]]:
    rank = len(out_spatial)
    taps = []
    for d in range(rank):
        sizes = [1] * rank
        sizes[d] = in_shape[2 + d]
        probe = torch.arange(in_shape[2 + d], dtype=torch.float32).reshape([1, 1] + sizes)
        probe = probe.expand([1, 1] + list(in_shape[2:])).contiguous()
        with torch.no_grad():
            out = call.fn(probe)
        line = out.reshape(out.shape[2:])[(0,) * d + (slice(None),) + (0,) * (rank - 1 - d)]
        taps.append([int(v) for v in line.tolist()])
    return taps


def linear_taps(n_in: int, n_out: int, align_corners: bool, scale: Any, frac_bits: int = FRAC_BITS):
    """``(i0, weight)`` lists of one axis (module doc): torch's linear source coordinate in
    exact rationals, the second tap's weight rounded half up to ``frac_bits``."""
    if align_corners:
        r = Fraction(n_in - 1, n_out - 1) if n_out > 1 else Fraction(0)
    elif scale is not None and float(scale) > 0:
        r = 1 / Fraction(float(scale))
    else:
        r = Fraction(n_in, n_out)
    i0s, ws = [], []
    for j in range(n_out):
        src = r * j if align_corners else max(r * (2 * j + 1) / 2 - Fraction(1, 2), Fraction(0))
        i0 = min(math.floor(src), n_in - 1)
        lam = src - i0 if i0 < n_in - 1 else Fraction(0)  # the last position has one tap
        i0s.append(i0)
        ws.append(math.floor(lam * (1 << frac_bits) + Fraction(1, 2)))
    return i0s, ws


def _per_axis(value: Any, rank: int) -> list:
    if isinstance(value, (tuple, list)):
        return list(value)
    return [value] * rank


def resize_value(b: Builder, where: str, x: Any, call: ResizeCall, shape) -> Any:
    """The RESIZE lowering of ``call`` on ``x`` (a QVal or a pending result; module doc)."""
    rank = len(shape) - 2
    mode = call.mode
    if rank not in (1, 2) or call.antialias or mode not in ("nearest", "nearest-exact", "linear", "bilinear"):
        raise ExportError(where, f"upsampling with mode={mode!r}{', antialias' if call.antialias else ''} on a "
                                 f"rank-{len(shape)} tensor has no integer lowering",
                          "use mode 'nearest', 'linear' (1-D) or 'bilinear' (2-D), without antialias")
    in_shape = x.shape
    out_spatial = tuple(shape[2:])
    size = {"size": out_spatial}
    if mode.startswith("nearest"):
        idx = _nearest_taps(call, in_shape, out_spatial)
        a = dict(size, index=tuple(i for axis in idx for i in axis), weight=(0,) * sum(out_spatial), frac_bits=0)
        return _nearest(b, where, x, a, shape)
    given = call.scale_factor is not None and not call.recompute  # else torch uses in/out
    scales = _per_axis(call.scale_factor, rank) if given else [None] * rank
    index, weight = [], []
    for d in range(rank):
        i0, w = linear_taps(in_shape[2 + d], out_spatial[d], call.align_corners, scales[d])
        index += i0
        weight += w
    a = dict(size, index=tuple(index), weight=tuple(weight), frac_bits=FRAC_BITS)
    scale_div = float(1 << (FRAC_BITS * rank))
    if isinstance(x, QVal) and x.dtype in (DType.I8, DType.U8):
        v, s_in = x, x.scale
    elif isinstance(x, Pending):
        v, per_channel = raw(b, x, where)  # the exact int32 accumulator (or its wide form)
        s_in = per_channel if per_channel is not None else v.scale
    else:
        raise _unquantized(where, x)

    def emit(bld: Builder, t: Target, lo: float, hi: float):
        if t.dtype not in (DType.I8, DType.U8):
            raise ExportError(where, f"the upsampled value must be int8-quantized, not {t.dtype.name} ({t.where})")
        out_min, out_max = t.clamp_codes(lo, hi)
        factors = np.asarray(s_in, dtype=np.float64) / (scale_div * t.scale)
        factors = float(factors) if factors.ndim == 0 else factors
        attrs_ = dict(a, in_zp=v.zp, **_rescale(bld, factors, t, where).attrs(),
                      out_zp=t.zp, out_min=out_min, out_max=out_max)
        return bld.op(OpType.RESIZE, where, [v.name], t.dtype, shape, attrs_, out=f"{where}:resize"), shape

    return Pending("resize", where, shape, emit)


def _rescale(bld: Builder, factors, t: Target, where: str) -> Rescale:
    try:
        return make_rescale(factors, t.rounding, True, single=bld.single_rounding)
    except ValueError as e:
        raise ExportError(where, f"the upsample's requantization factor is out of range ({e})") from None


def _identity(dtype: DType) -> dict:
    lo, hi = dtype.range
    return dict(in_zp=0, **Rescale.identity().attrs(), out_zp=0, out_min=lo, out_max=hi)


def _nearest(b: Builder, where: str, x: Any, a: dict, shape) -> Any:
    """A copy of codes: ``x - 0`` through the identity stage, clamped to the dtype (no-op)."""
    if isinstance(x, QVal):
        if x.dtype not in (DType.I8, DType.U8):
            raise ExportError(where, f"nearest upsampling of a {x.dtype.name} value has no integer lowering",
                              "quantize its input to int8/uint8")
        name = b.op(OpType.RESIZE, where, [x.name], x.dtype, shape, dict(a, **_identity(x.dtype)),
                    out=f"{where}:resize")
        return b.q(name, x.scale, x.zp, x.qmin, x.qmax, x.dtype, shape)
    if not isinstance(x, Pending):
        raise _unquantized(where, x)
    inner = x

    def emit(bld: Builder, t: Target, lo: float, hi: float):
        # nearest copies values, so it commutes with the quantizer and any clamp after it
        v = inner.clamped(lo, hi).materialize(bld, t)
        if v.dtype not in (DType.I8, DType.U8):
            raise ExportError(where, f"nearest upsampling to a {v.dtype.name} value has no integer lowering")
        return bld.op(OpType.RESIZE, where, [v.name], v.dtype, shape, dict(a, **_identity(v.dtype)),
                      out=f"{where}:resize"), shape

    return Pending("resize", where, shape, emit)


def _unquantized(where: str, x: Any) -> ExportError:
    origin = getattr(x, "origin", "?")
    return ExportError(where, f"the upsample reads an unquantized value from '{origin}'",
                       f"quantize it: add `output = a8` (any activation quantizer) for '{origin}' in the spec")

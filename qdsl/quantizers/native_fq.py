"""One-pass fake quantization for the evaluation fast path, in the native library.

:func:`qdsl.quantizers.eval_fast.fast` (the quantizers' evaluation path) fake-quantizes with
four or five torch passes over the tensor (multiply by ``1/s``, round, clamp, the NaN
check, multiply by ``s``); on the small activations of a transformer encoder each pass costs
a dispatch of several microseconds besides its memory traffic.  :func:`fake_quant` does the
same arithmetic in one C++ pass (``csrc/kernels/fake_quant.h`` states the formula step by
step), and :func:`aminmax` the dynamic quantizer's range in one more.

Guarantees:

* The result equals the torch passes bit for bit for scalar clamp bounds (per-tensor, and
  per-channel with one zero point), including the sign of zeros, NaN -> +0.0 and
  infinities; with per-channel zero points (tensor bounds) it is equal as numbers: torch's
  own clamp with tensor bounds gives -0.0 or +0.0 for a rounded -0.0 depending on where in
  its vector loop the element falls.  ``tests/quantizers/test_native_fq.py`` checks both.
* It runs only on the CPU, for float32 tensors that are dense in memory (contiguous,
  channels_last, any permutation) with one scale per tensor or per channel along one axis,
  outside autograd and outside a traced (``torch.compile``) region; everything else returns
  None and the caller runs the torch passes.  Single-threaded, like the torch passes it
  replaces (the quantizer runs them at one thread).
* ``QDSL_NATIVE_FQ=0`` in the environment turns it off.  The variable is read once, when
  this module is imported (reading it at each call cost ~1 us per quantizer call, a
  dispatch's worth); :func:`set_enabled` switches the kernels at run time
  (``set_enabled(None)`` reads the environment again), :func:`disabled` for a block.
  Without the native library (not built, or built before these kernels) it is off.

The library file is found beside the runtime package that builds it (setup.py names it
``qdsl.runtime._qdsl_native``) and is loaded here with its own ctypes handle (the OS shares
one copy): the runtime package is a higher layer than the quantizers, so it is not imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Iterator

import torch

from qdsl._native_files import library_files

__all__ = ["available", "fake_quant", "fake_quant_minifloat", "aminmax", "enabled", "set_enabled", "disabled",
           "STATS"]

_p, _i64, _f, _u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_uint32
_SIGNATURES = {
    "qdsl_fake_quant_f32": [_p, _p, _i64, _f, _f, _f, _f, _u32],
    "qdsl_fake_quant_f32_channels": [_p, _p, _i64, _i64, _i64, _p, _p, _p, _p, _f, _f, _u32],
    "qdsl_minmax_f32": [_p, _i64, _p, _u32],
    "qdsl_fake_quant_minifloat_f32": [_p, _p, _i64, _f, _f, ctypes.c_int32, ctypes.c_int32, _u32, _u32],
}

_fns: dict | None = None
_loaded = False


def _load() -> dict | None:
    global _fns, _loaded
    _loaded = True
    for path in library_files():
        if not path.exists():
            continue
        try:
            handle = ctypes.CDLL(str(path))
            fns = {}
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(handle, name)
                fn.restype, fn.argtypes = ctypes.c_int, argtypes
                fns[name] = fn
        except (OSError, AttributeError):  # unloadable, or a library built before these kernels
            return None
        _fns = fns
        return fns
    return None


def available() -> bool:
    """The native library is loaded and has the fake-quant kernels."""
    return (_fns if _loaded else _load()) is not None


def _env_switch() -> bool:
    return os.environ.get("QDSL_NATIVE_FQ", "1") != "0"


_switch = _env_switch()
"""The user's switch: ``QDSL_NATIVE_FQ`` as read at import, or the last :func:`set_enabled`."""


def enabled() -> bool:
    """:func:`available` and switched on (``QDSL_NATIVE_FQ`` at import, :func:`set_enabled`)."""
    return _switch and (_fns is not None if _loaded else available())


def set_enabled(on: bool | None) -> bool:
    """Switch the native kernels on or off for this process (``None``: as ``QDSL_NATIVE_FQ``
    says now); returns the previous setting.  Either way the results are the same values
    (see the module docstring); only the speed differs."""
    global _switch
    prev = _switch
    _switch = _env_switch() if on is None else bool(on)
    return prev


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """The torch passes instead of the native kernels inside the block (tests, A/B timing)."""
    prev = set_enabled(False)
    try:
        yield
    finally:
        set_enabled(prev)


class _Stats:
    """How many calls the native kernels served (tests check the path is taken)."""

    def __init__(self) -> None:
        self.fake_quant = 0
        self.aminmax = 0
        self.minifloat = 0

    def reset(self) -> None:
        self.fake_quant = self.aminmax = self.minifloat = 0


STATS = _Stats()


def _usable(x: torch.Tensor) -> bool:
    return (x.dtype is torch.float32 and x.is_cpu and x.numel() > 0
            and not (x.requires_grad and torch.is_grad_enabled()) and not torch.compiler.is_compiling())


def _dense(x: torch.Tensor) -> bool:
    """Every element at its own offset in one block of ``numel`` floats (any dim order)."""
    if x.is_contiguous():
        return True
    expect = 1
    for st, n in sorted((x.stride(d), x.size(d)) for d in range(x.dim()) if x.size(d) != 1):
        if st != expect:
            return False
        expect *= n
    return True


def _channel_axis(s: torch.Tensor, x: torch.Tensor) -> int | None:
    """The one axis a broadcast parameter view varies along (param_view's ``[1,..,C,..,1]``)."""
    if s.dim() != x.dim():
        return None
    axes = [d for d in range(s.dim()) if s.size(d) != 1]
    if len(axes) != 1 or s.size(axes[0]) != x.size(axes[0]):
        return None
    return axes[0]


def _row(p, c: int) -> int | None:
    """The data pointer of a contiguous float32 parameter of ``c`` values, else None."""
    if not isinstance(p, torch.Tensor) or p.dtype is not torch.float32 or p.numel() != c or not p.is_contiguous():
        return None
    return p.data_ptr()


def fake_quant(x: torch.Tensor, v: tuple, path: int = 0) -> torch.Tensor | None:
    """``clamp(round(x·inv), lo, hi)·s`` with NaN -> +0.0 for the views ``v = (s, inv, lo, hi,
    fingerprint)`` of ``eval_fast.views_for`` (or the dynamic path's Python numbers),
    in one pass; None where it does not apply (see the module docstring).  ``path``: the
    kernel path mask of ``c_api.h`` (tests force the portable one)."""
    if not _usable(x) or not enabled() or not _dense(x):
        return None
    fns = _fns
    s, inv, lo, hi, fp = v
    if fp is not None:  # views_fingerprint: ("affine", s, inv, lo, hi) as Python numbers
        _, s, inv, lo, hi = fp
    if isinstance(s, torch.Tensor) and s.numel() == 1 and isinstance(inv, torch.Tensor) and inv.numel() == 1:
        s, inv = float(s), float(inv)
    if isinstance(s, float) and isinstance(inv, float):
        if not (isinstance(lo, int) and isinstance(hi, int)):
            return None
        out = torch.empty_like(x)
        rc = fns["qdsl_fake_quant_f32"](x.data_ptr(), out.data_ptr(), x.numel(), s, inv, lo, hi, path)
    else:
        if not isinstance(s, torch.Tensor):
            return None
        ax = _channel_axis(s, x)
        if ax is None:
            return None
        c = x.size(ax)
        ps, pinv = _row(s, c), _row(inv, c)
        if ps is None or pinv is None:
            return None
        if isinstance(lo, int) and isinstance(hi, int):
            plo = phi = None
            lo0, hi0 = float(lo), float(hi)
        else:
            plo, phi = _row(lo, c), _row(hi, c)
            if plo is None or phi is None:
                return None
            lo0 = hi0 = 0.0
        inner = x.stride(ax)
        outer = x.numel() // (inner * c)
        out = torch.empty_like(x)  # x's memory order: the kernel writes each value at x's offset
        rc = fns["qdsl_fake_quant_f32_channels"](x.data_ptr(), out.data_ptr(), outer, c, inner,
                                                  ps, pinv, plo, phi, lo0, hi0, path)
    if rc != 0:
        return None
    STATS.fake_quant += 1
    return out


def fake_quant_minifloat(x: torch.Tensor, s: float, top: float, emin: int, mantissa: int, nan_bits: int,
                         path: int = 0) -> torch.Tensor | None:
    """``minifloat_round(x / s)·s`` for a minifloat with one scale ``s`` (a binary32 value),
    largest value ``top``, smallest normal exponent ``emin`` and ``mantissa`` bits, the way
    MinifloatOps.fake computes it through torch's float8 cast and decode table, where a NaN
    decodes to ``nan_bits`` with its sign (``csrc/kernels/fake_quant.h``); one pass, bit for
    bit; None where it does not apply."""
    if not _usable(x) or not enabled() or not _dense(x):
        return None
    out = torch.empty_like(x)
    if _fns["qdsl_fake_quant_minifloat_f32"](x.data_ptr(), out.data_ptr(), x.numel(), s, top, emin, mantissa,
                                               nan_bits, path) != 0:
        return None
    STATS.minifloat += 1
    return out


def aminmax(x: torch.Tensor, path: int = 0) -> tuple[float, float]:
    """``torch.aminmax(x)`` as Python floats (NaN for both when ``x`` holds a NaN; the sign
    of a zero extreme may differ, which no scale or zero point computed from it sees), in
    one native pass when it applies, else through torch."""
    if _usable(x) and x.is_contiguous() and enabled():
        buf = (ctypes.c_float * 2)()
        if _fns["qdsl_minmax_f32"](x.data_ptr(), x.numel(), ctypes.addressof(buf), path) == 0:
            STATS.aminmax += 1
            return buf[0], buf[1]
    lo, hi = torch.aminmax(x)
    return lo.item(), hi.item()

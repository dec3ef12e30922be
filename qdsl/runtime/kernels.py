"""Low-level kernel entry points (numpy in, numpy out) for tests and benchmarks.

Each function validates its numpy arguments, calls one C ABI function, and raises
:class:`RuntimeError_` with the C++ message on failure.  ``path`` forces a kernel
path ("ref", "portable", "avx2"); "auto" uses the enabled default (``QDSL_KERNELS``).
Semantics (exact, int32 wrapping)::

    gemm:         acc[m, n] = bias[n] + sum_k (a[m, k] - a_zp) * (w[n, k] - w_zp[n])
    binary_gemm:  acc[m, n] = bias[n] + K - 2 * popcount(bits(a[m]) ^ bits(w[n]))
    requantize:   clamp(rescale(acc) + zp, qmin, qmax), docs/qgraph.md §4.1-4.2
"""

from __future__ import annotations

import ctypes

import numpy as np

from qdsl.runtime import _native
from qdsl.runtime.errors import STATUS_NAMES, RuntimeError_, RuntimeUnavailable

__all__ = [
    "PATHS",
    "PackedWeights",
    "OutputStage",
    "pack_weights",
    "gemm",
    "bitpack",
    "binary_gemm",
    "requantize",
    "paths",
]

PATHS = {"auto": 0, "ref": 1, "portable": 2, "avx2": 4, "avxvnni": 8, "avx512": 16, "amx": 32}
_DTYPES = {np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.int32): 2}
_ERRLEN = 1024


def _lib():
    lib = _native.lib()
    if lib is None:
        raise RuntimeUnavailable(f"qdsl C++ runtime unavailable: {_native.load_error()}")
    return lib


def _call(fn, *args) -> None:
    err = ctypes.create_string_buffer(_ERRLEN)
    code = fn(*args, err, _ERRLEN)
    if code != 0:
        raise RuntimeError_(err.value.decode("utf-8", "replace"), STATUS_NAMES.get(code, str(code)))


_addressof, _char_from_buffer = ctypes.addressof, ctypes.c_char.from_buffer


def _ptr(arr: np.ndarray | None) -> int | None:
    """Data address of a C-contiguous array.  ``c_char.from_buffer`` costs a quarter of
    ``arr.ctypes.data`` (which builds a helper object per call); read-only or empty
    buffers take the slow way."""
    if arr is None:
        return None
    try:
        return _addressof(_char_from_buffer(arr))
    except (TypeError, ValueError):
        return arr.ctypes.data


def _path(path: str) -> int:
    if path not in PATHS:
        raise RuntimeError_(f"unknown kernel path {path!r}; known: {', '.join(PATHS)}")
    return PATHS[path]


def paths() -> dict[str, list[str]]:
    """Which paths are compiled, supported by this CPU, and enabled."""
    lib = _lib()
    names = [n for n in PATHS if n != "auto"]
    return {
        which: [n for n in names if lib.qdsl_paths(i) & PATHS[n]]
        for i, which in enumerate(("compiled", "cpu", "enabled"))
    }


def evex_vnni() -> bool:
    """Whether the AVX2 path runs its u8*s8 kernels as EVEX ``vpdpbusd`` (a CPU with AVX512_VNNI +
    AVX512VL but used through the AVX2 path, e.g. AMD Zen 4; ``QDSL_EVEX_VNNI=0`` turns it off):
    exact for any activation codes, so those kernels need no activation bound."""
    return bool(_lib().qdsl_paths(3))


class PackedWeights:
    """Weights packed once for the optimized kernels (freed with the object)."""

    def __init__(self, handle: int, n: int, k: int, bits: int):
        self._handle = ctypes.c_void_p(handle)
        self.n, self.k, self.bits = n, k, bits

    @property
    def nbytes(self) -> int:
        return int(_lib().qdsl_weights_bytes(self._handle))

    def __del__(self):
        lib = _native.lib()
        if lib is not None and self._handle:
            lib.qdsl_free_weights(self._handle)
            self._handle = ctypes.c_void_p(0)


class OutputStage:
    """Output stage ``clamp(rescale(acc) + zero_point, qmin, qmax)``: ``kind`` 0 FIXED / 1 POT,
    per-tensor (length-1) or per-channel int32 multiplier/shift, POT ``rounding`` code."""

    def __init__(self, multiplier, shift, zero_point: int = 0, qmin: int = -128, qmax: int = 127,
                 kind: int = 0, rounding: int = 0):
        self.kind, self.rounding = int(kind), int(rounding)
        self.multiplier = np.ascontiguousarray(np.atleast_1d(multiplier), dtype=np.int32)
        self.shift = np.ascontiguousarray(np.atleast_1d(shift), dtype=np.int32)
        if self.multiplier.shape != self.shift.shape or self.multiplier.ndim != 1:
            raise RuntimeError_("multiplier and shift must be 1-D arrays of the same length")
        self.zero_point, self.qmin, self.qmax = int(zero_point), int(qmin), int(qmax)


def pack_weights(w: np.ndarray, bits: int = 8, zero_point=None) -> PackedWeights:
    """Pack int8 values ``w[n, k]`` (in the ``bits`` range; bits=1 means +1/-1 values)."""
    w = np.ascontiguousarray(w, dtype=np.int8)
    if w.ndim != 2:
        raise RuntimeError_(f"weights must be 2-D [n, k], got shape {w.shape}")
    zp = None
    if zero_point is not None:
        zp = np.ascontiguousarray(np.broadcast_to(np.asarray(zero_point, dtype=np.int32), (w.shape[0],)))
    handle = ctypes.c_void_p()
    _call(_lib().qdsl_pack_weights, _ptr(w), w.shape[0], w.shape[1], bits, _ptr(zp), ctypes.byref(handle))
    return PackedWeights(handle.value, w.shape[0], w.shape[1], bits)


def _aligned_empty(shape: tuple[int, int], dtype) -> np.ndarray:
    """An uninitialised array starting on a 64-byte boundary: the AMX path stores its
    accumulator tiles straight into int32 outputs that are (csrc/gemm.cc)."""
    dtype = np.dtype(dtype)
    nbytes = shape[0] * shape[1] * dtype.itemsize
    raw = np.empty(nbytes + 64, dtype=np.uint8)
    off = (-_ptr(raw)) % 64
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def _out(m: int, n: int, stage: OutputStage | None, out_dtype) -> np.ndarray:
    return _aligned_empty((m, n), np.int32 if stage is None else out_dtype)


def _stage_args(stage: OutputStage | None):
    if stage is None:
        return (None, None, 0, 0, 0, 0, 0, 0)
    return (_ptr(stage.multiplier), _ptr(stage.shift), stage.multiplier.shape[0], stage.kind, stage.rounding,
            stage.zero_point, stage.qmin, stage.qmax)


def _bias(bias, n: int):
    if bias is None:
        return None
    b = np.ascontiguousarray(bias, dtype=np.int32)
    if b.shape != (n,):
        raise RuntimeError_(f"bias must have shape ({n},), got {b.shape}")
    return b


_A_CODES = {"b": 0, "B": 1}  # dtype.char of int8 / uint8
_SCRATCH_ERR = ctypes.create_string_buffer(_ERRLEN)  # fast calls' error text (never read: redone by _call)


def gemm(a: np.ndarray, w: PackedWeights, *, a_zero_point: int = 0, bias=None, stage: OutputStage | None = None,
         out_dtype=np.int8, path: str = "auto", a_max_code: int = 255) -> np.ndarray:
    """``a[m, k]`` (int8/uint8) x packed int weights -> int32, or int8/uint8 with ``stage``.

    ``a_max_code`` bounds the activation codes (uint8: the values, int8: the values + 128),
    e.g. 127 for 7-bit or 15 for 4-bit unsigned activations: on AVX2 without VNNI this lets
    wider weights take the exact ``vpmaddubsw`` kernel.  It is checked: codes above it raise."""
    if type(a) is np.ndarray and a.ndim == 2 and a.flags.c_contiguous:
        code, mask = _A_CODES.get(a.dtype.char), PATHS.get(path)
        if code is not None and mask is not None:  # fast calls; a failure is redone below for its message
            if stage is None and bias is None and a_max_code == 255:
                out = _aligned_empty((a.shape[0], w.n), np.int32)
                if _lib().qdsl_gemm_i32(_ptr(a), code, a.shape[0], a.shape[1], a_zero_point, w._handle, _ptr(out),
                                        mask) == 0:
                    return out
            elif ((bias is None or (type(bias) is np.ndarray and bias.dtype == np.int32 and bias.shape == (w.n,)
                                    and bias.flags.c_contiguous))
                  and (stage is None or np.dtype(out_dtype) in _DTYPES)):
                # the general entry without the argument normalisation below (a few microseconds
                # per call: GEMV-like shapes take tens); its error text goes to a scratch buffer
                out = _aligned_empty((a.shape[0], w.n), np.int32 if stage is None else out_dtype)
                if _lib().qdsl_gemm(_ptr(a), code, a.shape[0], a.shape[1], a.shape[1], a_zero_point, a_max_code,
                                    w._handle, _ptr(bias), _ptr(out), _DTYPES[out.dtype], w.n, *_stage_args(stage),
                                    mask, _SCRATCH_ERR, _ERRLEN) == 0:
                    return out
    if a.dtype not in (np.int8, np.uint8) or a.ndim != 2:
        raise RuntimeError_(f"activations must be a 2-D int8/uint8 array, got {a.dtype} {a.shape}")
    a = np.ascontiguousarray(a)
    b = _bias(bias, w.n)
    out = _out(a.shape[0], w.n, stage, out_dtype)
    _call(_lib().qdsl_gemm, _ptr(a), _DTYPES[a.dtype], a.shape[0], a.shape[1], a.shape[1], int(a_zero_point),
          int(a_max_code), w._handle, _ptr(b), _ptr(out), _DTYPES[out.dtype], w.n, *_stage_args(stage), _path(path))
    return out


def bitpack(signs: np.ndarray) -> np.ndarray:
    """+1/-1 int8 ``[m, k]`` -> uint64 ``[m, ceil(k/64)]`` (bit 1 = -1, padding bits 0)."""
    s = np.ascontiguousarray(signs, dtype=np.int8)
    if s.ndim != 2:
        raise RuntimeError_(f"signs must be 2-D, got shape {s.shape}")
    kwords = (s.shape[1] + 63) // 64
    out = np.empty((s.shape[0], kwords), dtype=np.uint64)
    _call(_lib().qdsl_bitpack, _ptr(s), s.shape[0], s.shape[1], _ptr(out), kwords)
    return out


def binary_gemm(a_bits: np.ndarray, w: PackedWeights, *, bias=None, stage: OutputStage | None = None,
                out_dtype=np.int8, path: str = "auto") -> np.ndarray:
    """Bit-packed activations (from :func:`bitpack`) x packed binary weights."""
    if w.bits != 1:
        raise RuntimeError_("binary_gemm needs weights packed with bits=1")
    a = np.ascontiguousarray(a_bits, dtype=np.uint64)
    kwords = (w.k + 63) // 64
    if a.ndim != 2 or a.shape[1] != kwords:
        raise RuntimeError_(f"bit-packed activations must have shape [m, {kwords}], got {a.shape}")
    b = _bias(bias, w.n)
    out = _out(a.shape[0], w.n, stage, out_dtype)
    _call(_lib().qdsl_binary_gemm, _ptr(a), a.shape[0], kwords, w._handle, _ptr(b), _ptr(out), _DTYPES[out.dtype],
          w.n, *_stage_args(stage), _path(path))
    return out


def requantize(acc: np.ndarray, stage: OutputStage, out_dtype=np.int8, path: str = "auto") -> np.ndarray:
    """Output stage over ``acc[rows, channels]`` (int32); channels is the last axis."""
    acc = np.ascontiguousarray(acc, dtype=np.int32)
    if acc.ndim != 2:
        raise RuntimeError_(f"acc must be 2-D [rows, channels], got shape {acc.shape}")
    out = np.empty(acc.shape, dtype=np.dtype(out_dtype))
    _call(_lib().qdsl_requantize, _ptr(acc), acc.shape[0], acc.shape[1], *_stage_args(stage), _ptr(out),
          _DTYPES[out.dtype], _path(path))
    return out

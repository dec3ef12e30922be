"""Locating and loading the compiled kernel library (``_qdsl_native*.so``) with ctypes.

Guarantees: importing this module never raises; ``lib()`` returns the loaded library
or ``None``, and ``load_error()`` says why it is ``None`` (not built, wrong ABI
version, loader error).  ``QDSL_RUNTIME_LIB`` may point at a library file to load
instead (used by the sanitizer script and by developers building by hand).
"""

from __future__ import annotations

import ctypes

from qdsl._native_files import library_files

__all__ = ["lib", "load_error", "ABI_VERSION"]

ABI_VERSION = 1

_c_int, _i64, _u32, _i32 = ctypes.c_int, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int32
_p = ctypes.c_void_p
_ERR = ctypes.c_char_p

# output stage: multiplier, shift, channels, kind, rounding, zero point, qmin, qmax
_STAGE = [_p, _p, _i64, _c_int, _c_int, _i32, _i32, _i32]

# name -> (restype, argtypes)
_SIGNATURES = {
    "qdsl_abi_version": (_c_int, []),
    "qdsl_paths": (_u32, [_c_int]),
    "qdsl_set_enabled_paths": (None, [_u32]),
    "qdsl_set_num_threads": (None, [_c_int]),
    "qdsl_get_num_threads": (_c_int, []),
    "qdsl_pack_weights": (_c_int, [_p, _i64, _i64, _c_int, _p, ctypes.POINTER(_p), _ERR, _i64]),
    "qdsl_free_weights": (None, [_p]),
    "qdsl_weights_bytes": (_i64, [_p]),
    "qdsl_bitpack": (_c_int, [_p, _i64, _i64, _p, _i64, _ERR, _i64]),
    "qdsl_gemm": (
        _c_int,
        [_p, _c_int, _i64, _i64, _i64, _i32, _i32, _p, _p, _p, _c_int, _i64] + _STAGE + [_u32, _ERR, _i64],
    ),
    "qdsl_gemm_i32": (_c_int, [_p, _c_int, _i64, _i64, _i32, _p, _p, _u32]),
    "qdsl_binary_gemm": (
        _c_int,
        [_p, _i64, _i64, _p, _p, _p, _c_int, _i64] + _STAGE + [_u32, _ERR, _i64],
    ),
    "qdsl_graph_load": (_c_int, [_p, _i64, ctypes.POINTER(_p), _ERR, _i64]),
    "qdsl_graph_free": (None, [_p]),
    "qdsl_graph_entry": (_i64, [_p, _c_int, _i64, ctypes.POINTER(_i64), ctypes.c_char_p, _i64]),
    "qdsl_graph_run": (_c_int, [_p, _i64, ctypes.POINTER(_p), ctypes.POINTER(_p), _u32, _ERR, _i64]),
    "qdsl_graph_overflow": (None, [_p, ctypes.POINTER(_i64), _i64]),
    "qdsl_requantize": (_c_int, [_p, _i64, _i64] + _STAGE + [_p, _c_int, _u32, _ERR, _i64]),
}

_lib: ctypes.CDLL | None = None
_error: str | None = None
_loaded = False


def _load() -> None:
    global _lib, _error, _loaded
    _loaded = True
    tried = []
    for path in library_files():
        if not path.exists():
            tried.append(str(path.name))
            continue
        try:
            handle = ctypes.CDLL(str(path))
        except OSError as exc:
            _error = f"cannot load {path.name}: {exc}"
            return
        missing = [name for name in _SIGNATURES if not hasattr(handle, name)]
        if missing:
            _error = f"{path.name} lacks {', '.join(missing)} (stale build? reinstall with pip install -e .)"
            return
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(handle, name)
            fn.restype = restype
            fn.argtypes = argtypes
        version = handle.qdsl_abi_version()
        if version != ABI_VERSION:
            _error = f"{path.name} has ABI version {version}, expected {ABI_VERSION} (reinstall with pip install -e .)"
            return
        _lib = handle
        return
    _error = "the C++ runtime was not built (none of " + ", ".join(tried) + " found; run pip install -e .)"


def lib() -> ctypes.CDLL | None:
    if not _loaded:
        _load()
    return _lib


def load_error() -> str | None:
    if not _loaded:
        _load()
    return _error

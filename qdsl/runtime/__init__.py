"""qdsl.runtime: the compiled C++ integer runtime (csrc/), loaded with ctypes.

Guarantees: importing never fails.  ``available()`` tells whether the library loaded,
``load_error()`` why not.  ``CompiledGraph`` runs a whole ``.qgraph`` in one native call
and equals ``qdsl.graph.reference`` bit for bit; ``qdsl.runtime.kernels`` exposes the
individual kernels.  Threads: ``set_num_threads(n)`` (default ``QDSL_NUM_THREADS`` or all
cores).  ``QDSL_KERNELS=reference`` forces the scalar reference kernels.
"""

from __future__ import annotations

from qdsl.runtime import _native
from qdsl.runtime.errors import RuntimeError_, RuntimeUnavailable
from qdsl.runtime.graph import CompiledGraph

__all__ = [
    "CompiledGraph",
    "available",
    "load_error",
    "set_num_threads",
    "get_num_threads",
    "set_kernel_paths",
    "RuntimeError_",
    "RuntimeUnavailable",
]


def available() -> bool:
    """True when the compiled library is loaded and usable."""
    return _native.lib() is not None


def load_error() -> str | None:
    """Why the library is unavailable (None when it is available)."""
    return _native.load_error()


def _lib():
    lib = _native.lib()
    if lib is None:
        raise RuntimeUnavailable(f"qdsl C++ runtime unavailable: {_native.load_error()}")
    return lib


def set_num_threads(n: int) -> None:
    """Threads used by every kernel; ``n <= 0`` restores the default."""
    _lib().qdsl_set_num_threads(int(n))


def get_num_threads() -> int:
    return int(_lib().qdsl_get_num_threads())


def set_kernel_paths(paths: str | None) -> None:
    """Restrict the enabled kernel paths process-wide: "reference", "portable", "avx2",
    "avxvnni", "avx512", "amx", or None to restore the ``QDSL_KERNELS`` default."""
    masks = {None: 0, "reference": 1, "portable": 1 | 2, "avx2": 1 | 2 | 4, "avxvnni": 1 | 2 | 4 | 8, "avx512": 31,
             "amx": 63}
    if paths not in masks:
        raise RuntimeError_(f"unknown kernel paths {paths!r}; known: {', '.join(k for k in masks if k)}")
    _lib().qdsl_set_enabled_paths(masks[paths])

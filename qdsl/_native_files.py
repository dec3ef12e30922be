"""Where the compiled kernel library (``_qdsl_native*.so``, built from csrc/) is looked for.

One place for its two loaders: qdsl.runtime._native (the integer runtime) and
qdsl.quantizers.native_fq (the eval fake-quant kernels; a lower layer, which may not import
the runtime).  ``QDSL_RUNTIME_LIB`` names another build.
"""

from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path

__all__ = ["library_files"]


def library_files() -> list[Path]:
    """The files to try, in order."""
    override = os.environ.get("QDSL_RUNTIME_LIB")
    if override:
        return [Path(override)]
    folder = Path(__file__).resolve().parent / "runtime"
    return [folder / f"_qdsl_native{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]

"""Build of the C++ kernel library (csrc/) as a plain shared library with a C ABI.

The library is built as a setuptools ``Extension`` only to get a compiler, flags and
an install location for free; it exports plain C functions (csrc/bindings/c_api.h)
and is loaded with ctypes by ``qdsl.runtime``, so it needs no Python headers at run
time and no build dependency beyond a C++17 compiler.

A failed compile fails the install on purpose: the README promises the fast runtime,
and CI should say so loudly.  To install without it (e.g. no compiler), set
``QDSL_SKIP_NATIVE=1``; qdsl then runs graphs on the Python reference executor.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).parent
CSRC = "csrc"


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386", "x86")
_X86_SUFFIXES = ("_avx2.cc", "_avxvnni.cc", "_avx512.cc")


def _sources() -> list[str]:
    """Every .cc under csrc/ except the C++ tests; x86 kernels only on x86 machines
    (dispatch.cc compiles its x86 branches only there, so the rest stays portable)."""
    out = []
    for path in sorted((ROOT / CSRC).rglob("*.cc")):
        rel = path.relative_to(ROOT).as_posix()
        if "/tests/" in rel:
            continue
        if not _X86 and ("/kernels/x86/" in rel or rel.endswith(_X86_SUFFIXES)):
            continue
        out.append(rel)
    return out


def _extensions() -> list[Extension]:
    if os.environ.get("QDSL_SKIP_NATIVE") == "1":
        return []
    if sys.platform == "win32":
        args = ["/O2", "/std:c++17"]
        link = []
    else:
        # -fvisibility=hidden: only the QDSL_API C functions are exported.
        args = ["-O3", "-std=c++17", "-fvisibility=hidden", "-fno-math-errno", "-g0"]
        link = ["-pthread"]
        if sys.platform.startswith("linux"):
            # the library uses no Python symbols (ctypes loads it), so an undefined one is a
            # bug: an op's table entry k<Op>Def missing from its .cc fails here, not at load
            link.append("-Wl,--no-undefined")
    return [
        Extension(
            "qdsl.runtime._qdsl_native",
            sources=_sources(),
            # headers too: without them an edit to a header alone leaves the library as it was
            depends=sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / CSRC).rglob("*.h")),
            include_dirs=[f"{CSRC}/include", CSRC],
            language="c++",
            extra_compile_args=args,
            extra_link_args=link,
        )
    ]


setup(ext_modules=_extensions())

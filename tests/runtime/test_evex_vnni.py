"""The EVEX build of the VNNI GEMM kernels (csrc/kernels/x86/gemm_u8s8_6x16_vnni_avx512.cc), for
CPUs with AVX512-VNNI + AVX512VL but no AVX-VNNI (AMD Zen 4), opt-in to the VNNI paths with QDSL_EVEX_VNNI=paths (by default the AVX2
path runs these kernels there, test_igemm_vnni.py).  The
library reads the variable once per process, so each check runs in a subprocess; the kernel
checks are test_kernels.py's own (hypothesis shapes incl. odd sizes, zero points, bias, the
output stage, 1-4 threads, every path against numpy), run with the variable set so that their
path list includes avxvnni and avx512."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import qdsl.runtime as rt

ROOT = Path(__file__).resolve().parents[2]


def _flags() -> set[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))


FLAGS = _flags()
EVEX_ONLY = {"avx512_vnni", "avx512vl"} <= FLAGS and "avx_vnni" not in FLAGS
pytestmark = [pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}"),
              pytest.mark.skipif(not EVEX_ONLY, reason="needs a CPU with AVX512-VNNI + VL and without AVX-VNNI")]


def _env(opt_in: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("QDSL_EVEX_VNNI", "QDSL_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if opt_in:
        env["QDSL_EVEX_VNNI"] = "paths"
    return env


def _cpu_paths(opt_in: bool) -> list[str]:
    code = "from qdsl.runtime import kernels as K; print(' '.join(K.paths()['cpu']))"
    out = subprocess.run([sys.executable, "-c", code], env=_env(opt_in), cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


def test_opt_in_enables_the_vnni_paths():
    assert "avxvnni" not in _cpu_paths(False)
    assert {"avx2", "avxvnni", "avx512"} <= set(_cpu_paths(True))


def test_gemm_kernel_tests_pass_on_the_evex_vnni_paths():
    # the int GEMM, requantized output, activation-bound and thread tests of test_kernels.py
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           str(ROOT / "tests" / "runtime" / "test_kernels.py"), "-k", "gemm or threads or in_place"]
    out = subprocess.run(cmd, env=_env(True), cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout

"""The thread pool's SoloPolicy (csrc/threads/thread_pool.h: per job shape, the measured
wall times of parallel and solo runs decide, with probes of the losing mode), checked with
job times fed in rather than a clock: csrc/tests/solo_policy_test.h, compiled alone (the
policy is header-only) and run.  Skipped without a C++ compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_solo_policy_checks_pass(tmp_path):
    exe = tmp_path / "solo_policy"
    build = subprocess.run([CXX, "-std=c++17", "-O1", f"-I{CSRC}", f"-I{CSRC / 'include'}",
                            str(CSRC / "tests" / "solo_policy_main.cc"), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "OK (0 failures)" in run.stdout, run.stdout + run.stderr

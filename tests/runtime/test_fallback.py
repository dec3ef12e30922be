"""Without the compiled library qdsl still works: available() is False, load_error() says
why, and run_graph(backend="auto") falls back to the reference executor with one warning."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = r"""
import warnings
import numpy as np
import qdsl.runtime as rt
from qdsl.runtime.run import run_graph
from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Tensor

assert not rt.available()
assert "not built" in rt.load_error(), rt.load_error()
g = IntegerGraph([Tensor("x", DType.U8, (-1, 4)), Tensor("y", DType.U8, (-1, 4))], ["x"], ["y"],
                 [Op(OpType.CLAMP, "c", ["x"], ["y"], {"out_min": 2, "out_max": 9})]).validate()
x = np.arange(8, dtype=np.uint8).reshape(2, 4)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    y = run_graph(g, x)
    run_graph(g, x)
assert sum("reference executor" in str(m.message) for m in w) == 1, [str(m.message) for m in w]
assert (y == np.clip(x, 2, 9)).all()
try:
    rt.CompiledGraph(g)
except rt.RuntimeUnavailable as e:
    assert "not built" in str(e)
else:
    raise AssertionError("CompiledGraph without the library must raise")
print("ok")
"""


def test_missing_library_falls_back(tmp_path):
    env = dict(os.environ, QDSL_RUNTIME_LIB=str(tmp_path / "missing.so"))
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_qdsl_kernels_reference_forces_the_reference_path():
    import pytest

    import qdsl.runtime as rt

    if not rt.available():
        pytest.skip(f"C++ runtime not built: {rt.load_error()}")
    code = "from qdsl.runtime import kernels as K; print(','.join(K.paths()['enabled']))"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, QDSL_KERNELS="reference"),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ref"

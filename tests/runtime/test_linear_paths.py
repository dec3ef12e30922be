"""LINEAR through the fused GEMM (bias and output stage inside it, I8/U8/I32 outputs) equals
the reference executor bit for bit on every path, at 1 and 2 threads, on shapes that reach
every strip height of the int16 micro-kernel (1..6 rows), several K blocks and odd K/N, with
the input zero point at its extremes; the graph plan shows the fused path is the one taken."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Tensor  # noqa: E402
from qdsl.graph.reference import execute  # noqa: E402
from qdsl.graph.requant import make_rescale  # noqa: E402
from qdsl.runtime import kernels as K  # noqa: E402

PATHS = [p for p in ("ref", "portable", "avx2", "avxvnni", "avx512", "amx") if p in K.paths()["cpu"]]
_I32 = (-(2**31), 2**31 - 1)


def _linear_graph(rng, k, n, x_dtype, out_dtype, in_zp, bias, pot):
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    w[:, 0] = 127  # full-range weights: the int16 kernel (vpmaddubsw pairs could saturate)
    wide = out_dtype is DType.I32  # a wide residual output (zero point 0)
    if pot:  # power-of-two factors: the POT form
        factors = 2.0 ** -rng.integers(0, 4, n) if wide else 2.0 ** -rng.integers(10, 16, n)
    else:  # FIXED_SINGLE
        factors = rng.uniform(0.25, 1.0, n) if wide else rng.uniform(1e-5, 1e-3, n)
    r = make_rescale(factors, int(rng.integers(0, 4)), allow_pot=pot, single=True)
    lo, hi = _I32 if wide else out_dtype.range
    stage = OutputStage(r, 0 if wide else int(rng.integers(lo, hi + 1)), lo, hi)
    attrs = {"in_zp": in_zp, "w_zp": [0], "acc_bits": 32, "overflow": 0, **stage.attrs()}
    tensors = [Tensor("x", x_dtype, (-1, k)), Tensor("w", DType.I8, w.shape, w)]
    inputs = ["x", "w"]
    if bias:
        tensors.append(Tensor("b", DType.I32, (n,), rng.integers(-(2**20), 2**20, n)))
        inputs.append("b")
    tensors.append(Tensor("y", out_dtype, (-1, n)))
    return IntegerGraph(tensors, ["x"], ["y"], [Op(OpType.LINEAR, "fc", inputs, ["y"], attrs)]).validate()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), m=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 13, 32, 97]),
       k=st.sampled_from([1, 3, 17, 384, 515, 1031]), n=st.sampled_from([1, 7, 16, 33, 100]),
       x_dtype=st.sampled_from([DType.U8, DType.I8]), out_dtype=st.sampled_from([DType.U8, DType.I8, DType.I32]),
       zp_at=st.sampled_from(["lo", "hi", "mid"]), bias=st.booleans(), pot=st.booleans(),
       threads=st.sampled_from([1, 2]))
def test_fused_linear_equals_reference(seed, m, k, n, x_dtype, out_dtype, zp_at, bias, pot, threads):
    rng = np.random.default_rng(seed)
    lo, hi = x_dtype.range
    in_zp = {"lo": lo, "hi": hi, "mid": int(rng.integers(lo, hi + 1))}[zp_at]
    graph = _linear_graph(rng, k, n, x_dtype, out_dtype, in_zp, bias, pot)
    x = rng.integers(lo, hi + 1, (m, k)).astype(x_dtype.numpy)
    x[0, :] = lo if in_zp > (lo + hi) // 2 else hi  # one row as far from the zero point as it gets
    want = execute(graph, [x]).outputs[0]
    cg = rt.CompiledGraph(graph)
    assert cg.plan()[0]["fused_gemm"] is True  # no overflow possible: the fused GEMM runs
    rt.set_num_threads(threads)
    try:
        for path in PATHS:
            got = cg.run(x, path=path)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want, err_msg=f"path {path}, {threads} thread(s)")
    finally:
        rt.set_num_threads(0)


def test_linear_that_can_overflow_is_not_fused():
    """A narrow accumulator that can overflow keeps the per-element path (wrap and count)."""
    rng = np.random.default_rng(0)
    w = np.full((4, 64), 127, np.int8)
    stage = OutputStage(make_rescale(np.full(4, 0.5), 1, allow_pot=False, single=True), 0, *_I32)
    attrs = {"in_zp": 0, "w_zp": [0], "acc_bits": 16, "overflow": 0, **stage.attrs()}
    graph = IntegerGraph([Tensor("x", DType.U8, (-1, 64)), Tensor("w", DType.I8, w.shape, w),
                          Tensor("y", DType.I32, (-1, 4))], ["x"], ["y"],
                         [Op(OpType.LINEAR, "fc", ["x", "w"], ["y"], attrs)]).validate()
    cg = rt.CompiledGraph(graph)
    assert cg.plan()[0]["fused_gemm"] is False
    x = rng.integers(0, 256, (3, 64)).astype(np.uint8)
    want = execute(graph, [x])
    for path in PATHS:
        np.testing.assert_array_equal(cg.run(x, path=path), want.outputs[0], err_msg=path)
        assert cg.overflow_counts()["fc"] == want.overflow["fc"]

"""Batch-1 ops cut finely across threads (issue 18): MiniLM-sized LAYERNORM, SOFTMAX and
SOFTMAX_MASKED rows, MobileNetV2-sized NHWC depthwise convs, a GEMV-shaped LINEAR and 7-bit
implicit-GEMM convs on 14 x 14 and 7 x 7 images equal the Python reference bit for bit at
1, 2 and 3 threads; at 2 threads each of them goes to the pool in >= 8 claims per thread
(counted by the runtime's QDSL_PROFILE lines, in a subprocess: the flag is read once)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Tensor  # noqa: E402
from qdsl.export.lower_attn import softmax_table  # noqa: E402

from tests.runtime import test_softmax_masked as tsm  # noqa: E402
from tests.runtime.test_attn_ops import _ln_attrs, _softmax_attrs  # noqa: E402
from tests.runtime.test_conv_igemm import _attrs as _conv_attrs  # noqa: E402
from tests.runtime.test_conv_igemm import _weights  # noqa: E402
from tests.runtime.test_depthwise_conv import _dw_chain_graph  # noqa: E402
from tests.runtime.test_graph import PATHS, _check, _graph, _rand, _stage  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _igemm_graph(rng, c: int, hw: int) -> IntegerGraph:
    """CLAMP(0, 127) -> 3x3 conv (U8 clamped to 0..127) -> 3x3 conv: the 7-bit activations
    that take the implicit-GEMM kernel, one image of hw x hw."""
    w1, w2 = _weights(rng, c, c, 3, 127), _weights(rng, c, c, 3, 127)
    shape = (-1, c, hw, hw)
    a_attrs = _conv_attrs(rng, c, DType.U8, 3, 1, 1, in_zp=0)
    a_attrs["out_max"] = 127
    a_attrs["out_zp"] = min(a_attrs["out_zp"], 127)
    a_attrs["out_min"] = min(a_attrs["out_min"], a_attrs["out_zp"])
    tensors = [Tensor("x", DType.U8, shape), Tensor("xc", DType.U8, shape), Tensor("w1", DType.I8, w1.shape, w1),
               Tensor("w2", DType.I8, w2.shape, w2), Tensor("a", DType.U8, shape), Tensor("y", DType.I8, shape)]
    ops = [Op(OpType.CLAMP, "clamp", ["x"], ["xc"], {"out_min": 0, "out_max": 127}),
           Op(OpType.CONV2D, "conv1", ["xc", "w1"], ["a"], a_attrs),
           Op(OpType.CONV2D, "conv2", ["a", "w2"], ["y"], _conv_attrs(rng, c, DType.I8, 3, 1, 1, in_zp=0))]
    return IntegerGraph(tensors, ["x"], ["y"], ops).validate()


def _cases() -> dict:
    """name -> (graph, inputs, names of the ops that must go to the pool finely cut)."""
    rng = np.random.default_rng(18)
    out = {}
    ln = _graph(OpType.LAYERNORM, [("x", DType.I8, (-1, 128, 384))], _ln_attrs(rng, 384, DType.I8, eps=1000),
                out_dtype=DType.I8)
    out["layernorm"] = (ln, [_rand(rng, DType.I8, (1, 128, 384))], ["layer"])
    sm = _graph(OpType.SOFTMAX, [("x", DType.I8, (-1, 12, 128, 128))], _softmax_attrs(rng, 0.05, DType.U8),
                out_dtype=DType.U8)
    out["softmax"] = (sm, [_rand(rng, DType.I8, (1, 12, 128, 128))], ["layer"])
    key = (rng.random((1, 128)) < 0.8).astype(np.int32)
    attrs = {"table": list(softmax_table(0.05)), "mask_dims": [0, -1, -1, 1], "mask_attend": [1],
             **_stage(rng, lo=-128, hi=127)}
    smm = tsm._graph(DType.I8, (-1, 12, 128, 128), [("key", DType.I32, (-1, 128), None)], attrs, DType.I8)
    out["softmax_masked"] = (smm, [_rand(rng, DType.I8, (1, 12, 128, 128)), key], [smm.ops[0].name])
    dw = _dw_chain_graph(rng, c=384, xdtype=DType.U8, mid_dtype=DType.U8, layers=[(3, 1, 1), (3, 1, 1)],
                         extra_reader=False, mid_output=False, hw=(14, 14))
    out["depthwise_14x14"] = (dw, [_rand(rng, DType.U8, (1, 384, 14, 14))], ["dw0", "dw1"])
    k, n = 1280, 1000
    wt = _rand(rng, DType.I8, (n, k))
    lin = _graph(OpType.LINEAR, [("x", DType.U8, (-1, k))],
                 {"in_zp": 3, "w_zp": [0], "acc_bits": 32, "overflow": 0, **_stage(rng, n, -128, 127)}, DType.I8,
                 [Tensor("w", DType.I8, wt.shape, wt)])
    out["gemv"] = (lin, [_rand(rng, DType.U8, (1, k))], ["layer"])
    for hw in (14, 7):
        g = _igemm_graph(rng, 128 if hw == 14 else 256, hw)
        out[f"igemm_{hw}x{hw}"] = (g, [_rand(rng, DType.U8, (1, *g.tensors[0].shape[1:]))], ["conv1", "conv2"])
    return out


@pytest.fixture(scope="module")
def cases():
    return _cases()


@pytest.mark.parametrize("name", ["layernorm", "softmax", "softmax_masked", "depthwise_14x14", "gemv",
                                  "igemm_14x14", "igemm_7x7"])
def test_batch1_op_matches_reference_at_1_2_3_threads(cases, name):
    graph, xs, _ = cases[name]
    before = rt.get_num_threads()
    try:
        for t in (1, 2, 3):
            rt.set_num_threads(t)
            _check(graph, *xs)
    finally:
        rt.set_num_threads(before)


_PROFILE = re.compile(r"qdsl op\s+\d+ (\S+)\s.*jobs (\d+)/(\d+) tasks (\d+)")


@pytest.mark.skipif("avx2" not in PATHS, reason="the implicit-GEMM convs run on the AVX2 path")
def test_batch1_ops_are_cut_into_claims_for_every_thread():
    """At 2 threads every op above goes to the pool (before: LAYERNORM, SOFTMAX, the 14 x 14
    depthwise convs and the GEMV ran serially, their work estimates below the threshold) in
    >= 8 claims per thread, or a row each for the depthwise convs (before: 4 for the GEMV's
    GEMM, 8 for the 7 x 7 convs), so a thread that another process preempts holds little."""
    script = (
        "import qdsl.runtime as rt\n"
        "from tests.runtime.test_threads_batch1 import _cases\n"
        "rt.set_num_threads(2)\n"
        "for g, xs, _ in _cases().values():\n"
        "    rt.CompiledGraph(g).run(*xs, path='avx2')\n"
    )
    env = {**os.environ, "QDSL_PROFILE": "1", "QDSL_POOL_ADAPT": "0"}  # no solo jobs on a loaded test machine
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    # the cases run in order, one profile line per op: find each case's ops in turn
    lines = iter([m for m in map(_PROFILE.match, run.stderr.splitlines()) if m])
    for name, (_, _, ops) in _cases().items():
        for op in ops:
            m = next((x for x in lines if x[1] == op), None)
            assert m is not None, f"{name}: no profile line for op {op!r}"
            par, ser, tasks = int(m[2]), int(m[3]), int(m[4])
            assert par >= 1, f"{name} {op}: {par} parallel / {ser} serial jobs at 2 threads"
            # 8 per thread, or one per output row for the depthwise convs (14 rows)
            want = 14 if name.startswith("depthwise") else 16
            assert tasks >= want, f"{name} {op}: {tasks} claims at 2 threads (want >= {want})"


@pytest.mark.skipif("avx2" not in PATHS, reason="the implicit-GEMM convs run on the AVX2 path")
@pytest.mark.parametrize("names", [["layernorm", "softmax", "depthwise_14x14", "gemv", "igemm_14x14", "igemm_7x7"],
                                   # its jobs have SOFTMAX's shapes, so they share SOFTMAX's policy
                                   # slot: a process of its own for its first visits
                                   ["softmax_masked"]])
def test_batch1_ops_give_the_same_bytes_solo_and_in_parallel(names):
    """The pool's SoloPolicy (threads/thread_pool.h) runs a job shape's first visit in
    parallel and its second in the caller alone, whatever the timings, so three runs at 2
    threads take both modes for the ops of every case above (ops of one shape share their
    visits): the profile shows parallel jobs, and more serial ones than with the policy off
    (the solo ones), and every run's output equals the 1-thread output."""
    script = (
        "import sys\n"
        "import numpy as np\n"
        "import qdsl.runtime as rt\n"
        "from tests.runtime.test_threads_batch1 import _cases\n"
        "cases = _cases()\n"
        "for name in sys.argv[1:]:\n"
        "    g, xs, _ = cases[name]\n"
        "    cg = rt.CompiledGraph(g)\n"
        "    rt.set_num_threads(1)\n"
        "    want = cg.run(*xs, path='avx2')\n"
        "    rt.set_num_threads(2)\n"
        "    for r in range(3):\n"
        "        assert np.array_equal(cg.run(*xs, path='avx2'), want), (name, r)\n"
    )

    def jobs(adapt: str) -> dict:
        """op -> (parallel, serial) jobs over the three 2-thread runs"""
        env = {**os.environ, "QDSL_PROFILE": "1", "QDSL_POOL_ADAPT": adapt}
        run = subprocess.run([sys.executable, "-c", script, *names], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        lines = iter([m for m in map(_PROFILE.match, run.stderr.splitlines()) if m])
        out = {}
        for name in names:
            for r in range(4):  # the 1-thread run, then the three 2-thread runs
                for op in cases[name][2]:
                    m = next((x for x in lines if x[1] == op), None)
                    assert m is not None, f"{name}: no profile line for op {op!r} in run {r}"
                    par, ser = out.get((name, op), (0, 0))
                    out[name, op] = (par + int(m[2]), ser + int(m[3])) if r > 0 else (par, ser)
        return out

    cases = _cases()
    adaptive, fixed = jobs("1"), jobs("0")  # fixed: every job the op sends the pool runs in parallel
    for name in names:
        ops = cases[name][2]
        par = sum(adaptive[name, op][0] for op in ops)
        solo = sum(adaptive[name, op][1] - fixed[name, op][1] for op in ops)
        assert par >= 1 and solo >= 1, f"{name}: {par} parallel and {solo} solo jobs over three 2-thread runs"

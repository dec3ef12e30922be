"""Results do not depend on the thread count: convs cut into pieces across threads at batch
1 (column panels, weight-row strips), the GEMM behind LINEAR, and the pool under many
small jobs equal the Python reference executor bit for bit at 1, 2 and 3 threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph import execute  # noqa: E402
from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Tensor  # noqa: E402

from tests.runtime.test_graph import PATHS, _check, _graph, _rand, _stage  # noqa: E402


@pytest.fixture
def threads():
    """Sets the runtime's thread count for one test and restores it afterwards."""
    before = rt.get_num_threads()
    yield rt.set_num_threads
    rt.set_num_threads(before)


# (batch, cin, cout, H, W, k, stride, pad, groups): each above the parallel-work threshold
# (4M MAC-equivalents), so 2 and 3 threads cut it: one image of many panels (spatial
# tiles only); a 7 x 7 image with fewer panels than pieces (tiles x weight-row strips,
# 130 rows: strips of 6 and 5); strided; two groups (two units, each cut); batch 2.
CONVS = [
    (1, 32, 64, 30, 30, 3, 1, 1, 1),
    (1, 96, 130, 7, 7, 3, 1, 1, 1),
    (1, 16, 48, 61, 59, 5, 2, 2, 1),
    (1, 64, 66, 20, 20, 3, 1, 1, 2),
    (2, 24, 40, 17, 33, 3, 1, 0, 1),
]


# (output dtype, acc_bits, weight magnitude): weights within +-8 take AVX2's vpmaddubsw
# kernels, full-range ones the int16 kernels; acc_bits 18 overflows, so the element by
# element stage with its overflow counts runs on each piece's columns
STAGES = [(DType.U8, 32, 128), (DType.I8, 32, 8), (DType.I32, 32, 128), (DType.U8, 18, 128)]


@pytest.mark.parametrize("shape", CONVS, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("out,acc_bits,wmag", STAGES, ids=lambda v: str(v))
def test_conv_pieces_match_reference_at_1_2_3_threads(shape, out, acc_bits, wmag, threads):
    n, cin, cout, h, w, k, s, p, groups = shape
    rng = np.random.default_rng([*shape, acc_bits, wmag])
    wt = np.clip(_rand(rng, DType.I8, (cout, cin // groups, k, k)), -wmag, wmag)
    lo, hi = (-(2**31), 2**31 - 1) if out is DType.I32 else out.range
    attrs = {"stride": [s, s], "padding": [p, p], "dilation": [1, 1], "groups": groups, "in_zp": 7, "w_zp": [0],
             "acc_bits": acc_bits, "overflow": 0,
             **_stage(rng, cout, lo, hi, pot=False if out is DType.I32 else None)}
    consts = [Tensor("w", DType.I8, wt.shape, wt), Tensor("b", DType.I32, (cout,), rng.integers(-5000, 5000, cout))]
    graph = _graph(OpType.CONV2D, [("x", DType.U8, (-1, cin, h, w))], attrs, out, consts)
    x = _rand(rng, DType.U8, (n, cin, h, w))
    for t in (1, 2, 3):
        threads(t)
        _check(graph, x)


@pytest.mark.parametrize("m", [1, 3, 50])
def test_linear_matches_reference_at_1_2_3_threads(m, threads):
    # k * n above the threshold even for one row: the GEMM splits the weight panels
    rng = np.random.default_rng(m)
    k, n = 2100, 2050
    wt = _rand(rng, DType.I8, (n, k))
    attrs = {"in_zp": 3, "w_zp": [0], "acc_bits": 32, "overflow": 0, **_stage(rng, n, -128, 127)}
    graph = _graph(OpType.LINEAR, [("x", DType.U8, (-1, k))], attrs, DType.I8, [Tensor("w", DType.I8, wt.shape, wt)])
    x = _rand(rng, DType.U8, (m, k))
    for t in (1, 2, 3):
        threads(t)
        _check(graph, x)


def _chain(depth: int, c: int, hw: int) -> IntegerGraph:
    """depth 1x1 convs (U8 -> U8, ReLU-clamped), each just above the parallel threshold:
    many short jobs of a few tasks each, back to back."""
    rng = np.random.default_rng(depth)
    tensors = [Tensor("t0", DType.U8, (-1, c, hw, hw))]
    ops = []
    for i in range(depth):
        wt = rng.integers(-20, 21, (c, c, 1, 1)).astype(np.int8)
        tensors += [Tensor(f"w{i}", DType.I8, wt.shape, wt), Tensor(f"t{i + 1}", DType.U8, (-1, c, hw, hw))]
        attrs = {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1, "in_zp": 0, "w_zp": [0],
                 "acc_bits": 32, "overflow": 0, **_stage(rng, c, 0, 255, pot=True)}
        ops.append(Op(OpType.CONV2D, f"c{i}", [f"t{i}", f"w{i}"], [f"t{i + 1}"], attrs))
    return IntegerGraph(tensors, ["t0"], [f"t{depth}"], ops).validate()


def test_many_small_parallel_ops_from_two_threads(threads):
    """A chain of 40 small parallel convs run 20 times each from two Python threads at
    once (one posts to the pool while the other's job holds it) at 2 and 3 threads."""
    graph = _chain(40, 64, 33)
    rng = np.random.default_rng(0)
    xs = [_rand(rng, DType.U8, (1, 64, 33, 33)) for _ in range(2)]
    want = [execute(graph, [x]).outputs[0] for x in xs]
    for t in (2, 3):
        threads(t)
        errors: list[str] = []

        def run(i: int) -> None:
            cg = rt.CompiledGraph(graph)
            for r in range(20):
                got = cg.run(xs[i], path=PATHS[-1])
                if not np.array_equal(got, want[i]):
                    errors.append(f"thread {i} run {r} at {t} threads differs")

        workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for wk in workers:
            wk.start()
        for wk in workers:
            wk.join()
        assert not errors, errors

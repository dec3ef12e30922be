"""RESHAPE in the C++ runtime: an input that no other op reads and that is no graph output
hands its buffer to the output (csrc/runtime/ops/reshape.cc), others are copied; either way
every run and every batch size equals the reference executor."""

from __future__ import annotations

import numpy as np
import pytest

import qdsl.runtime as rt
from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Tensor

from tests.runtime.test_graph import _check

needs_cpp = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")


def _chain(outputs):
    # x -> clamp c; c -> r1 -> r2 (r1 read only by r2: moved unless r1 is an output);
    # c -> r3 as well (c has two readers: copied)
    tensors = [Tensor("x", DType.U8, (-1, 4, 6)), Tensor("c", DType.U8, (-1, 4, 6)), Tensor("r1", DType.U8, (-1, 24)),
               Tensor("r2", DType.U8, (-1, 6, 4)), Tensor("r3", DType.U8, (-1, 2, 12))]
    ops = [Op(OpType.CLAMP, "clamp", ["x"], ["c"], {"out_min": 3, "out_max": 250}),
           Op(OpType.RESHAPE, "r1", ["c"], ["r1"], {"shape": [24]}),
           Op(OpType.RESHAPE, "r2", ["r1"], ["r2"], {"shape": [6, 4]}),
           Op(OpType.RESHAPE, "r3", ["c"], ["r3"], {"shape": [2, 12]})]
    return IntegerGraph(tensors, ["x"], outputs, ops).validate()


@needs_cpp
@pytest.mark.parametrize("outputs", [["r2", "r3"], ["r2", "r1", "r3"], ["r3", "r2", "c"]])
def test_reshape_chains_match_reference_over_runs_and_batches(outputs):
    rng = np.random.default_rng(len(outputs))
    graph = _chain(outputs)
    for batch in (1, 3, 2):  # _check runs each path twice on one plan (a decoy first), path after path
        _check(graph, rng.integers(0, 256, (batch, 4, 6)).astype(np.uint8))

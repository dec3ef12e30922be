"""Small hand-built graphs for the export tests (one op, or a short chain)."""

from __future__ import annotations

import numpy as np

from qdsl.graph.ir import DType, IntegerGraph, Op, OutputStage, Rescale, Tensor
from qdsl.graph.validate import infer_output


def single_op(op_type, inputs, attrs, out_dtype=DType.I8, consts=(), name="op") -> IntegerGraph:
    """A graph: activations ``inputs`` ([(name, dtype, shape)]) -> one op -> output ``y``.

    ``consts`` are Tensors appended to the op's inputs. The output shape is inferred.
    """
    acts = [Tensor(n, d, s) for n, d, s in inputs]
    consts = list(consts)
    op_inputs = [t.name for t in acts] + [t.name for t in consts]
    probe = Tensor("y", out_dtype, (1,))
    op = Op(op_type, name, op_inputs, ["y"], attrs)
    _, shape = infer_output(0, op, acts + consts, probe)
    y = Tensor("y", out_dtype, shape)
    return IntegerGraph(acts + consts + [y], [t.name for t in acts], ["y"], [op]).validate()


def stage(mult=1.0, zp=0, lo=-128, hi=127, rescale: Rescale | None = None) -> dict:
    from qdsl.graph.requant import make_rescale

    return OutputStage(rescale or make_rescale(mult), zp, lo, hi).attrs()


def rand_int(rng, dtype: DType, shape) -> np.ndarray:
    lo, hi = dtype.range
    if dtype is DType.BIN:
        return rng.choice([-1, 1], size=shape).astype(np.int8)
    return rng.integers(lo, hi + 1, size=shape).astype(dtype.numpy if dtype.bits >= 8 else np.int8)

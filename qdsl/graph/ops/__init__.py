"""The graph op registry: one module per op (or family), each holding the op's schema row,
its validation rule and its reference integer semantics.

An op module defines ``OPS``, a tuple of :class:`OpDef`: the op's name and opcode
number (part of the file format: never renumber), its :class:`~qdsl.graph.schema.OpSchema`
(arity, attribute names and types), ``infer`` (what :func:`qdsl.graph.validate.validate_graph`
checks for it: input/output dtypes, attribute values; returns the allowed output dtypes
and the output shape) and ``run`` (its semantics in int64 numpy, what
:func:`qdsl.graph.reference.execute` runs; docs/qgraph.md has the formulas).

Registering an op is naming its module in :data:`_REGISTERED` below.  ``OpType`` and
``OP_SCHEMAS`` (:mod:`qdsl.graph.ir`), validation, the reference executor and the
generated C++ schema (``csrc/gen_op_schema.py``) are all built from :data:`OP_DEFS`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable

import attrs

from qdsl.graph.schema import DType, OpSchema

if TYPE_CHECKING:
    import numpy as np

    from qdsl.graph.checks import Check
    from qdsl.graph.ir import IntegerGraph, Op, Tensor

__all__ = ["OpDef", "OP_DEFS", "op_def"]

InferFn = Callable[["Check", "Op", "list[Tensor]", "Tensor"], "tuple[tuple[DType, ...], tuple[int, ...]]"]
RunFn = Callable[["Op", "list[Any]", "IntegerGraph", "dict[str, int]"], "np.ndarray"]
"""``run(op, args, graph, counts)``: ``args`` holds an int64 (or float32) array per
activation input and the :class:`~qdsl.graph.ir.Tensor` record of each constant input;
an op with an accumulator adds its overflows to ``counts[op.name]``."""


@attrs.frozen
class OpDef:
    """One graph op: everything the torch-free side knows about it."""

    name: str
    """The ``OpType`` member name (``CONV2D``); the C++ names follow from it (``kConv2d``)."""
    number: int
    """The opcode in ``.qgraph`` files and the C++ table."""
    schema: OpSchema
    infer: InferFn
    run: RunFn
    doc: str = ""
    all_activations: bool = False
    """Every input must be an activation (ADD, CONCAT); otherwise only the first."""
    reads_ids: bool = False
    """Its first input may be an I32 graph input of token ids (EMBEDDING)."""
    reads_masks: bool = False
    """Its inputs after the first may be I32 graph inputs (SOFTMAX_MASKED's masks); no op
    other than these two kinds reads an I32 graph input."""
    extra_outputs: Callable[["Op", "list[Tensor]"], "tuple[tuple[DType, tuple[int, ...]], ...]"] | None = None
    """For an op with ``schema.n_outputs > 1``: the (dtype, shape) of each output after the
    first (called after ``infer`` accepted the op); ``run`` then returns one array per output."""


def _collect(modules) -> tuple[OpDef, ...]:
    defs = sorted((d for m in modules for d in m.OPS), key=lambda d: d.number)
    for a, b in zip(defs, defs[1:]):
        if a.number == b.number:
            raise AssertionError(f"ops {a.name} and {b.name} share opcode {a.number}")
    names = [d.name for d in defs]
    if len(set(names)) != len(names):
        raise AssertionError(f"duplicate op name in {names}")
    return tuple(defs)


# The registration: one name per op module (the ops' order here is free; OP_DEFS sorts
# them by opcode).
_REGISTERED = (
    "boundary",
    "requantize",
    "weighted",
    "add",
    "concat",
    "clamp",
    "pool",
    "reshape",
    "resize",
    "lut",
    "conv_transpose",
    "mul",
    "matmul",
    "softmax",
    "softmax_masked",
    "layernorm",
    "embedding",
    "dynamic",
    "recurrent",
    "recurrent_dynamic",
    "select",
)
_MODULES = tuple(importlib.import_module(f"{__name__}.{name}") for name in _REGISTERED)
OP_DEFS: tuple[OpDef, ...] = _collect(_MODULES)
"""Every registered op, by opcode."""


def op_def(number: int) -> OpDef:
    """The :class:`OpDef` with opcode ``number`` (an ``OpType`` is an int)."""
    return _BY_NUMBER[int(number)]


_BY_NUMBER = {d.number: d for d in OP_DEFS}

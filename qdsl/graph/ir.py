"""The integer graph IR: frozen records that ``.qgraph`` files serialize one to one.

An :class:`IntegerGraph` is a list of named :class:`Tensor` records (graph inputs,
activations and constants) and a topologically ordered list of :class:`Op` records that
refer to tensors by name.  Every op is one of :class:`OpType`; its attributes are a flat
mapping of name -> ``int`` | ``float`` | ``tuple[int, ...]`` whose names, types and
meaning are fixed by :data:`OP_SCHEMAS` and documented, formula by formula, in
``docs/qgraph.md``.  ``qdsl/graph/reference.py`` is the executable definition of the
semantics; the C++ runtime must equal it bit for bit.

Guarantees:

* the op set is the registry in :mod:`qdsl.graph.ops` (one module per op or family);
  :class:`OpType` and :data:`OP_SCHEMAS` are views of it, and the element types,
  rescales and schemas live in :mod:`qdsl.graph.schema` (re-exported here);
* records are immutable; constants hold *logical* values (int4 weights as small ints,
  binary weights as ±1), packing is a property of the file format only;
* :meth:`IntegerGraph.validate` (also run by the ``.qgraph`` loader) checks op arity,
  attribute names and types, dtypes, shapes (by shape inference), dangling names and
  topological order, and raises :class:`GraphFormatError` naming the op or tensor.

The numeric codes of :class:`DType`, :class:`OpType`, :class:`RescaleKind`,
:class:`Rounding` and :class:`AttrType` are part of the file format: never renumber.
"""

from __future__ import annotations

import enum
from typing import Any, Mapping

import attrs
import numpy as np

from qdsl.graph.ops import OP_DEFS
from qdsl.graph.schema import (
    ACTIVATION_DTYPES,
    INT8_DTYPES,
    OUT_ATTRS,
    RQ_ATTRS,
    WEIGHT_DTYPES,
    AttrType,
    DType,
    GraphFormatError,
    OpSchema,
    OutputStage,
    OverflowMode,
    Rescale,
    RescaleKind,
    Rounding,
)
from qdsl.spec.model import attrs_frozendict

__all__ = [
    "GraphFormatError",
    "DType",
    "OpType",
    "AttrType",
    "RescaleKind",
    "Rounding",
    "OverflowMode",
    "Tensor",
    "Op",
    "IntegerGraph",
    "GraphCache",
    "OpSchema",
    "OP_SCHEMAS",
    "RQ_ATTRS",
    "OUT_ATTRS",
    "Rescale",
    "OutputStage",
    "GRAPH_VERSION",
]

GRAPH_VERSION = 1
"""IR/format version; bumped whenever any semantics or layout changes."""


OpType = enum.IntEnum("OpType", [(d.name, d.number) for d in OP_DEFS], module=__name__, qualname="OpType")
OpType.__doc__ = """Operations, one member per op module entry of :mod:`qdsl.graph.ops` (``OpDef.doc``
says what each does; the exact integer semantics are in docs/qgraph.md)."""

OP_SCHEMAS: dict[OpType, OpSchema] = {OpType(d.number): d.schema for d in OP_DEFS}
"""Arity and attributes per op: a view of the op registry (:mod:`qdsl.graph.ops`)."""


def _eq_data(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    # logical values compare, not containers (a loaded I4 tensor is int8, a built one int64)
    return a.shape == b.shape and bool(np.array_equal(a, b))


def _to_data(value: Any) -> np.ndarray | None:
    if value is None:
        return None
    arr = np.array(value, copy=True)
    arr.setflags(write=False)
    return arr


@attrs.frozen
class Tensor:
    """A named tensor. ``data`` is set for constants only and holds logical values.

    Activation shapes start with the batch dimension, ``-1`` when it is dynamic.
    """

    name: str
    dtype: DType = attrs.field(converter=DType)
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(d) for d in s))
    data: np.ndarray | None = attrs.field(
        default=None, converter=_to_data, eq=attrs.cmp_using(eq=_eq_data), hash=False, repr=False
    )

    @property
    def is_constant(self) -> bool:
        return self.data is not None


def _freeze_attrs(value: Mapping[str, Any]) -> attrs_frozendict:
    out = {}
    for k, v in dict(value).items():
        if isinstance(v, (list, tuple, np.ndarray)):
            v = tuple(int(x) for x in v)
        elif isinstance(v, (bool, np.bool_)):
            v = int(v)
        elif isinstance(v, (int, np.integer)):
            v = int(v)
        elif isinstance(v, (float, np.floating)):
            v = float(np.float32(v))  # FLOAT attributes are f32 in the file
        out[str(k)] = v
    return attrs_frozendict(out)


@attrs.frozen
class Op:
    """One operation. ``name`` is the module path it came from (for errors and overflow counts)."""

    type: OpType = attrs.field(converter=OpType)
    name: str
    inputs: tuple[str, ...] = attrs.field(converter=tuple)
    outputs: tuple[str, ...] = attrs.field(converter=tuple)
    attrs: Mapping[str, Any] = attrs.field(factory=dict, converter=_freeze_attrs)


class GraphCache(dict):
    """Scratch space an executor keeps on one :class:`IntegerGraph` object
    (:func:`qdsl.runtime.run.run_graph` keeps the compiled form here).  Not part of the graph:
    never compared, and a pickled or deep-copied graph starts with an empty one."""

    def __reduce__(self):
        return GraphCache, ()

    def __deepcopy__(self, memo) -> "GraphCache":
        return GraphCache()


@attrs.frozen
class IntegerGraph:
    """Tensors, graph inputs/outputs (names) and the topologically ordered op list."""

    tensors: tuple[Tensor, ...] = attrs.field(converter=tuple)
    inputs: tuple[str, ...] = attrs.field(converter=tuple)
    outputs: tuple[str, ...] = attrs.field(converter=tuple)
    ops: tuple[Op, ...] = attrs.field(converter=tuple)
    name: str = "graph"
    _by_name: Mapping[str, Tensor] = attrs.field(init=False, eq=False, repr=False, hash=False)
    _cache: GraphCache = attrs.field(init=False, factory=GraphCache, eq=False, repr=False, hash=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})

    def tensor(self, name: str) -> Tensor:
        try:
            return self._by_name[name]
        except KeyError:
            raise GraphFormatError(f"no tensor named {name!r}", f"tensor {name!r}") from None

    def has_tensor(self, name: str) -> bool:
        return name in self._by_name

    @property
    def constants(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.is_constant)

    def validate(self) -> "IntegerGraph":
        """Check everything a file loader checks; return ``self`` (raises GraphFormatError)."""
        from qdsl.graph.validate import validate_graph

        validate_graph(self)
        return self

    def summary(self) -> str:
        """One line per op: index, type, name, inputs -> outputs."""
        lines = [f"graph {self.name!r}: inputs {list(self.inputs)} outputs {list(self.outputs)}"]
        for i, op in enumerate(self.ops):
            lines.append(f"  {i:3d} {op.type.name:<15} {op.name:<28} {', '.join(op.inputs)} -> {', '.join(op.outputs)}")
        return "\n".join(lines)


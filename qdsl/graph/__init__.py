"""The integer graph, torch-free: what ``qdsl.export`` produces and ``qdsl.runtime`` runs.

* :mod:`qdsl.graph.ir` - the versioned IR (:class:`IntegerGraph`, ops, tensors, rescales);
* :mod:`qdsl.graph.ops` - the op registry: one module per op (or family) with its schema,
  validation rule and reference semantics (``OpType``/``OP_SCHEMAS`` are views of it);
* :mod:`qdsl.graph.schema` - dtypes, attribute types, rescales, ``OpSchema`` (re-exported by ``ir``);
* :mod:`qdsl.graph.checks` - the checks op validation rules are written with;
* :mod:`qdsl.graph.validate` - what a well-formed graph is (checked on build and on load);
* :mod:`qdsl.graph.qgraph` - ``.qgraph`` files (docs/qgraph.md): :func:`save_graph`,
  :func:`load_graph`, :func:`graph_to_bytes`, :func:`graph_from_bytes`;
* :mod:`qdsl.graph.reference` - the numpy int64 reference executor (:func:`execute`),
  which defines the semantics the C++ runtime matches bit for bit;
* :mod:`qdsl.graph.requant` - the requantization arithmetic (multiplier, shift, rounding).

Guarantee: importing this package (or any module in it) needs numpy and attrs, never
torch, and imports nothing above ``qdsl.spec``.
"""

from __future__ import annotations

from qdsl.graph.ir import GraphFormatError, IntegerGraph
from qdsl.graph.qgraph import graph_from_bytes, graph_to_bytes, load_graph, save_graph
from qdsl.graph.reference import execute, run_reference

__all__ = [
    "IntegerGraph",
    "GraphFormatError",
    "save_graph",
    "load_graph",
    "graph_to_bytes",
    "graph_from_bytes",
    "execute",
    "run_reference",
]

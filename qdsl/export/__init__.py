"""Integer graph export: lowering a frozen patched model to an integer graph.

* :func:`export` lowers a frozen patched model to an :class:`~qdsl.graph.ir.IntegerGraph`
  (qdsl/export/lower.py);
* the graph it produces is defined in the torch-free :mod:`qdsl.graph` (IR, validation,
  ``.qgraph`` files, the reference executor, requantization); :func:`qdsl.run_graph`
  (:mod:`qdsl.runtime.run`) runs it.

``import qdsl.export`` needs numpy only; torch is imported by :func:`export` when called.
"""

from __future__ import annotations

from typing import Any

from qdsl._callable import make_callable
from qdsl.graph.ir import IntegerGraph

__all__ = ["export"]


def export(model: Any, example_input: Any, **kwargs: Any) -> IntegerGraph:
    """Lower a frozen, patched model to an :class:`IntegerGraph` (see qdsl/export/lower.py)."""
    from qdsl.export.lower import export as _export

    return _export(model, example_input, **kwargs)


make_callable(__name__, export)  # qdsl.export(model, x) keeps working (qdsl/_callable.py)

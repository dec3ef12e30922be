"""``run_graph``: run an :class:`~qdsl.graph.ir.IntegerGraph` with the compiled C++ runtime
(:class:`qdsl.runtime.CompiledGraph`) or the Python reference executor
(:mod:`qdsl.graph.reference`, which defines the semantics).

It lives in the runtime layer because it chooses between the two: ``qdsl.graph`` (below)
knows nothing of the compiled library, and ``qdsl.export`` only produces graphs.
Importing this module never fails; without the compiled library ``backend="auto"`` falls
back to the reference executor with a one-time warning.
"""

from __future__ import annotations

import importlib
import operator
import threading
import warnings
import zlib
from typing import Any

import numpy as np

from qdsl.graph.ir import IntegerGraph
from qdsl.graph.qgraph import graph_from_bytes
from qdsl.graph.reference import as_array, bind_inputs, execute, require_finite, shape_outputs
from qdsl.spec.diagnostics import QdslError

__all__ = ["run_graph", "BACKENDS"]

BACKENDS = ("auto", "reference", "cpp")
_warned_slow = False


def _runtime():
    """``qdsl.runtime`` or ``None`` when it (or its compiled extension) is absent."""
    try:
        return importlib.import_module("qdsl.runtime")
    except ImportError:
        return None


def _fingerprint(graph: IntegerGraph) -> tuple:
    """What a compiled form was built from, compared by identity (``is``).

    The records are immutable (tuples, frozen attrs, read-only constant arrays), so a
    changed graph is a new object (``attrs.evolve``) with its own, empty cache.  What
    remains is bypassing that: ``object.__setattr__`` on a frozen field (the
    tensors/ops tuples, a tensor's ``data``, an op's ``attrs``), caught here because the
    replaced object is not the one the entry holds (held strongly, so its id is not
    reused), and writing into a constant's array after ``setflags(write=True)``: such an
    array's bytes are fingerprinted (crc32) on every call (an array unlocked, written
    and locked again between two calls is not seen: lock it only after the next run).
    Cheap (about 10 us for a 20-op graph): one identity per field, constant and op, no
    pass over the weights unless they were unlocked.
    """
    data = [t.data for t in graph.tensors if t.data is not None]
    objs = (graph.tensors, graph.inputs, graph.outputs, graph.ops, graph.name, *data,
            *[op.attrs for op in graph.ops])
    crcs = tuple(zlib.crc32(np.ascontiguousarray(d).view(np.uint8)) for d in data if d.flags.writeable)
    return objs, crcs


def _same(a: tuple, b: tuple) -> bool:
    return len(a[0]) == len(b[0]) and all(map(operator.is_, a[0], b[0])) and a[1] == b[1]


def _compiled(rt: Any, graph: IntegerGraph) -> Any:
    """``rt.CompiledGraph(graph)`` (or the ``QdslError`` it raised), cached on the graph.

    One entry per runtime (its ``CompiledGraph`` class) and calling thread: a
    ``CompiledGraph`` runs one call at a time (it owns its buffers), so threads that shared
    one would wait for each other where they used to run in parallel.  The key needs no
    thread count or kernel path: both are read when the graph runs, not when it is
    compiled.
    """
    cache = graph._cache.setdefault("cpp", {})
    key = (rt.CompiledGraph, threading.get_ident())
    fp = _fingerprint(graph)
    hit = cache.get(key)
    if hit is not None and _same(hit[0], fp):
        return hit[1]
    try:
        compiled: Any = rt.CompiledGraph(graph)
    except QdslError as err:  # a graph feature this runtime build does not support
        compiled = err
    cache[key] = (fp, compiled)
    return compiled


def run_graph(graph: IntegerGraph | bytes, x: Any, backend: str = "auto", *, check_finite: bool = False) -> Any:
    """Run ``graph`` on ``x`` (a numpy array or torch tensor; float32, float16/bfloat16
    (converted exactly to float32), float64 (rounded to float32), int8/uint8, or integer
    token ids for an I32 input; a batch of 0 gives empty outputs).

    A graph with several inputs takes a tuple (or a list of arrays) in ``graph.inputs``
    order, or a dict by input name (``qdsl.export`` names them after the ``forward``
    parameters); it returns one array for a single output, else a tuple in
    ``graph.outputs`` order, and a dict by output name whenever the inputs came as a dict.

    ``check_finite``: raise :class:`~qdsl.spec.diagnostics.NonFiniteError` when a float
    input holds a NaN or an infinity, instead of quantizing it by the policy (NaN -> zero
    point, +inf -> qmax, -inf -> qmin; docs/qgraph.md §4.4).

    ``backend``: ``"reference"`` (Python, defines the semantics), ``"cpp"`` (the compiled
    runtime; an error if it is not built) or ``"auto"`` (cpp when available, else the
    reference with a one-time warning that it is slow; also the reference, with a warning,
    when the runtime rejects the graph as using a feature it does not support).

    The compiled form (weights packed once) is kept on the graph object and reused by
    later calls with the same graph while it is unchanged (see :func:`_fingerprint`), so
    ``run_graph`` in a loop costs what ``CompiledGraph.run`` does; bytes are parsed anew
    on every call (keep the :class:`IntegerGraph`, or a ``CompiledGraph``, to reuse).
    """
    global _warned_slow
    if backend not in BACKENDS:
        raise QdslError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if isinstance(graph, (bytes, bytearray)):
        graph = graph_from_bytes(graph)
    values, keyed = bind_inputs(graph.inputs, x)
    xs = [as_array(v) for v in values]
    if check_finite:
        for name, v in zip(graph.inputs, xs):
            if np.issubdtype(v.dtype, np.floating):
                require_finite(v, name)
    if backend in ("auto", "cpp"):
        rt = _runtime()
        available = bool(rt is not None and rt.available())
        if available:
            compiled = _compiled(rt, graph)
            if isinstance(compiled, QdslError):
                if backend == "cpp":
                    raise compiled.with_traceback(None)
                warnings.warn(f"the C++ runtime cannot run this graph ({compiled}); using the Python reference "
                              "executor (slow)", RuntimeWarning, stacklevel=2)
                return shape_outputs(graph.outputs, execute(graph, xs).outputs, keyed)
            out = compiled.run(xs)
            return shape_outputs(graph.outputs, out if isinstance(out, tuple) else (out,), keyed)
        if backend == "cpp":
            why = rt.load_error() if rt is not None else "qdsl.runtime is not installed"
            raise QdslError(f"the C++ runtime is not available: {why}")
        if not _warned_slow:
            warnings.warn(
                "qdsl C++ runtime not available; running the Python reference executor (slow)",
                RuntimeWarning,
                stacklevel=2,
            )
            _warned_slow = True
    return shape_outputs(graph.outputs, execute(graph, xs).outputs, keyed)

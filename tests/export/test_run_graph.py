"""``run_graph`` backend selection with a stand-in ``qdsl.runtime`` (the real one is optional)."""

import sys
import types
import warnings

import numpy as np
import pytest

import qdsl.runtime.run as qe
from qdsl.graph import execute, graph_to_bytes
from qdsl.runtime.run import run_graph
from qdsl.spec.diagnostics import QdslError

from .test_qgraph import GRAPH

X = np.random.default_rng(0).random((2, 3, 6, 6)).astype(np.float32)


def fake_runtime(available: bool):
    rt = types.ModuleType("qdsl.runtime")
    calls = []

    class CompiledGraph:
        def __init__(self, graph):
            calls.append(graph)

        def run(self, x):
            return "cpp-result"

    rt.available = lambda: available
    rt.load_error = lambda: None if available else "extension not built"
    rt.CompiledGraph = CompiledGraph
    return rt, calls


def test_backends(monkeypatch):
    rt, calls = fake_runtime(True)
    monkeypatch.setitem(sys.modules, "qdsl.runtime", rt)
    assert run_graph(GRAPH, X) == "cpp-result" and calls == [GRAPH]
    assert run_graph(GRAPH, X, backend="cpp") == "cpp-result"
    np.testing.assert_array_equal(run_graph(GRAPH, X, backend="reference"), execute(GRAPH, X).outputs[0])
    with pytest.raises(QdslError, match="unknown backend"):
        run_graph(GRAPH, X, backend="gpu")


def test_auto_falls_back_when_the_runtime_rejects_the_graph(monkeypatch):
    rt, _ = fake_runtime(True)

    class Rejecting:
        def __init__(self, graph):
            raise QdslError("unknown rq_kind 2")

    rt.CompiledGraph = Rejecting
    monkeypatch.setitem(sys.modules, "qdsl.runtime", rt)
    with pytest.warns(RuntimeWarning, match="cannot run this graph.*rq_kind 2"):
        y = run_graph(GRAPH, X)
    np.testing.assert_array_equal(y, execute(GRAPH, X).outputs[0])
    with pytest.raises(QdslError, match="rq_kind"):
        run_graph(GRAPH, X, backend="cpp")


def test_auto_falls_back_with_one_warning(monkeypatch):
    rt, _ = fake_runtime(False)
    monkeypatch.setitem(sys.modules, "qdsl.runtime", rt)
    monkeypatch.setattr(qe, "_warned_slow", False)
    with pytest.warns(RuntimeWarning, match="reference executor"):
        y = run_graph(graph_to_bytes(GRAPH), X)
    np.testing.assert_array_equal(y, execute(GRAPH, X).outputs[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_graph(GRAPH, X)  # no second warning
    with pytest.raises(QdslError, match="extension not built"):
        run_graph(GRAPH, X, backend="cpp")


def test_torch_tensor_input():
    torch = pytest.importorskip("torch")
    np.testing.assert_array_equal(run_graph(GRAPH, torch.from_numpy(X), backend="reference"), execute(GRAPH, X).outputs[0])


def test_qdsl_export_is_callable_even_after_importing_the_package():
    import qdsl
    import qdsl.export

    assert callable(qdsl.export)
    with pytest.raises(QdslError, match="qdsl.apply"):
        qdsl.export(object.__new__(type("M", (), {})), None)


def test_compiled_form_is_cached_per_graph_and_runtime(monkeypatch):
    from .test_qgraph import sample_graph

    g = sample_graph()
    rt, calls = fake_runtime(True)
    monkeypatch.setitem(sys.modules, "qdsl.runtime", rt)
    for _ in range(3):
        assert run_graph(g, X) == "cpp-result"
    assert calls == [g]
    rt2, calls2 = fake_runtime(True)  # another runtime (CompiledGraph class): its own entry
    monkeypatch.setitem(sys.modules, "qdsl.runtime", rt2)
    run_graph(g, X)
    run_graph(g, X)
    assert calls2 == [g] and calls == [g]

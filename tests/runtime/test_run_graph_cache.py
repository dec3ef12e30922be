"""``run_graph`` compiles a graph once (kept on the graph object) and compiles again when
the graph was changed behind its frozen records; results always equal the reference."""

from __future__ import annotations

import copy
import pickle
import threading

import attrs
import numpy as np
import pytest

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph import execute  # noqa: E402
from qdsl.runtime.run import run_graph  # noqa: E402
from qdsl.graph.ir import OutputStage  # noqa: E402
from qdsl.graph.requant import make_rescale  # noqa: E402

from tests.export.test_qgraph import sample_graph  # noqa: E402

X = np.random.default_rng(1).random((3, 3, 6, 6)).astype(np.float32)


@pytest.fixture
def compiles(monkeypatch):
    calls: list = []

    class Counting(rt.CompiledGraph):
        def __init__(self, graph):
            calls.append(graph)
            super().__init__(graph)

    monkeypatch.setattr(rt, "CompiledGraph", Counting)
    return calls


def _ref(graph):
    return execute(graph, X).outputs[0]


def test_second_call_reuses_the_compiled_graph(compiles):
    g = sample_graph()
    for _ in range(3):
        np.testing.assert_array_equal(run_graph(g, X), _ref(g))
    assert len(compiles) == 1
    run_graph(g, X, backend="cpp")
    assert len(compiles) == 1


def test_replaced_constant_recompiles(compiles):
    g = sample_graph()
    before = run_graph(g, X)
    t = g.tensor("conv.weight")
    new = np.clip(-t.data, -8, 7)
    new.setflags(write=False)
    object.__setattr__(t, "data", new)  # bypassing the frozen record
    after = run_graph(g, X)
    assert len(compiles) == 2
    np.testing.assert_array_equal(after, _ref(g))
    assert not np.array_equal(after, before)


def test_unlocked_array_written_in_place_recompiles(compiles):
    g = sample_graph()
    before = run_graph(g, X)
    w = g.tensor("conv.weight").data
    w.setflags(write=True)
    w[...] = np.clip(-w, -8, 7)
    after = run_graph(g, X)
    np.testing.assert_array_equal(after, _ref(g))
    assert not np.array_equal(after, before) and len(compiles) == 2
    run_graph(g, X)  # same bytes: fingerprinted, not recompiled
    assert len(compiles) == 2


def test_replaced_ops_recompile(compiles):
    g = sample_graph()
    before = run_graph(g, X)
    ops = list(g.ops)
    conv = ops[1]
    attrs_ = dict(conv.attrs)
    attrs_.update(OutputStage(make_rescale([0.002, 0.004, 0.006, 0.008]), 0, 0, 127).attrs())
    ops[1] = attrs.evolve(conv, attrs=attrs_)
    object.__setattr__(g, "ops", tuple(ops))
    after = run_graph(g, X)
    assert len(compiles) == 2
    np.testing.assert_array_equal(after, _ref(g))
    assert not np.array_equal(after, before)


def test_new_graph_objects_get_their_own_cache(compiles):
    g = sample_graph()
    run_graph(g, X)
    h = attrs.evolve(g, name="renamed")
    run_graph(h, X)
    run_graph(g, X)
    assert len(compiles) == 2
    for c in (copy.deepcopy(g), pickle.loads(pickle.dumps(g))):
        assert c == g and not c._cache
        np.testing.assert_array_equal(run_graph(c, X), _ref(g))
    assert len(compiles) == 4


def test_each_thread_compiles_once(compiles):
    g = sample_graph()
    run_graph(g, X)
    out = []
    th = threading.Thread(target=lambda: out.extend([run_graph(g, X), run_graph(g, X)]))
    th.start()
    th.join()
    assert len(compiles) == 2
    for y in out:
        np.testing.assert_array_equal(y, _ref(g))

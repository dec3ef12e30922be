"""MUL (docs/qgraph.md §4.4): the C++ op equals the Python reference bit for bit on every
kernel path this CPU has, over broadcast shapes (squeeze-excitation's (N,C,H,W) * (N,C,1,1)
in either order, same shapes, any same-rank numpy broadcast), I8/U8 operand and output
mixes, any zero points and any output stage the format allows; the C++ loader rejects
operands that do not broadcast (tests/export/test_mul.py: the reference's semantics and
the Python loader)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph import execute, graph_to_bytes  # noqa: E402
from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, OutputStage, Rescale, Tensor  # noqa: E402
from qdsl.graph.ops.mul import broadcast_shape  # noqa: E402

from tests.runtime.test_elementwise_paths import _any_rescale  # noqa: E402
from tests.runtime.test_graph import _check, _rand  # noqa: E402

DIMS = [1, 2, 3, 5, 7, 8, 9, 16, 17, 33]


def _mul_graph(s0, s1, d0, d1, out, attrs, validate=True) -> IntegerGraph:
    shape = broadcast_shape(s0, s1) or s0
    g = IntegerGraph([Tensor("x0", d0, s0), Tensor("x1", d1, s1), Tensor("y", out, shape)], ["x0", "x1"], ["y"],
                     [Op(OpType.MUL, "se", ["x0", "x1"], ["y"], attrs)])
    return g.validate() if validate else g


def _shapes(rng, kind: str):
    rank = int(rng.integers(2, 6))
    full = [-1] + [int(rng.choice(DIMS)) for _ in range(rank - 1)]
    if kind == "same":
        return tuple(full), tuple(full)
    if kind == "se":  # (N, C, H, W) * (N, C, 1, 1), the gate on either side
        full = [-1, int(rng.choice(DIMS)), int(rng.choice(DIMS)), int(rng.choice(DIMS))]
        gate = full[:2] + [1, 1]
        return (tuple(full), tuple(gate)) if rng.random() < 0.5 else (tuple(gate), tuple(full))
    # any broadcast: each dim of each operand independently the full size or 1
    a = [full[0]] + [d if rng.random() < 0.6 else 1 for d in full[1:]]
    b = [full[0]] + [d if rng.random() < 0.6 or a[i + 1] == 1 else 1 for i, d in enumerate(full[1:])]
    return tuple(a), tuple(b)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), kind=st.sampled_from(["se", "same", "any"]),
       d0=st.sampled_from([DType.I8, DType.U8]), d1=st.sampled_from([DType.I8, DType.U8]),
       out=st.sampled_from([DType.I8, DType.U8]))
def test_mul_matches_reference_on_every_path(seed, kind, d0, d1, out):
    rng = np.random.default_rng(seed)
    s0, s1 = _shapes(rng, kind)
    zps = [int(rng.choice([0, lo, hi, int(rng.integers(lo, hi + 1))])) for lo, hi in (d0.range, d1.range)]
    lo, hi = out.range
    omin = int(rng.integers(lo, hi + 1))
    stage = OutputStage(_any_rescale(rng), int(rng.integers(lo, hi + 1)), omin, int(rng.integers(omin, hi + 1)))
    graph = _mul_graph(s0, s1, d0, d1, out, {"in_zp": zps, **stage.attrs()})
    b = int(rng.integers(1, 4))
    _check(graph, _rand(rng, d0, (b, *s0[1:])), _rand(rng, d1, (b, *s1[1:])))


@pytest.mark.parametrize("d0,d1", [(DType.U8, DType.U8), (DType.I8, DType.U8), (DType.I8, DType.I8)])
def test_mul_extreme_products_saturate_exactly(d0, d1):
    # the largest |(x0 - zp0)(x1 - zp1)| = 255 * 255 with an identity stage saturates at the
    # output range; a factor 2^-8 (POT) and a gemmlowp one bring it back inside
    lo0, hi0 = d0.range
    lo1, hi1 = d1.range
    x0 = np.array([[lo0, hi0, lo0, hi0, 0, 1, lo0 + 1, hi0 - 1, lo0]], dtype=d0.numpy)
    x1 = np.array([[lo1, hi1, hi1, lo1, 0, 1, hi1, lo1, lo1 + 1]], dtype=d1.numpy)
    for rescale in (Rescale(1, (1,), (0,)), Rescale(1, (1,), (8,), 1), Rescale(0, (1 << 30,), (8,)),
                    Rescale(2, (1518500250,), (7,), 3)):
        for zps in ([hi0, lo1], [lo0, hi1], [0, 0]):
            g = _mul_graph((-1, 9), (-1, 9), d0, d1, DType.I8, {"in_zp": zps, **OutputStage(rescale, 3, -128, 127).attrs()})
            _check(g, x0, x1)


def test_se_gate_on_every_path():
    rng = np.random.default_rng(0)
    g = _mul_graph((-1, 3, 4, 5), (-1, 3, 1, 1), DType.U8, DType.U8, DType.U8,
                   {"in_zp": [0, 0], **OutputStage(Rescale(1, (1,), (8,), 1), 0, 0, 255).attrs()})
    _check(g, _rand(rng, DType.U8, (2, 3, 4, 5)), _rand(rng, DType.U8, (2, 3, 1, 1)))


def test_mul_cpp_loader_rejects_what_python_rejects(monkeypatch):
    attrs = {"in_zp": [0, 0], **OutputStage(Rescale.identity(), 0, -128, 127).attrs()}
    monkeypatch.setattr("qdsl.graph.qgraph.validate_graph", lambda graph: None)  # write them unchecked
    cases = [
        (_mul_graph((-1, 3, 4), (-1, 2, 4), DType.I8, DType.I8, DType.I8, attrs, validate=False), "do not broadcast"),
        (_mul_graph((-1, 3, 4), (-1, 3), DType.I8, DType.I8, DType.I8, attrs, validate=False), "same rank"),
        (_mul_graph((-1, 4), (-1, 4), DType.U8, DType.I8, DType.I8, {**attrs, "in_zp": [-1, 0]}, validate=False),
         "in_zp -1 outside"),
        (_mul_graph((-1, 4), (-1, 4), DType.I8, DType.I8, DType.I8, {**attrs, "in_zp": [0]}, validate=False),
         "'in_zp' needs 2 entries"),
    ]
    for g, msg in cases:
        with pytest.raises(GraphFormatError, match=msg):
            rt.CompiledGraph(graph_to_bytes(g))

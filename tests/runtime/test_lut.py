"""The C++ LUT op equals the reference executor bit for bit on exported activation models
(every construct, both specs, every kernel path), and its loader rejects malformed tables."""

from __future__ import annotations

import numpy as np
import pytest

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph import execute, graph_to_bytes  # noqa: E402
from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, Tensor  # noqa: E402
from qdsl.runtime import kernels as K  # noqa: E402
from tests.export.lut_models import ACTS, SPECS, exported  # noqa: E402

PATHS = [p for p in ("ref", "portable", "avx2", "avxvnni", "avx512", "amx") if p in K.paths()["cpu"]]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("act", sorted(ACTS))
def test_exported_lut_models_bit_exact(act, spec):
    _, graph, x = exported(act, spec)
    assert any(op.type is OpType.LUT for op in graph.ops)
    x = x.numpy()
    want = execute(graph, x).outputs[0]
    cg = rt.CompiledGraph(graph)
    for path in PATHS:
        np.testing.assert_array_equal(cg.run(x, path=path), want, err_msg=f"path {path}")


@pytest.mark.parametrize("x_dtype", [DType.I8, DType.U8])
@pytest.mark.parametrize("y_dtype", [DType.I8, DType.U8])
def test_lut_every_code(x_dtype, y_dtype):
    rng = np.random.default_rng(int(x_dtype) * 10 + int(y_dtype))
    lo, hi = y_dtype.range
    table = tuple(int(v) for v in rng.integers(lo, hi + 1, 256))
    g = IntegerGraph([Tensor("x", x_dtype, (-1, 256)), Tensor("y", y_dtype, (-1, 256))], ["x"], ["y"],
                     [Op(OpType.LUT, "act", ["x"], ["y"], {"table": table})]).validate()
    xlo, xhi = x_dtype.range
    x = np.arange(xlo, xhi + 1).astype(x_dtype.numpy)[None].repeat(3, axis=0)
    got = rt.CompiledGraph(g).run(x)
    np.testing.assert_array_equal(got, execute(g, x).outputs[0])
    np.testing.assert_array_equal(got[0], np.array(table))


@pytest.mark.parametrize("table,y_dtype,msg", [
    (tuple(range(255)), DType.U8, "'table' must have 256 entries .*got 255"),
    (tuple(range(257)), DType.U8, "'table' must have 256 entries .*got 257"),
    (tuple(range(256)), DType.I8, r"table entry 128 = 128 outside the output dtype \[-128, 127\]"),
    ((-1,) + (0,) * 255, DType.U8, r"table entry 0 = -1 outside the output dtype \[0, 255\]"),
])
def test_malformed_lut_is_rejected_by_the_cpp_loader(table, y_dtype, msg, monkeypatch):
    g = IntegerGraph([Tensor("x", DType.I8, (-1, 4)), Tensor("y", y_dtype, (-1, 4))], ["x"], ["y"],
                     [Op(OpType.LUT, "act", ["x"], ["y"], {"table": table})])
    monkeypatch.setattr("qdsl.graph.qgraph.validate_graph", lambda graph: None)  # write it unchecked
    blob = graph_to_bytes(g)
    with pytest.raises(GraphFormatError, match=msg):
        rt.CompiledGraph(blob)


@pytest.mark.parametrize("op_type, shape", [(OpType.LUT, (-1, 77)), (OpType.LUT, (-1, 3, 300)),
                                            (OpType.LUT_CHANNEL, (-1, 3, 37)), (OpType.LUT_CHANNEL, (-1, 2, 65))])
@pytest.mark.parametrize("threads", [1, 2])
def test_lut_vector_tails_every_path(op_type, shape, threads):
    """The vector gather (32 bytes a step) on lengths with tails, every code present, per
    channel tables too, at 1 and 2 threads, every path against the reference."""
    rng = np.random.default_rng(len(shape) * 7 + threads)
    channels = shape[1] if op_type is OpType.LUT_CHANNEL else 1
    table = tuple(int(v) for v in rng.integers(-128, 128, 256 * channels))
    g = IntegerGraph([Tensor("x", DType.U8, shape), Tensor("y", DType.I8, shape)], ["x"], ["y"],
                     [Op(op_type, "act", ["x"], ["y"], {"table": table})]).validate()
    x = rng.integers(0, 256, (5, *shape[1:])).astype(np.uint8)
    x.reshape(-1)[:256] = np.arange(256)
    want = execute(g, x).outputs[0]
    cg = rt.CompiledGraph(g)
    rt.set_num_threads(threads)
    try:
        for path in PATHS:
            np.testing.assert_array_equal(cg.run(x, path=path), want, err_msg=f"path {path}")
    finally:
        rt.set_num_threads(0)

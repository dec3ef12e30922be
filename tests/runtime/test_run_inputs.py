"""``CompiledGraph.run``'s input handling and outputs: a contiguous array of the input's own
dtype is passed to the runtime as it is, anything else is converted first; either way the
result equals the reference, the input is never written, each call returns new output
arrays (a later run leaves an earlier result alone), bad inputs raise ``GraphInputError``
naming the input, and ``overflow_counts`` reports the last run."""

from __future__ import annotations

import numpy as np
import pytest

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Tensor  # noqa: E402
from qdsl.graph.reference import GraphInputError, execute  # noqa: E402
from qdsl.graph.requant import make_rescale  # noqa: E402
from qdsl.runtime.errors import RuntimeError_  # noqa: E402
from qdsl.spec.diagnostics import NonFiniteError  # noqa: E402

_CONV = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1, "w_zp": [0], "acc_bits": 32,
         "overflow": 0}


def _float_graph() -> IntegerGraph:
    """x (F32) -> QUANTIZE -> 3x3 conv -> y (I8)."""
    w = np.random.default_rng(0).integers(-127, 128, (4, 2, 3, 3)).astype(np.int8)
    tensors = [Tensor("x", DType.F32, (-1, 2, 6, 6)), Tensor("q", DType.U8, (-1, 2, 6, 6)),
               Tensor("w", DType.I8, w.shape, w), Tensor("y", DType.I8, (-1, 4, 6, 6))]
    ops = [Op(OpType.QUANTIZE, "q", ["x"], ["q"], {"scale": 0.02, "zero_point": 128, "qmin": 0, "qmax": 255,
                                                     "rounding": 1}),
           Op(OpType.CONV2D, "conv", ["q", "w"], ["y"],
              {**_CONV, "in_zp": 128, **OutputStage(make_rescale(0.001), 0, -128, 127).attrs()})]
    return IntegerGraph(tensors, ["x"], ["y"], ops).validate()


def _u8_graph(acc_bits: int = 32) -> IntegerGraph:
    """x (U8, 50 features) -> LINEAR -> y (I8); acc_bits 16 overflows on large inputs."""
    w = np.full((4, 50), 127, np.int8)
    tensors = [Tensor("x", DType.U8, (-1, 50)), Tensor("w", DType.I8, w.shape, w), Tensor("y", DType.I8, (-1, 4))]
    stage = OutputStage(make_rescale(0.0001), 0, -128, 127).attrs()
    ops = [Op(OpType.LINEAR, "fc", ["x", "w"], ["y"], {"in_zp": 0, "w_zp": [0], "acc_bits": acc_bits,
                                                        "overflow": 0, **stage})]
    return IntegerGraph(tensors, ["x"], ["y"], ops).validate()


def _ref(graph: IntegerGraph, x: np.ndarray) -> np.ndarray:
    return execute(graph, [x]).outputs[0]


def test_contiguous_input_is_only_read_and_results_stay_put():
    graph = _float_graph()
    cg = rt.CompiledGraph(graph)
    rng = np.random.default_rng(1)
    x1 = rng.standard_normal((3, 2, 6, 6)).astype(np.float32)
    x2 = rng.standard_normal((3, 2, 6, 6)).astype(np.float32)
    keep = x1.copy()
    y1 = cg.run(x1)
    np.testing.assert_array_equal(x1, keep)  # the input is not written
    want1 = _ref(graph, keep)
    np.testing.assert_array_equal(y1, want1)
    x1[:] = x2  # the caller reuses its input array for the next run
    y2 = cg.run(x1)
    np.testing.assert_array_equal(y2, _ref(graph, x2))
    np.testing.assert_array_equal(y1, want1)  # the first result is unchanged by the second run
    assert not np.shares_memory(y1, y2) and not np.shares_memory(y2, x1)
    assert y1.flags.owndata and y1.flags.writeable
    y2[:] = 0  # writing a result does not touch the next run's
    np.testing.assert_array_equal(cg.run(x1), _ref(graph, x2))


def test_other_layouts_and_dtypes_give_the_contiguous_result():
    torch = pytest.importorskip("torch")
    graph = _float_graph()
    cg = rt.CompiledGraph(graph)
    base = np.random.default_rng(2).standard_normal((2, 2, 6, 12)).astype(np.float32)
    strided = base[:, :, :, ::2]  # not contiguous
    want = _ref(graph, np.ascontiguousarray(strided))
    variants = {
        "strided": strided,
        "fortran": np.asfortranarray(strided),
        "float64": strided.astype(np.float64),  # rounded to float32, as the reference does
        "torch": torch.from_numpy(np.ascontiguousarray(strided)),
        "torch transposed": torch.from_numpy(np.ascontiguousarray(strided.transpose(0, 1, 3, 2))).transpose(2, 3),
        "list": [strided],
        "dict": {"x": strided},
    }
    for name, x in variants.items():
        got = cg.run(x)
        got = got["y"] if isinstance(got, dict) else got
        np.testing.assert_array_equal(got, want, err_msg=name)
    half = strided.astype(np.float16)
    np.testing.assert_array_equal(cg.run(half), _ref(graph, half.astype(np.float32)))

    ugraph = _u8_graph()
    ucg = rt.CompiledGraph(ugraph)
    xu = np.random.default_rng(3).integers(0, 256, (5, 50))
    want = _ref(ugraph, xu.astype(np.uint8))
    for x in (xu.astype(np.uint8), xu.astype(np.int64), xu.astype(np.int32)[::-1][::-1], np.asfortranarray(xu)):
        np.testing.assert_array_equal(ucg.run(x), want)


def test_bad_inputs_raise_naming_the_input():
    cg = rt.CompiledGraph(_float_graph())
    ok = np.zeros((1, 2, 6, 6), np.float32)
    with pytest.raises(GraphInputError, match=r"input 'x' expects shape \(-1, 2, 6, 6\)"):
        cg.run(np.zeros((1, 2, 6, 5), np.float32))  # contiguous float32, wrong shape
    with pytest.raises(GraphInputError, match="input 'x' expects shape"):
        cg.run(np.zeros((2, 6, 6), np.float32))
    with pytest.raises(GraphInputError, match="input 'x' expects float32 values, got int8"):
        cg.run(np.zeros((1, 2, 6, 6), np.int8))
    bad = ok.copy()
    bad[0, 1, 2, 3] = np.nan
    with pytest.raises(NonFiniteError, match="'x'"):
        cg.run(bad, check_finite=True)
    cg.run(bad)  # without the check, NaN follows the QUANTIZE policy
    with pytest.raises(RuntimeError_, match="unknown kernel path"):
        cg.run(ok, path="nope")
    with pytest.raises(RuntimeError_, match="unknown kernel path"):
        cg.run(ok, path=["avx2"])
    with pytest.raises(GraphInputError, match="graph takes 1 input"):
        cg.run(ok, ok)
    ucg = rt.CompiledGraph(_u8_graph())
    with pytest.raises(GraphInputError, match=r"input 'x' values must be in \[0, 255\]"):
        ucg.run(np.full((1, 50), -1, np.int8))  # an int8 array for a U8 input: checked, not reinterpreted
    with pytest.raises(GraphInputError, match="values must be in"):
        ucg.run(np.full((1, 50), 256, np.int32))


def test_overflow_counts_report_the_last_run():
    graph = _u8_graph(acc_bits=16)
    cg = rt.CompiledGraph(graph)
    assert cg.overflow_counts() == {}
    big = np.full((3, 50), 255, np.uint8)
    cg.run(big)
    assert cg.overflow_counts() == execute(graph, [big]).overflow == {"fc": 12}
    cg.run(np.ones((2, 50), np.uint8))
    assert cg.overflow_counts() == {"fc": 0}
    cg.run(big)
    cg.run(np.zeros((0, 50), np.uint8))
    assert cg.overflow_counts() == {"fc": 0}
    missing = [p for p in ("amx", "avx512", "avxvnni") if p not in rt.kernels.paths()["cpu"]]
    if missing:  # a run that raised reports no counts (not the previous run's)
        cg.run(big)
        with pytest.raises(RuntimeError_, match="cannot run here"):
            cg.run(big, path=missing[0])
        assert cg.overflow_counts() == {}

"""benchmarks/op_ab.py: on a small saved graph, both contenders (this library under two
environments) profile the same ops and the script prints a row per op and the sum line
(figures are never asserted)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import qdsl.runtime as rt

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")


def test_op_ab_smoke(tmp_path):
    from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Tensor
    from qdsl.graph.qgraph import save_graph
    from qdsl.graph.requant import make_rescale

    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (8, 3, 3, 3)).astype(np.int8)
    attrs = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1, "in_zp": 0, "w_zp": [0],
             "acc_bits": 32, "overflow": 0,
             **OutputStage(make_rescale(np.full(8, 1e-3), allow_pot=False, single=True), 0, 0, 127).attrs()}
    g = IntegerGraph([Tensor("x", DType.F32, (-1, 3, 16, 16)), Tensor("q", DType.U8, (-1, 3, 16, 16)),
                      Tensor("w", DType.I8, w.shape, w), Tensor("y", DType.U8, (-1, 8, 16, 16))], ["x"], ["y"],
                     [Op(OpType.QUANTIZE, "quant", ["x"], ["q"],
                         {"scale": 0.05, "zero_point": 0, "qmin": 0, "qmax": 127, "rounding": 1}),
                      Op(OpType.CONV2D, "conv", ["q", "w"], ["y"], attrs)]).validate()
    path = tmp_path / "tiny.qgraph"
    save_graph(g, str(path))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "op_ab.py"), str(path), "--base-env",
                          "QDSL_REGISTER_STAGE=0", "--size", "16", "--rounds", "2", "--runs", "2", "--min-ms", "0"],
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines()]
    conv = next(r for r in rows if len(r) > 1 and r[1] == "conv")
    assert float(conv[2]) > 0 and float(conv[3]) > 0
    assert "sum of all ops:" in out and "load" in out


def test_cpu_ab_cache_takes_op_gap_files(tmp_path):
    """cpu_ab.py --cache: the graph and ORT model op_gap.py --cache saved, else (None, None)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cpu_ab

    assert cpu_ab._cached(str(tmp_path), "mobilenet_v2", 7) == (None, None)
    (tmp_path / "mobilenet_v2_224").mkdir()
    (tmp_path / "mobilenet_v2_224_a7.qgraph").write_bytes(b"")
    assert cpu_ab._cached(str(tmp_path), "mobilenet_v2", 7) == (None, None)  # no ORT model yet
    (tmp_path / "mobilenet_v2_224" / "u8s8a7.onnx").write_bytes(b"")
    graph, onnx = cpu_ab._cached(str(tmp_path), "mobilenet_v2", 7)
    assert graph == str(tmp_path / "mobilenet_v2_224_a7.qgraph")
    assert onnx == str(tmp_path / "mobilenet_v2_224" / "u8s8a7.onnx")
    assert cpu_ab._cached(str(tmp_path), "mobilenet_v2", 8) == (None, None)

"""``qdsl run``: a saved graph runs from the command line; bad input exits 2 with a message."""

import numpy as np

from qdsl.cli.main import main
from qdsl.graph import execute, save_graph

from .test_qgraph import GRAPH


def test_run_writes_the_reference_output(tmp_path, capsys):
    g, x = tmp_path / "g.qgraph", tmp_path / "x.npy"
    save_graph(GRAPH, g)
    xs = np.random.default_rng(0).random((4, 3, 6, 6)).astype(np.float32)
    np.save(x, xs)
    out = tmp_path / "y.npy"
    assert main(["run", str(g), "--input", str(x), "--output", str(out), "--backend", "reference"]) == 0
    np.testing.assert_array_equal(np.load(out), execute(GRAPH, xs).outputs[0])
    assert main(["run", str(g), "--input", str(x), "--overflow"]) == 0
    text = capsys.readouterr().out
    assert "overflow conv: 0" in text and "y: float32[4, 5] argmax" in text


def test_run_reports_bad_files(tmp_path, capsys):
    g, x = tmp_path / "g.qgraph", tmp_path / "x.npy"
    g.write_bytes(b"QDSLGRPH" + bytes(100))
    np.save(x, np.zeros((1, 3, 6, 6), dtype=np.float32))
    assert main(["run", str(g), "--input", str(x)]) == 2
    assert "invalid integer graph" in capsys.readouterr().err
    save_graph(GRAPH, g)
    np.save(x, np.zeros((1, 2), dtype=np.float32))
    assert main(["run", str(g), "--input", str(x), "--backend", "reference"]) == 2
    assert "expects shape" in capsys.readouterr().err
    assert main(["run", str(g), "--input", str(tmp_path / "none.npy")]) == 2
    assert "cannot read input" in capsys.readouterr().err


def test_run_plan_prints_ranges_and_kernels(tmp_path, capsys):
    import pytest

    import qdsl.runtime as rt

    if not rt.available():
        pytest.skip(f"C++ runtime not built: {rt.load_error()}")
    g = tmp_path / "g.qgraph"
    save_graph(GRAPH, g)
    assert main(["run", str(g), "--plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["op", "type", "input", "range"]
    conv = next(line for line in lines if line.startswith("conv "))
    q = next(op for op in GRAPH.ops if op.type.name == "QUANTIZE")
    assert f"[{q.attrs['qmin']}, {q.attrs['qmax']}]" in conv and "vpmadd" in conv
    assert main(["run", str(g)]) == 2
    assert "needs --input" in capsys.readouterr().err


def test_run_plan_labels_every_op_once(tmp_path, capsys):
    """Ops sharing a name (a module called twice, a pool and its flatten) used to print the
    same label on several lines; each line now names a distinct op, with its type."""
    import pytest

    import qdsl.runtime as rt
    from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Tensor

    if not rt.available():
        pytest.skip(f"C++ runtime not built: {rt.load_error()}")
    ts = [Tensor("x", DType.U8, (-1, 2, 3)), Tensor("pool", DType.U8, (-1, 6)), Tensor("pool:2", DType.U8, (-1, 6)),
          Tensor("y", DType.U8, (-1, 6))]
    ops = [Op(OpType.RESHAPE, "pool", ["x"], ["pool"], {"shape": [6]}),
           Op(OpType.RESHAPE, "pool", ["pool"], ["pool:2"], {"shape": [6]}),
           Op(OpType.RESHAPE, "fc", ["pool:2"], ["y"], {"shape": [6]})]
    g = tmp_path / "dup.qgraph"
    save_graph(IntegerGraph(ts, ["x"], ["y"], ops).validate(), g)
    assert main(["run", str(g), "--plan"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[:2] for r in rows] == [["pool", "reshape"], ["pool:2", "reshape"], ["fc", "reshape"]]

"""benchmarks/op_gap.py: ORT node names map to the module paths qdsl's ops carry, both sides'
ops get the same match keys, and a test-width MobileNetV2 run prints a table whose stem row
has both systems' times (figures are never asserted)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _ort  # noqa: E402
import op_gap  # noqa: E402


@pytest.mark.parametrize("node,path", [
    ("/features/features.1/conv/conv.0/conv.0.0/Conv_quant", "features.1.conv.0.0"),
    ("/features/features.3/Add_quant", "features.3"),
    ("/layer1/layer1.0/conv1/Conv", "layer1.0.conv1"),
    ("/conv1/Conv_quant", "conv1"),
    ("/classifier/classifier.1/Gemm_quant", "classifier.1"),
    ("x_QuantizeLinear", ""),
])
def test_scope_path(node, path):
    assert op_gap.scope_path(node) == path


def test_keys_match_across_the_two_sides():
    qdsl_side = [("features.0.0:input", "QUANTIZE"), ("features.0.0", "CONV2D"), ("features.0.0", "CONV2D"),
                 ("features.1", "ADD"), ("<model>", "GLOBAL_AVGPOOL"), ("<output>", "DEQUANTIZE")]
    ort_side = [("", "QuantizeLinear"), ("features.0.0", "QLinearConv"), ("features.1", "QLinearAdd"),
                ("", "QLinearGlobalAveragePool"), ("", "DequantizeLinear")]
    q, o = op_gap.keyed(qdsl_side), op_gap.keyed(ort_side)
    assert q[0] == o[0] == ("(input)", "QUANTIZE", 0)
    assert q[1] == o[1] == ("features.0.0", "conv", 0) and q[2] == ("features.0.0", "conv", 1)  # a twin conv
    assert q[3] == o[2] and q[4] == o[3] == ("(head)", "POOL", 0) and q[5] == o[4]
    assert op_gap.block_of("features.3.conv.1") == "features.3" and op_gap.block_of("layer2.0.conv1") == "layer2.0"


def test_op_gap_smoke():
    if _ort.modules() is None:
        pytest.skip("onnxruntime not installed")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "op_gap.py"), "--small", "--size", "32",
                          "--rounds", "1", "--runs", "2", "--warmup", "1", "--calib-batches", "1", "--calib-batch", "2"],
                         capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    assert "op sums: qdsl" in out and "load average" in out and "per block" in out
    stem = next(line for line in out.splitlines() if line.strip().startswith("features.0.0 conv "))
    q_ms, o_ms = map(float, stem.split()[2:4])
    assert q_ms > 0 and o_ms > 0

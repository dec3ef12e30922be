"""The benchmark scripts' build paths work (not their timings): e2e.py exports, quantizes and
runs every contender on a test-width model for one round; kernels.py runs one small shape;
the onnxruntime helpers build exact-path models.  Figures are never asserted."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _ort  # noqa: E402
import e2e  # noqa: E402

SMOKE = ["--small", "--size", "32", "--batches", "2", "--threads", "1", "--rounds", "1", "--reps", "1",
         "--warmup", "0", "--calib-batches", "1", "--calib-batch", "2"]


def _check(results, model, systems=e2e.SYSTEMS):
    assert len(results) == 1
    r = results[0]
    assert r["model"] == model and r["batch"] == 2
    want = set(systems) if _ort.modules() is not None else set(systems) - set(e2e.ORT_SYSTEMS)
    assert set(r["times"]) == want
    assert all(len(t) == 1 and t[0] > 0 for t in r["times"].values())
    assert all(shape == (2, 10) for shape in r["shapes"].values())
    # every contender computes the same network: 8-bit integer outputs follow the float logits
    for s in ("qdsl a8", "ort u8u8", "ort u8s8"):
        if s in r["cosine"]:
            assert r["cosine"][s] > 0.9, (s, r["cosine"])


def test_e2e_resnet18_smoke(capsys):
    # one contender of each kind (eager torch, qdsl, onnxruntime) keeps this under a few seconds
    systems = ["torch fp32", "qdsl a8", "ort u8u8"]
    results = e2e.main(SMOKE + ["--models", "resnet18", "--systems", ",".join(systems)])
    _check(results, "resnet18", systems)
    out = capsys.readouterr().out
    assert "qdsl a8 / ort u8u8" in out or _ort.modules() is None
    assert "load average" in out


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet18", "mobilenet_v2", "resnet50"])
def test_e2e_every_contender_smoke(model):
    _check(e2e.main(SMOKE + ["--models", model]), model)


def test_e2e_rejects_unknown_model():
    with pytest.raises(SystemExit):
        e2e.parse_args(["--models", "vgg16"])


def test_ort_u8u8_is_exact_and_7bit_overrides_halve_the_codes(tmp_path):
    if _ort.modules() is None:
        pytest.skip("onnxruntime not installed")
    report = _ort.exactness_report(("MatMulInteger",))
    assert report[("MatMulInteger", "u8u8 a8")] == 0.0
    assert report[("MatMulInteger", "u8s8 a7")] == 0.0
    # a QDQ model's uint8 activation params moved to 7 bits: scale x 255/127, zero point x 127/255
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.array(0.1, np.float32), "s"),
             numpy_helper.from_array(np.array(200, np.uint8), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], inits)
    path = str(tmp_path / "qdq.onnx")
    onnx.save(helper.make_model(graph), path)
    over = _ort.seven_bit_overrides(path)
    assert list(over) == ["x"]
    assert float(over["x"][0]["scale"]) == pytest.approx(0.1 * 255 / 127)
    assert int(over["x"][0]["zero_point"]) == 100


def test_e2e_leaves_the_thread_counts_as_found():
    import qdsl.runtime as rt
    import torch

    before = (rt.get_num_threads(), torch.get_num_threads())
    e2e.main(SMOKE + ["--models", "resnet18", "--systems", "torch fp32,qdsl a8", "--threads", "2"])
    assert (rt.get_num_threads(), torch.get_num_threads()) == before


def test_kernels_quick_cpu_clock_smoke(capsys):
    import kernels

    kernels.main(["--quick", "--shapes", "7x13x19", "--rounds", "1", "--reps", "1", "--clock", "cpu"])
    out = capsys.readouterr().out
    assert out.startswith("CPU: ")
    assert "GOP/s (cpu time)" in out and "(7, 13, 19) 8-bit acts | qdsl i32" in out
    assert "qdsl gemm:                   0.000% of outputs differ" in out

"""The C++ runtime (when built) equals the reference executor bit for bit on exported graphs."""

import numpy as np
import pytest
import torch

import qdsl
from qdsl.export import export
from qdsl.graph import execute
from qdsl.runtime.run import run_graph
from qdsl.zoo.data import digits
from qdsl.zoo.models import digits_resnet

rt = pytest.importorskip("qdsl.runtime")
if not rt.available():  # pragma: no cover - depends on the build
    pytest.skip(f"C++ runtime not built: {rt.load_error()}", allow_module_level=True)


@pytest.mark.parametrize("spec", ["int8-default", "pot-asic", pytest.param("w4a8-per-channel", marks=pytest.mark.slow)])
def test_cpp_equals_reference_on_exported_graphs(spec):
    xtr, _, xte, _ = digits()
    model = digits_resnet(seed=0, width=8).eval()
    qdsl.apply(model, qdsl.load_spec(f"specs/{spec}.qspec"))
    qdsl.calibrate(model, [xtr[:256]])
    qdsl.freeze(model)
    x = xte[:100].numpy()
    for requant in ("gemmlowp", "single"):
        graph = export(model, xte[:2], requant=requant)
        np.testing.assert_array_equal(run_graph(graph, x, backend="cpp"), execute(graph, x).outputs[0])


def test_cpp_equals_reference_with_raw_accumulator_pooling():
    from qdsl.zoo.data import synthetic_keywords
    from qdsl.zoo.models import conv1d_net

    x = synthetic_keywords(n=300)[0]
    model = conv1d_net(seed=0).eval()
    qdsl.apply(model, qdsl.load_spec("specs/int8-default.qspec"))
    qdsl.calibrate(model, [x[:200]])
    qdsl.freeze(model)
    graph = export(model, x[:2], requant="single")
    xs = x[200:].numpy()
    np.testing.assert_array_equal(run_graph(graph, xs, backend="cpp"), execute(graph, xs).outputs[0])


def test_cpp_equals_reference_on_binary_graph():
    from .test_agreement import BINARY, BinaryCNN, _prepare

    xtr, _, xte, _ = digits()
    torch.manual_seed(0)
    graph = export(_prepare(BinaryCNN(), BINARY, xtr[:128]), xte[:2])
    x = xte[:100].numpy()
    np.testing.assert_array_equal(run_graph(graph, x, backend="cpp"), execute(graph, x).outputs[0])

"""The C++ runtime (when built) equals the reference executor bit for bit on exported graphs."""

import numpy as np
import pytest
import torch

import qdsl
from qdsl.export import execute, export, run_graph
from qdsl.testing.data import digits
from qdsl.testing.models import digits_resnet

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
    graph = export(model, xte[:2])
    x = xte[:100].numpy()
    np.testing.assert_array_equal(run_graph(graph, x, backend="cpp"), execute(graph, x).outputs[0])


def test_cpp_equals_reference_on_binary_graph():
    from .test_agreement import BINARY, BinaryCNN, _prepare

    xtr, _, xte, _ = digits()
    torch.manual_seed(0)
    graph = export(_prepare(BinaryCNN(), BINARY, xtr[:128]), xte[:2])
    x = xte[:100].numpy()
    np.testing.assert_array_equal(run_graph(graph, x, backend="cpp"), execute(graph, x).outputs[0])

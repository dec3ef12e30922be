"""A standard XNOR/BNN block (conv -> BN -> Hardtanh -> binary activation -> max-pool ->
binary conv ... -> linear) with the bundled xnor-binary spec, unedited: it trains, exports
with the max pools on BIN tensors, the C++ runtime equals the reference bit for bit, and the
graph agrees with the fake-quant model on top-1."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import qdsl
import qdsl.runtime as rt
from qdsl.export import export
from qdsl.graph import execute, graph_from_bytes, graph_to_bytes
from qdsl.graph.ir import DType, OpType
from qdsl.zoo.data import digits
from qdsl.zoo.models import _seeded


class XnorBlockNet(nn.Module):
    """8×8 digits: (conv-BN-Hardtanh-maxpool) ×2 (the second one padded, odd window), linear."""

    def __init__(self, rank: int = 2):
        super().__init__()
        conv, bn, pool = (nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d) if rank == 2 else (nn.Conv1d, nn.BatchNorm1d,
                                                                                    nn.MaxPool1d)
        self.rank = rank
        self.features = nn.Sequential(
            conv(1, 16, 3, padding=1, bias=False), bn(16), nn.Hardtanh(), pool(2),
            conv(16, 32, 3, padding=1, bias=False), bn(32), nn.Hardtanh(), pool(3, stride=2, padding=1),
        )
        self.classifier = nn.Linear(32 * (4 if rank == 2 else 16), 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1:
            x = torch.flatten(x, 2)  # 8×8 digits as 1×64 sequences
        return self.classifier(torch.flatten(self.features(x), 1))


@pytest.fixture(scope="module")
def data():
    return digits()


@pytest.mark.parametrize("rank", [2, 1])
def test_xnor_block_with_maxpool_exports_and_agrees(rank, data):
    xtr, ytr, xte, _ = data
    model = _seeded(XnorBlockNet(rank), 0)
    qdsl.apply(model, qdsl.load_spec("specs/xnor-binary.qspec"))
    # a training step runs (binary quantizers straight-through)
    model.train()
    loss = nn.functional.cross_entropy(model(xtr[:32]), ytr[:32])
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())
    model.zero_grad()
    model.eval()
    qdsl.calibrate(model, [xtr[:128]])
    qdsl.freeze(model)
    graph = graph_from_bytes(graph_to_bytes(export(model, xte[:2])))
    pool = OpType.MAXPOOL2D if rank == 2 else OpType.MAXPOOL1D
    bconv = OpType.BCONV2D if rank == 2 else OpType.BCONV1D
    pools = [op for op in graph.ops if op.type is pool]
    # the first pool reads the sign of the int8 first layer (BIN), the second the binary conv's int8 output
    assert graph.tensor(pools[0].inputs[0]).dtype is DType.BIN
    assert bconv in {op.type for op in graph.ops}
    x = xte[:256]
    with torch.no_grad():
        fq = model(x).numpy()
    res = execute(graph, x.numpy())
    assert (res.outputs[0].argmax(1) == fq.argmax(1)).mean() >= 0.98
    if rt.available():
        np.testing.assert_array_equal(rt.CompiledGraph(graph).run(x.numpy()), res.outputs[0])

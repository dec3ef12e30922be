"""``torch.cat`` along any non-batch axis (negative dims too) of 2-D, 3-D and 4-D activations
lowers to CONCAT, with specs/int8-default.qspec unedited (the implied quantizers cover the
operands); concatenating along the batch axis (the only axis of a 1-D tensor) is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qdsl
from qdsl.export.values import ExportError
from qdsl.graph.ir import OpType

from .e2e import assert_close, flow, op_types


class CatNet(nn.Module):
    """Two branches (layer -> ReLU(inplace)) concatenated along ``dim``, then a layer."""

    def __init__(self, rank: int, dim: int, cat=torch.cat):
        super().__init__()
        self.cat = cat
        layer = {2: lambda i, o: nn.Linear(i, o), 3: lambda i, o: nn.Conv1d(i, o, 3, padding=1),
                 4: lambda i, o: nn.Conv2d(i, o, 3, padding=1)}[rank]
        self.dim = dim
        self.a, self.b = layer(6, 4), layer(6, 4)
        self.ra, self.rb = nn.ReLU(inplace=True), nn.ReLU(inplace=True)
        self.out = layer(8 if dim % rank == 1 else 4, 5)  # a channel cat doubles the next layer's input

    def forward(self, x):
        return self.out(self.cat([self.ra(self.a(x)), self.rb(self.b(x))], dim=self.dim))


CASES = [(2, 1), (2, -1), (3, 1), (3, 2), (3, -1), (3, -2), (4, 1), (4, 2), (4, 3), (4, -1), (4, -2), (4, -3)]
SHAPES = {2: (6, 6), 3: (6, 6, 9), 4: (6, 6, 5, 7)}


@pytest.mark.parametrize("rank,dim", CASES, ids=[f"rank{r}-dim{d}" for r, d in CASES])
def test_cat_along_any_axis_exports_and_agrees(rank, dim):
    graph, diff = flow(CatNet(rank, dim), "int8-default", SHAPES[rank], "out")
    op = next(op for op in graph.ops if op.type is OpType.CONCAT)
    assert op.attrs["axis"] == dim % rank
    assert_close(diff)


@pytest.mark.parametrize("cat", [torch.concat, torch.concatenate], ids=["torch.concat", "torch.concatenate"])
def test_cat_aliases(cat):
    # torch.concat / torch.concatenate are torch.cat (was: no integer lowering)
    graph, diff = flow(CatNet(4, -1, cat), "int8-default", SHAPES[4], "out")
    assert OpType.CONCAT in op_types(graph)
    assert_close(diff)


def test_cat_along_the_batch_axis_is_refused_with_its_location():
    class BatchCat(CatNet):
        def forward(self, x):
            return self.out(torch.cat([self.ra(self.a(x)), self.rb(self.b(x))], dim=0))

    model = BatchCat(4, 2)
    qdsl.apply(model, "specs/int8-default.qspec")
    qdsl.calibrate(model, [torch.randn(2, 6, 5, 7)])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match="concatenation along the batch dimension"):
        qdsl.export(model, torch.randn(2, 6, 5, 7))


def test_cat_of_flattened_vectors():
    # torch.flatten to 2-D, then cat along dim -1 (the feature axis)
    class FlatCat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 2, 3), nn.Conv2d(3, 3, 3)
            self.fc = nn.Linear(2 * 9 + 3 * 9, 4)

        def forward(self, x):
            return self.fc(torch.cat([torch.flatten(self.a(x), 1), torch.flatten(self.b(x), 1)], -1))

    graph, diff = flow(FlatCat(), "int8-default", (6, 3, 5, 5), "fc")
    assert OpType.CONCAT in op_types(graph)
    assert_close(diff)


def test_cat_of_one_relu_module_called_twice():
    # one nn.ReLU instance applied to both branches: apply used to fail with KeyError 'r@1'
    # (fx names the second call "r@1"); no quantizer can go on a module called twice, so the
    # cat produces both pending branch results at its own output grid
    class SharedRelu(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
            self.r = nn.ReLU(inplace=True)
            self.out = nn.Conv2d(8, 4, 3, padding=1)

        def forward(self, x):
            return self.out(torch.cat([self.r(self.a(x)), self.r(self.b(x))], 1))

    graph, diff = flow(SharedRelu(), "int8-default", (4, 3, 6, 6), "out")
    assert OpType.CONCAT in op_types(graph)
    assert_close(diff)

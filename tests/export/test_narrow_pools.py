"""Pools and flatten on BIN and sub-byte activations.

Sub-byte activations are I8/U8 tensors with a narrower code range (the low-bit spec's 4-bit
``a4``: U8 codes 0..15), so every pool, flatten and reshape takes them as they are.  BIN
activations (one ±1 per element, zero point 0): max pool keeps BIN, flatten keeps BIN (a
binary linear reads it), and average / global average pools sum the ±1 codes into an 8-bit
output stage like any other input.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qdsl.graph.ir import DType, OpType

from .e2e import assert_close, flow, op_types

XNOR = """
version 1
fold_bn
quantizer wbin = binary(signed, per_channel, observer=mean_abs)
quantizer abin = binary(signed, per_tensor, observer=mean_abs)
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, signed, asymmetric, per_tensor, observer=minmax)
defaults {
  weight = wbin
  input = abin
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
rule conv0 {
  weight = w8
  input = a8
}
rule act0 {
  output = abin
}
"""
INT_FC = "rule fc {\n  weight = w8\n  input = a8\n}\n"


class BinPoolNet(nn.Module):
    """conv -> BN -> Hardtanh (binary output quantizer) -> pool -> flatten -> fc."""

    def __init__(self, pool: nn.Module, features: int):
        super().__init__()
        self.conv0 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(8)
        self.act0 = nn.Hardtanh()
        self.pool = pool
        self.fc = nn.Linear(features, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.act0(self.bn0(self.conv0(x)))), 1))


BIN_POOLS = {
    "MaxPool2d": (lambda: nn.MaxPool2d(2), 8 * 16, False, OpType.MAXPOOL2D),
    "AvgPool2d": (lambda: nn.AvgPool2d(2), 8 * 16, True, OpType.AVGPOOL2D),
    "AvgPool2d-pad": (lambda: nn.AvgPool2d(3, stride=2, padding=1), 8 * 16, True, OpType.AVGPOOL2D),
    "AdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d(1), 8, True, OpType.GLOBAL_AVGPOOL),
    "Identity": (lambda: nn.Identity(), 8 * 64, False, None),  # flatten only
}


@pytest.mark.parametrize("name", sorted(BIN_POOLS))
def test_pools_and_flatten_on_binary_activations(name):
    build, features, int_fc, pool_op = BIN_POOLS[name]
    spec = XNOR + (INT_FC if int_fc else "")
    graph, diff = flow(BinPoolNet(build(), features), spec, (6, 1, 8, 8), "fc")
    types = op_types(graph)
    if pool_op is not None:
        op = next(op for op in graph.ops if op.type is pool_op)
        assert graph.tensor(op.inputs[0]).dtype is DType.BIN
    reshape = next(op for op in graph.ops if op.type is OpType.RESHAPE)
    # a max pool and a flatten keep BIN (a binary linear reads it); an average is int8
    assert graph.tensor(reshape.inputs[0]).dtype is (DType.I8 if int_fc else DType.BIN)
    assert (OpType.LINEAR if int_fc else OpType.BLINEAR) in types
    assert_close(diff, exact=not int_fc)


class SubBytePoolNet(nn.Module):
    """conv-ReLU-maxpool, conv-ReLU-avgpool, conv-ReLU-global avgpool, flatten, linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3)
        self.r1, self.r2, self.r3 = nn.ReLU(inplace=True), nn.ReLU(inplace=True), nn.ReLU(inplace=True)
        self.mp, self.ap, self.gap = nn.MaxPool2d(2), nn.AvgPool2d(2, ceil_mode=False), nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.mp(self.r1(self.c1(x)))
        x = self.ap(self.r2(self.c2(x)))
        x = self.gap(self.r3(self.c3(x)))
        return self.fc(x.flatten(1))


def test_pools_and_flatten_on_four_bit_activations():
    # the bundled low-bit spec, unedited: 4-bit activations are U8 tensors with codes 0..15
    graph, diff = flow(SubBytePoolNet(), "low-bit", (4, 3, 12, 12), "fc")
    assert {OpType.MAXPOOL2D, OpType.AVGPOOL2D, OpType.GLOBAL_AVGPOOL, OpType.RESHAPE} <= set(op_types(graph))
    for op in graph.ops:
        if op.type in (OpType.AVGPOOL2D, OpType.GLOBAL_AVGPOOL):  # the stage clamps to the 4-bit range
            assert graph.tensor(op.outputs[0]).dtype is DType.U8 and 0 <= op.attrs["out_min"] <= op.attrs["out_max"] <= 15
    assert_close(diff)


class _PoolOfOne(nn.Module):
    """conv -> BN -> ReLU6 -> global average pool over a 1×1 map -> linear (MobileNetV2's head
    at 32×32 inputs)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 64, 3)
        self.bn = nn.BatchNorm2d(64)
        self.act = nn.ReLU6(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.act(self.bn(self.conv(x)))), 1))


def test_pool_of_one_element_keeps_large_values():
    # the pool's int32 input had 16 fraction bits, codes up to 1.5·2^30 for ReLU6's 6: the
    # factor's left shift saturated int32 for values whose code exceeded the multiplier, so a
    # pooled 4.91 became 4.80 (5 LSB; MobileNetV2 mixed-precision's features.18.0); the
    # codes now stay below 2^30 and the pool agrees with fake-quant layer by layer (before: 96%
    # of the pooled codes within 1 LSB, max 84 LSB off)
    import numpy as np

    from qdsl.export.lower import export as export_graph

    from .layer_agreement import layer_agreement

    import qdsl

    torch.manual_seed(0)
    model = _PoolOfOne()
    with torch.no_grad():
        # most outputs in ReLU6's upper range, per-channel scales spread (so are the multipliers)
        model.conv.weight.mul_(torch.linspace(4, 8, 64).view(-1, 1, 1, 1))
    qdsl.apply(model, "specs/int8-default.qspec")
    model.eval()
    qdsl.calibrate(model, [torch.randn(16, 8, 3, 3) for _ in range(2)])
    qdsl.freeze(model)
    graph, info = export_graph(model, torch.randn(1, 8, 3, 3), with_info=True)
    pool = next(op for op in graph.ops if op.type is OpType.GLOBAL_AVGPOOL)
    wide = next(op for op in graph.ops if op.outputs[0] in pool.inputs)
    assert wide.attrs["out_max"] < 2**30
    rows = layer_agreement(model, graph, info, np.asarray(torch.randn(64, 8, 3, 3)))
    row = next(r for r in rows if r.layer == "conv -> GLOBAL_AVGPOOL")
    assert row.within == 1.0, row

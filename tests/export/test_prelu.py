"""PReLU (one slope, or one per channel) lowers to exact lookup tables: LUT, or LUT_CHANNEL
(256 entries per channel) for a per-channel slope; its slope is read at export, so apply does
not list it as a parameter left in float.  ReLU6 (module and function) stays a CLAMP."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdsl
from qdsl.export.lower_layers import act_target
from qdsl.export.values import ExportError
from qdsl.graph import execute
from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Tensor
from qdsl.patch.coverage import LeftFloatWarning

from .e2e import assert_close, flow, op_types
from .lut_models import spec_text


class PNet(nn.Module):
    """conv -> BN -> activation -> conv -> flatten -> linear."""

    def __init__(self, act):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = act
        self.c2 = nn.Conv2d(8, 6, 3, padding=1)
        self.fc = nn.Linear(6 * 5 * 5, 10)

    def forward(self, x):
        y = self.act(self.bn(self.c1(x)))
        return self.fc(torch.flatten(self.c2(y), 1))


def _prelu(n: int) -> nn.PReLU:
    p = nn.PReLU(n)
    with torch.no_grad():  # distinct slopes, some negative and some above 1
        p.weight.copy_(torch.linspace(-0.5, 1.5, n))
    return p


@pytest.mark.parametrize("spec", ["int8-default", "signed-int8"])
@pytest.mark.parametrize("n", [1, 8])
def test_prelu_exports_as_tables_and_agrees(n, spec):
    # the table indexes c1's 8-bit output codes: the spec quantizes it (as tests/export/lut_models)
    graph, diff = flow(PNet(_prelu(n)), spec_text(spec), (4, 3, 5, 5), "c2")
    want = OpType.LUT if n == 1 else OpType.LUT_CHANNEL
    assert want in op_types(graph) and {OpType.LUT, OpType.LUT_CHANNEL} - {want} not in op_types(graph)
    op = next(op for op in graph.ops if op.type is want)
    assert len(op.attrs["table"]) == 256 * n
    assert_close(diff)


@pytest.mark.parametrize("n", [1, 8])
def test_prelu_with_int8_default_unedited(n):
    graph, diff = flow(PNet(_prelu(n)), "int8-default", (4, 3, 5, 5), "c2")
    assert (OpType.LUT if n == 1 else OpType.LUT_CHANNEL) in op_types(graph)
    assert_close(diff)


def test_per_channel_table_is_each_channels_function():
    model = PNet(_prelu(8))
    graph, _ = flow(model, spec_text("signed-int8"), (2, 3, 5, 5), "c2")
    op = next(op for op in graph.ops if op.type is OpType.LUT_CHANNEL)
    table = np.asarray(op.attrs["table"]).reshape(8, 256)
    # input code 127 (positive: the identity on every channel) and -128 (slope · x per channel)
    assert len({tuple(row[128:]) for row in table}) == 1
    assert len({int(row[0]) for row in table}) > 4


def test_prelu_slope_is_not_reported_as_left_float():
    model = PNet(_prelu(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeftFloatWarning)
        qdsl.apply(model, "specs/int8-default.qspec")


@pytest.mark.parametrize("act", [nn.ReLU6(), nn.ReLU6(inplace=True), F.relu6, nn.Hardtanh(-0.5, 2.0)],
                         ids=["ReLU6", "ReLU6-inplace", "F.relu6", "Hardtanh"])
def test_relu6_lowers_to_clamp(act):
    # int8-default unedited: fused into c1's output stage (no LUT, no separate CLAMP)
    model = PNet(act if isinstance(act, nn.Module) else _Fn(act))
    graph, diff = flow(model, "int8-default", (4, 3, 5, 5), "c2")
    assert OpType.LUT not in op_types(graph) and OpType.CLAMP not in op_types(graph)
    # the clamp is c1's output stage, at c2's input grid
    lo, hi = (-0.5, 2.0) if isinstance(act, nn.Hardtanh) and not isinstance(act, nn.ReLU6) else (0.0, 6.0)
    q = qdsl.patch.get_handle(model).quantizer("c2", "input")
    t = act_target(q, "c2:input")
    c1 = next(op for op in graph.ops if op.name == "c1")
    assert (c1.attrs["out_min"], c1.attrs["out_max"]) == t.clamp_codes(lo, hi)
    assert_close(diff)


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_lut_channel_reference_indexes_per_channel():
    rng = np.random.default_rng(0)
    table = tuple(int(v) for v in rng.integers(-128, 128, 3 * 256))
    g = IntegerGraph([Tensor("x", DType.U8, (-1, 3, 4)), Tensor("y", DType.I8, (-1, 3, 4))], ["x"], ["y"],
                     [Op(OpType.LUT_CHANNEL, "act", ["x"], ["y"], {"table": table})]).validate()
    x = rng.integers(0, 256, (2, 3, 4)).astype(np.uint8)
    y = execute(g, x).outputs[0]
    t = np.asarray(table).reshape(3, 256)
    np.testing.assert_array_equal(y, t[np.arange(3)[None, :, None], x.astype(np.int64)])


def test_prelu_has_no_onnx_form_and_says_so():
    pytest.importorskip("onnx")
    from qdsl.export.onnx import export_onnx
    from qdsl.parse import parse_text

    model = PNet(_prelu(8))
    qdsl.apply(model, parse_text(spec_text("int8-default"), "t.qspec"))
    qdsl.calibrate(model, [torch.randn(2, 3, 5, 5)])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match="LUT_CHANNEL.*no ONNX QDQ form"):
        export_onnx(model, torch.randn(1, 3, 5, 5))

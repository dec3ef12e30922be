"""LUT: elementwise activations (Hardswish, Hardsigmoid, SiLU, Sigmoid, Tanh, GELU,
LeakyReLU; modules and functions) between 8-bit quantizers export as a 256-entry lookup
table; the graph agrees with the fake-quant model; malformed tables are rejected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qdsl
from qdsl.export.values import ExportError
from qdsl.graph import execute, graph_from_bytes, graph_to_bytes
from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, Tensor
from qdsl.parse import parse_text
from qdsl.spec.model import Role
from tests.export.lut_models import ACTS, SPECS, ActNet, exported


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("act", sorted(ACTS))
def test_activation_exports_as_lut_within_one_lsb(act, spec):
    model, graph, x = exported(act, spec)
    luts = [op for op in graph.ops if op.type is OpType.LUT]
    assert len(luts) == 1 and len(luts[0].attrs["table"]) == 256
    with torch.no_grad():
        fq = model(x).numpy()
    got = execute(graph, x.numpy()).outputs[0]
    scale = float(qdsl.patch.get_handle(model).quantizer("fc", "output").scale)
    diff = np.rint(np.abs(got.astype(np.float64) - fq) / scale)
    print(f"{act} {spec}: {np.mean(diff > 0):.4%} codes differ, max {diff.max():.0f} LSB")
    assert np.mean(diff <= 1) >= 0.995


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("act", ["Hardswish", "SiLU", "GELU", "Tanh"])
def test_lut_codes_equal_the_next_quantizers_codes(act, spec):
    # the table is exact: the LUT's output codes are the codes c2's input quantizer gives
    # act(c1's dequantized output) in the fake-quant model
    model, graph, x = exported(act, spec)
    lut = next(op for op in graph.ops if op.type is OpType.LUT)
    got = execute(graph, x.numpy(), keep_values=True).values[lut.outputs[0]]
    h = qdsl.patch.get_handle(model)
    seen = {}
    hooks = [model.c2.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach().clone()))]
    with torch.no_grad():
        model(x)
    for hk in hooks:
        hk.remove()
    q = h.quantizer("c2", "input")
    codes = torch.round(seen["x"] / q.scale).to(torch.int64) + int(q.zero_point.reshape(-1)[0])
    np.testing.assert_array_equal(got.astype(np.int64), codes.numpy())


_NO_OUTPUTS = "version 1\nquantizer w8 = int(bits=8, signed, symmetric, per_channel, observer=minmax)\n" \
              "quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)\n" \
              "defaults {\n  weight = w8\n  input = a8\n}\n"


def test_lut_input_gets_an_implied_quantizer():
    # the table indexes 8-bit codes: a spec that leaves c1's output unquantized now gets an
    # implied one (qdsl.patch.implied); this was E402 "SiLU reads an unquantized value from 'c1'"
    model = ActNet(torch.nn.SiLU()).eval()
    handle = qdsl.apply(model, parse_text(_NO_OUTPUTS, "t.qspec"))
    assert handle.plan.layer("c1").provenance[(Role.OUTPUT, "kind")].set_by.label == "implied by silu 'act'"
    x = torch.randn(8, 3, 6, 6)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    assert any(op.type is OpType.LUT for op in qdsl.export.export(model, x[:2]).ops)


class _ActFirst(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.act, self.fc = torch.nn.SiLU(), torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.act(x))


def test_lut_needs_a_quantized_input():
    # a value no module returns (the model input) gets no implied quantizer: export names it
    # (qdsl.patch.unplaced: the same record lint reports as W321)
    model = _ActFirst().eval()
    qdsl.apply(model, parse_text(_NO_OUTPUTS, "t.qspec"))
    x = torch.randn(8, 4)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match="silu .*in 'act' reads the model input"):
        qdsl.export.export(model, x[:2])


def _lut_graph(table, x_dtype=DType.I8, y_dtype=DType.U8) -> IntegerGraph:
    return IntegerGraph([Tensor("x", x_dtype, (-1, 4)), Tensor("y", y_dtype, (-1, 4))], ["x"], ["y"],
                        [Op(OpType.LUT, "act", ["x"], ["y"], {"table": table})])


def test_lut_reference_indexes_from_the_lowest_input_code():
    table = tuple(range(255, -1, -1))  # U8 out: 255 - (x + 128) for I8 input
    g = _lut_graph(table).validate()
    x = np.array([[-128, -1, 0, 127]], dtype=np.int8)
    np.testing.assert_array_equal(execute(g, x).outputs[0], [[255, 128, 127, 0]])
    g8 = _lut_graph(table, DType.U8, DType.U8).validate()
    np.testing.assert_array_equal(execute(g8, np.array([[0, 1, 254, 255]], dtype=np.uint8)).outputs[0], [[255, 254, 1, 0]])


@pytest.mark.parametrize("table,y_dtype,msg", [
    (tuple(range(255)), DType.U8, "'table' must have length 256, got 255"),
    (tuple(range(257)), DType.U8, "'table' must have length 256, got 257"),
    (tuple(range(256)), DType.I8, r"'table' value 128 out of range \[-128, 127\]"),
    ((-1,) + (0,) * 255, DType.U8, r"'table' value -1 out of range \[0, 255\]"),
])
def test_malformed_lut_is_rejected_by_the_python_loader(table, y_dtype, msg, monkeypatch):
    g = _lut_graph(table, y_dtype=y_dtype)
    with pytest.raises(GraphFormatError, match=msg):
        g.validate()
    # a file written without validation fails to load too
    monkeypatch.setattr("qdsl.graph.qgraph.validate_graph", lambda graph: None)
    blob = graph_to_bytes(g)
    monkeypatch.undo()
    with pytest.raises(GraphFormatError, match=msg):
        graph_from_bytes(blob)


def test_lut_input_must_be_8_bit():
    g = IntegerGraph([Tensor("x", DType.F32, (-1, 4)), Tensor("y", DType.U8, (-1, 4))], ["x"], ["y"],
                     [Op(OpType.LUT, "act", ["x"], ["y"], {"table": (0,) * 256})])
    with pytest.raises(GraphFormatError, match="input 'x' has dtype F32, expected I8/U8"):
        g.validate()

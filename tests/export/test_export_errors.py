"""Constructs the exporter cannot lower give an ExportError naming the module and the fix."""

import pytest
import torch
from torch import nn

import qdsl
from qdsl.export import export
from qdsl.graph.ir import OpType
from qdsl.export.values import ExportError
from qdsl.parse import parse_text
from qdsl.patch.handle import get_handle
from qdsl.spec.diagnostics import QdslError
from qdsl.spec.model import Role
from qdsl.zoo.models import digits_resnet, mlp

BASE = """
version 1
{fold}
quantizer w = int(bits=8, signed, narrow, symmetric, scale=pot, per_channel, observer=minmax)
quantizer a = int(bits=8, signed, symmetric, scale=pot, per_tensor, observer=minmax)
defaults {{
  weight = w
  input = a
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}}
{extra}
"""

X = torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(0))


def prepared(model, extra="", fold="fold_bn", freeze=True):
    model.eval()
    qdsl.apply(model, parse_text(BASE.format(fold=fold, extra=extra), "t.qspec"))
    qdsl.calibrate(model, [X])
    if freeze:
        qdsl.freeze(model)
    return model


def test_mlp_exports_and_relu_is_fused_into_the_clamp():
    graph = export(prepared(mlp(sizes=(64, 32, 10))), X[:1])
    assert [op.type for op in graph.ops] == [OpType.QUANTIZE, OpType.RESHAPE, OpType.LINEAR, OpType.LINEAR,
                                             OpType.DEQUANTIZE]
    first = graph.ops[2]
    assert first.attrs["out_min"] == first.attrs["out_zp"]  # ReLU: nothing below the zero point


def test_unquantized_residual_operand_gets_an_implied_quantizer():
    # no `output` for the blocks: the plan implies one where an add reads a block's sum
    # (qdsl.patch.implied); this was E402 "the residual add reads a value from 'layer1.0'"
    model = prepared(digits_resnet(width=4))
    implied = {lp.fqn for lp in get_handle(model).plan.layers
               if (p := lp.provenance.get((Role.OUTPUT, "kind"))) is not None and p.set_by.label.startswith("implied")}
    assert "layer1.0" in implied
    assert any(op.type is OpType.ADD for op in export(model, X[:1]).ops)


BINARY_DEFAULT = """
version 1
fold_bn
defaults {
  weight = binary(signed, per_channel, observer=mean_abs)
  input = binary(signed, per_tensor, observer=mean_abs)
}
"""


def test_unquantized_residual_operand_names_the_block():
    # a binary default input with no integer activation anywhere in the plan implies nothing
    # (an integer add cannot read ±1 codes)
    model = digits_resnet(width=4).eval()
    qdsl.apply(model, parse_text(BINARY_DEFAULT, "t.qspec"))
    qdsl.calibrate(model, [X])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match=r"(?s)residual add.*output = a8"):
        export(model, X[:1])


def test_unfolded_batchnorm():
    with pytest.raises(ExportError, match=r"'stem\.1'.*BatchNorm.*not folded") as e:
        export(prepared(digits_resnet(width=4), "rule type:BasicBlock { output = a }", fold=""), X[:1])
    assert "fold_bn" in str(e.value)


def test_float_layer_between_integer_layers():
    model = prepared(mlp(sizes=(64, 32, 16, 10)), "rule net.3 { skip }")
    with pytest.raises(ExportError, match=r"'net\.3'.*left in float"):
        export(model, X[:1])


class WithLogSoftmax(nn.Module):
    # log-softmax is not elementwise and has no rule (softmax lowers to SOFTMAX, GELU & co. to LUT)
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(64, 32), nn.LogSoftmax(dim=1), nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x.flatten(1))))


def test_module_without_integer_lowering():
    with pytest.raises(ExportError, match=r"'act'.*LogSoftmax has no integer lowering"):
        export(prepared(WithLogSoftmax(), "rule act { output = a }"), X[:1])


def test_lifecycle_errors():
    with pytest.raises(ExportError, match="not frozen"):
        export(prepared(mlp(sizes=(64, 10)), freeze=False), X[:1])
    with pytest.raises(QdslError, match="qdsl.apply"):
        export(mlp(sizes=(64, 10)), X[:1])
    with pytest.raises(ExportError, match="requant"):
        export(prepared(mlp(sizes=(64, 10))), X[:1], requant="magic")


class TwoBranch(nn.Module):
    """Two conv branches with their own output grids, concatenated, max-pooled, classified."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(1, 4, 3, padding=1)
        self.b = nn.Conv2d(1, 6, 1)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(10 * 16, 10)

    def forward(self, x):
        y = torch.cat([torch.relu(self.a(x)), self.b(x)], dim=1)
        return self.head(torch.flatten(self.pool(y), 1))


def test_concat_of_differently_scaled_branches_is_bit_exact_for_pot():
    extra = "rule a, b {\n  output = a\n}\nrule head {\n  output = a\n}"
    torch.manual_seed(0)
    model = TwoBranch()
    with torch.no_grad():
        model.b.weight.mul_(16)  # a wider range: a coarser output grid than branch a
    model = prepared(model, extra)
    graph = export(model, X[:1])
    types = [op.type for op in graph.ops]
    assert OpType.CONCAT in types and OpType.MAXPOOL2D in types
    h = qdsl.patch.get_handle(model)
    assert float(h.quantizer("a", "output").scale) != float(h.quantizer("b", "output").scale)
    from qdsl.graph import execute

    with torch.no_grad():
        fq = model(X).numpy()
    assert (execute(graph, X.numpy()).outputs[0] == fq).all()


class FunctionalPools(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.c1(x)), 2)
        x = torch.nn.functional.adaptive_avg_pool2d(torch.relu(self.c2(x)), 1)
        return self.fc(x.view(x.size(0), -1))


def test_functional_pools_and_view_export_bit_exact():
    torch.manual_seed(0)
    model = prepared(FunctionalPools(), "rule fc {\n  output = a\n}")
    graph = export(model, X[:1])
    types = [op.type for op in graph.ops]
    assert OpType.MAXPOOL2D in types and OpType.GLOBAL_AVGPOOL in types
    from qdsl.graph import execute

    with torch.no_grad():
        fq = model(X).numpy()
    assert (execute(graph, X.numpy()).outputs[0] == fq).all()


class TokenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x.view(x.size(0), 8, 8))


def test_linear_on_a_sequence_applies_to_the_last_axis():
    # was E402 "Linear on a rank-3 input has no integer lowering"; LINEAR now reads (N, ..., K)
    model = prepared(TokenLinear(), "rule fc { output = a }")
    graph = export(model, X[:1])
    from qdsl.graph import execute

    linear = next(op for op in graph.ops if op.type is OpType.LINEAR)
    assert graph.tensor(linear.outputs[0]).shape == (-1, 8, 4)
    with torch.no_grad():
        fq = model(X).numpy()
    assert (execute(graph, X.numpy()).outputs[0] == fq).all()

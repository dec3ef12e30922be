"""MUL of two activations (squeeze-excitation's ``scale * x``) end to end with the bundled
specs unedited: apply -> a training forward/backward -> calibrate -> freeze -> export; the
C++ runtime equals the reference executor bit for bit on every path, and the graph agrees
with the fake-quant model (>= 99.5% of codes within 1 LSB; exact for power-of-two scales).
The operands' quantizers are implied by the mul ("implied by mul in 'se'"); the forms
``a * b``, ``torch.mul``, ``Tensor.mul`` and ``*=`` lower alike; a constant factor is refused
clearly, and shape arithmetic (``x.size(1) * x.size(2)``) stays shape arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import qdsl
import qdsl.runtime as rt
from qdsl.export.values import ExportError
from qdsl.graph import execute
from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, OutputStage, Rescale, Tensor
from qdsl.graph.ops.mul import broadcast_shape
from qdsl.patch.handle import proxy_key
from qdsl.patch.implied import implied_outputs
from qdsl.patch.trace import trace_model
from qdsl.spec.model import Role


class SqueezeExcitation(nn.Module):
    """torchvision's block: avgpool -> conv1x1 -> ReLU -> conv1x1 -> Hardsigmoid -> ``scale * x``."""

    def __init__(self, c: int, squeeze: int, activation=nn.ReLU, scale_activation=nn.Hardsigmoid):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, c, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

    def forward(self, x):
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


def _cba(cin, cout, k, stride=1, groups=1, act=nn.Hardswish):
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, *([act(inplace=True)] if act is not None else []))


class InvertedResidual(nn.Module):
    """MobileNetV3 / EfficientNet MBConv: expand, depthwise, SE, project, residual add."""

    def __init__(self, cin, hidden, cout, stride, act, se_act, se_gate):
        super().__init__()
        self.block = nn.Sequential(
            _cba(cin, hidden, 1, act=act),
            _cba(hidden, hidden, 3, stride, groups=hidden, act=act),
            SqueezeExcitation(hidden, max(2, hidden // 4), se_act, se_gate),
            _cba(hidden, cout, 1, act=None),
        )
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


class TinyNet(nn.Module):
    """A MobileNetV3-like (Hardswish, ReLU/Hardsigmoid SE) or EfficientNet-like (SiLU,
    SiLU/Sigmoid SE) stack of SE blocks."""

    def __init__(self, kind: str):
        super().__init__()
        act, se_act, gate = (nn.Hardswish, nn.ReLU, nn.Hardsigmoid) if kind == "mnv3" else (nn.SiLU, nn.SiLU, nn.Sigmoid)
        self.features = nn.Sequential(
            _cba(3, 8, 3, 2, act=act),
            # the residual add and the expand conv both read the stem's activation (a table's result)
            InvertedResidual(8, 16, 8, 1, act, se_act, gate),
            InvertedResidual(8, 16, 12, 2, act, se_act, gate),
            InvertedResidual(12, 24, 12, 1, act, se_act, gate),
            _cba(12, 32, 1, act=act),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(32, 24), act(inplace=True), nn.Dropout(0.2), nn.Linear(24, 10))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class SENet(nn.Module):
    """conv -> BN -> Hardswish -> SE -> conv: the SE block between two layers."""

    def __init__(self):
        super().__init__()
        self.conv = _cba(3, 8, 3)
        self.se = SqueezeExcitation(8, 4)
        self.proj = nn.Conv2d(8, 6, 1)

    def forward(self, x):
        return self.proj(self.se(self.conv(x)))


MODELS = {"se": (SENet, "proj", (3, 10, 10)), "mnv3": (lambda: TinyNet("mnv3"), "classifier.3", (3, 32, 32)),
          "effnet": (lambda: TinyNet("effnet"), "classifier.3", (3, 32, 32))}


def _pipeline(name: str, spec: str):
    factory, last, chw = MODELS[name]
    torch.manual_seed(0)
    model = factory().train()
    handle = qdsl.apply(model, f"specs/{spec}.qspec")
    x = torch.randn(2, *chw)
    model(x).square().mean().backward()  # in-place activations after quantized outputs train
    assert all(p.grad is not None for n, p in model.named_parameters() if "fc" in n)
    model.eval()
    calib = torch.randn(16, *chw)
    qdsl.calibrate(model, [calib[:8], calib[8:]])
    qdsl.freeze(model)
    graph = qdsl.export(model, x)
    return model, handle, graph, last, chw


def _codes_at_input(model, handle, graph, layer: str, xt: torch.Tensor):
    """(fake-quant codes, graph codes) of ``layer``'s input quantizer."""
    q = handle.container.quantizers[proxy_key(layer, Role.INPUT)]
    seen = []
    hook = model.get_submodule(layer).register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        fq = model(xt)
    hook.remove()
    want = q.int_repr(seen[0]).numpy().astype(np.int64)
    op = next(op for op in graph.ops if op.name == layer and op.type in (OpType.LINEAR, OpType.CONV2D))
    got = execute(graph, xt.numpy(), keep_values=True).values[op.inputs[0]].astype(np.int64)
    return want, got.reshape(want.shape), fq


@pytest.mark.parametrize("spec", ["int8-default", "pot-asic"])
@pytest.mark.parametrize("name", list(MODELS))
def test_se_models_export_and_agree(name, spec):
    model, handle, graph, last, chw = _pipeline(name, spec)
    muls = [op for op in graph.ops if op.type is OpType.MUL]
    assert len(muls) == (1 if name == "se" else 3)
    xt = torch.randn(8, *chw)
    ref = execute(graph, xt.numpy()).outputs[0]
    if rt.available():
        from qdsl.runtime import kernels as K

        cg = rt.CompiledGraph(graph)
        for path in K.paths()["cpu"]:
            np.testing.assert_array_equal(cg.run(xt.numpy(), path=path), ref, err_msg=f"path {path}")
    want, got, fq = _codes_at_input(model, handle, graph, last, xt)
    diff = np.abs(got - want)
    print(f"{name} {spec}: {np.mean(diff > 0):.4%} codes differ, max {diff.max()} LSB")
    if spec.startswith("pot"):
        assert diff.max() == 0
        np.testing.assert_array_equal(ref, fq.numpy())
    else:
        assert (diff <= 1).mean() >= 0.995, f"{(diff <= 1).mean():.4f} within 1 LSB, max {diff.max()}"


def test_mul_output_codes_equal_the_fake_quant_codes():
    # the codes MUL writes are the next quantizer's codes of the fake-quant product
    model, handle, graph, _, chw = _pipeline("se", "int8-default")
    want, got, _ = _codes_at_input(model, handle, graph, "proj", torch.randn(16, *chw))
    diff = np.abs(got - want)
    assert (diff <= 1).all() and (diff == 0).mean() >= 0.995, f"{(diff == 0).mean():.4f} exact"


def test_operands_get_quantizers_implied_by_mul():
    model = SENet()
    plan = qdsl.resolve(model, "specs/int8-default.qspec")
    implied = implied_outputs(model, trace_model(model), plan)
    # the gate (a table's result) and the block input (a table's result, which the SE's
    # average pool reads first and names) are both quantized
    assert implied["se.scale_activation"] == "implied by mul in 'se'"
    assert implied["conv"] == "implied by average pool in 'se.avgpool'"
    # a product of two layers' accumulators: MUL reads codes, so both get one
    forms = _Forms("operator")
    implied = implied_outputs(forms, trace_model(forms), qdsl.resolve(forms, "specs/int8-default.qspec"))
    assert implied == {"a": "implied by mul in '<model>'", "b": "implied by mul in '<model>'"}


def test_explain_shows_implied_by_mul(capsys):
    from qdsl.cli.main import main

    rc = main(["explain", "specs/int8-default.qspec", "--model", "tests/export/test_mul.py:SENet",
               "--layer", "se.scale_activation"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "se.scale_activation  output  kind" in out and "implied by mul in 'se'" in out


class _Forms(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.a = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.out = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        if self.form == "operator":
            y = a * b
        elif self.form == "torch.mul":
            y = torch.mul(a, b)
        elif self.form == "method":
            y = a.mul(b)
        else:
            a *= b
            y = a
        return self.out(y)


@pytest.mark.parametrize("form", ["operator", "torch.mul", "method", "imul"])
def test_every_form_of_mul_lowers(form):
    torch.manual_seed(0)
    model = _Forms(form).eval()
    qdsl.apply(model, "specs/int8-default.qspec")
    x = torch.randn(4, 3, 6, 6)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    graph = qdsl.export(model, x)
    assert [op.type for op in graph.ops].count(OpType.MUL) == 1
    want, got, _ = _codes_at_input(model, qdsl.patch.get_handle(model), graph, "out", torch.randn(8, 3, 6, 6))
    assert (np.abs(got - want) <= 1).mean() >= 0.995


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
        self.fc = nn.Linear(4 * 4 * 4, 2)

    def forward(self, x):
        y = self.conv(x) * 0.5
        return self.fc(y.view(y.size(0), y.size(1) * y.size(2) * y.size(3)))


def test_a_constant_factor_is_refused_and_shape_arithmetic_is_not_a_product():
    torch.manual_seed(0)
    model = _Scaled().eval()
    qdsl.apply(model, "specs/int8-default.qspec")
    x = torch.randn(4, 3, 6, 6)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    # the refusal is the constant factor's, not the size product's that follows it
    with pytest.raises(ExportError, match="a product of an activation and a constant has no integer lowering"):
        qdsl.export(model, x)


class _SizeProduct(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 4 * 4, 2)

    def forward(self, x):
        y = self.conv(x)
        return self.fc(y.view(y.size(0), y.size(1) * y.size(2) * y.size(3)))


def test_shape_arithmetic_exports():
    # operator.mul on sizes had no lowering before MUL (E402 'the function mul ... has no integer lowering')
    torch.manual_seed(0)
    model = _SizeProduct().eval()
    qdsl.apply(model, "specs/int8-default.qspec")
    x = torch.randn(4, 3, 6, 6)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    graph = qdsl.export(model, x)
    assert OpType.MUL not in [op.type for op in graph.ops]
    assert execute(graph, x.numpy()).outputs[0].shape == (4, 2)


@pytest.mark.parametrize("spec", ["int8-default", "pot-asic"])
def test_mul_exports_to_onnx_as_qdq_mul(spec):
    # an SE block with ReLU gates (the lookup-table activations have no ONNX form in qdsl)
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from qdsl.export.onnx import export_onnx

    torch.manual_seed(0)
    model = nn.Sequential(_cba(3, 8, 3, act=nn.ReLU), SqueezeExcitation(8, 4, nn.ReLU, nn.ReLU), nn.Conv2d(8, 6, 1))
    qdsl.apply(model, f"specs/{spec}.qspec")
    calib = torch.randn(16, 3, 10, 10)
    model.eval()
    qdsl.calibrate(model, [calib])
    qdsl.freeze(model)
    proto = export_onnx(model, calib[:2])
    assert "Mul" in {n.op_type for n in proto.graph.node}
    basic = ort.SessionOptions()
    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    x = torch.randn(8, 3, 10, 10)
    y = ort.InferenceSession(proto.SerializeToString(), basic).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        fq = model(x).numpy()
    err = float(np.abs(y - fq).max())
    # test_onnx.py's stated tolerance: exact for power-of-two scales, else 1 % of max |y|
    assert err == 0.0 if spec == "pot-asic" else err <= 0.01 * np.abs(fq).max(), err


def test_lint_checks_the_product_against_the_profile(capsys):
    # lint and export read one construct table: the SE's product is the profile op 'mul'
    from qdsl.cli.main import main

    args = ["lint", "specs/int8-default.qspec", "--model", "tests/export/test_mul.py:SENet", "--hw"]
    assert main(args + ["specs/hw/int-only-photonic.toml"]) == 1
    assert "mul in se: error[E310]: op 'mul' is not supported by int-only-photonic" in capsys.readouterr().out
    main(args + ["specs/hw/tflite-int8.toml"])  # TFLite has MUL
    assert "'mul'" not in capsys.readouterr().out


def _mul_graph(s0, s1, d0, d1, out, attrs, validate=True) -> IntegerGraph:
    shape = broadcast_shape(s0, s1) or s0
    g = IntegerGraph([Tensor("x0", d0, s0), Tensor("x1", d1, s1), Tensor("y", out, shape)], ["x0", "x1"], ["y"],
                     [Op(OpType.MUL, "se", ["x0", "x1"], ["y"], attrs)])
    return g.validate() if validate else g


def test_se_gate_broadcasts_per_channel():
    # y[n, c, h, w] = x[n, c, h, w] * gate[n, c]: the reference is numpy broadcasting
    rng = np.random.default_rng(0)
    g = _mul_graph((-1, 3, 4, 5), (-1, 3, 1, 1), DType.U8, DType.U8, DType.U8,
                   {"in_zp": [0, 0], **OutputStage(Rescale(1, (1,), (8,), 1), 0, 0, 255).attrs()})
    x = rng.integers(0, 256, (2, 3, 4, 5)).astype(np.uint8)
    gate = rng.integers(0, 256, (2, 3, 1, 1)).astype(np.uint8)
    want = np.clip(np.rint(x.astype(np.float64) * gate / 256), 0, 255)
    np.testing.assert_array_equal(execute(g, [x, gate]).outputs[0], want)


@pytest.mark.parametrize("s0,s1,msg", [
    ((-1, 3, 4), (-1, 2, 4), "do not broadcast"),
    ((-1, 3, 4), (-1, 3), "do not broadcast"),
])
def test_mul_operands_that_do_not_broadcast_are_rejected(s0, s1, msg):
    attrs = {"in_zp": [0, 0], **OutputStage(Rescale.identity(), 0, -128, 127).attrs()}
    with pytest.raises(GraphFormatError, match=msg):
        _mul_graph(s0, s1, DType.I8, DType.I8, DType.I8, attrs)




def test_product_with_a_functional_table_result_names_the_fix():
    # torch.sigmoid at the top level has no module to carry the implied quantizer: export
    # refuses with a hint to use the module form (was "for ''" with no place)
    class Swish(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            y = self.fc1(x)
            return self.fc2(y * torch.sigmoid(y))

    torch.manual_seed(0)
    model = Swish().eval()
    qdsl.apply(model, "specs/int8-default.qspec")
    x = torch.randn(8, 16)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    with pytest.raises(ExportError) as e:
        qdsl.export(model, x[:1])
    assert "at the model's top level" in str(e.value) and "nn.Sigmoid()" in str(e.value)

"""torchvision-shaped CNNs (qdsl.zoo: ResNet-18/50, MobileNetV2, small widths, 32×32 inputs)
with the bundled specs unedited: apply -> a training forward/backward -> calibrate ->
freeze -> export; the C++ runtime equals the reference executor bit for bit and the graph
agrees with the fake-quant model (issue 17).  Integer adds read values the specs do not
quantize: the plan's implied quantizers (qdsl.patch.implied) cover them."""

import glob
import os

import numpy as np
import pytest
import torch

import qdsl
from qdsl.graph import execute
from qdsl.graph.ir import OpType
from qdsl.parse import parse_text
from qdsl.patch.handle import proxy_key
from qdsl.patch.implied import implied_outputs
from qdsl.patch.trace import trace_model
from qdsl.spec.model import Role

from .tv_models import FACTORIES

SPECS = sorted(os.path.basename(p)[: -len(".qspec")] for p in glob.glob("specs/*.qspec"))
CNN_SPECS = [s for s in SPECS if not s.startswith("transformer")]
FAST = {("resnet18", "int8-default"), ("mobilenet_v2", "int8-default"), ("resnet18", "pot-asic"),
        ("resnet50", "int8-default"), ("mobilenet_v2", "w4a8-per-channel")}



def _cases():
    for model in FACTORIES:
        for spec in CNN_SPECS:
            marks = () if (model, spec) in FAST else (pytest.mark.slow,)
            yield pytest.param(model, spec, marks=marks, id=f"{model}-{spec}")


LAST = {"resnet18": "fc", "resnet50": "fc", "mobilenet_v2": "classifier.1"}


@pytest.mark.parametrize("name,spec", list(_cases()))
def test_bundled_spec_trains_and_exports(name, spec):
    torch.manual_seed(0)
    model = FACTORIES[name]().train()
    handle = qdsl.apply(model, f"specs/{spec}.qspec")
    x = torch.randn(2, 3, 32, 32)
    loss = model(x).square().mean()
    loss.backward()  # ReLU(inplace=True) after quantized outputs trains
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.eval()
    calib = torch.randn(8, 3, 32, 32)
    qdsl.calibrate(model, [calib[:4], calib[4:]])
    qdsl.freeze(model)
    graph = qdsl.export(model, x)
    xt = torch.randn(4, 3, 32, 32)
    ref = qdsl.run_graph(graph, xt, backend="reference")
    np.testing.assert_array_equal(qdsl.run_graph(graph, xt, backend="cpp"), ref)
    # The specs leave the classifier's output an int32 accumulator, whose LSB is far finer
    # than any int8 step, so the codes compared are the classifier's int8 input codes
    # (the network's last quantized tensor): fake-quant codes vs the graph's (xnor-binary on
    # MobileNetV2: the binary classifier's sign codes).
    last = LAST[name]
    q = handle.container.quantizers[proxy_key(last, Role.INPUT)]
    seen = []
    hook = model.get_submodule(last).register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        fq = model(xt)
    hook.remove()
    fq_codes = q.int_repr(seen[0]).numpy().astype(np.int64)
    op = next(op for op in graph.ops if op.name == last and op.type in (OpType.LINEAR, OpType.CONV2D, OpType.BLINEAR))
    got = execute(graph, xt.numpy(), keep_values=True).values[op.inputs[0]].astype(np.int64)
    diff = np.abs(got.reshape(fq_codes.shape) - fq_codes)
    if spec.startswith("pot"):
        assert diff.max() == 0
        np.testing.assert_array_equal(ref, fq.numpy())
    elif op.type is OpType.BLINEAR:  # sign codes
        assert diff.max() == 0
    else:
        assert (diff <= 1).mean() >= 0.995, f"{(diff <= 1).mean():.4f} within 1 LSB, max {diff.max()}"


@pytest.mark.parametrize("name", list(FACTORIES))
def test_implied_quantizers_name_their_op(name):
    model = FACTORIES[name]()
    plan = qdsl.resolve(model, "specs/int8-default.qspec")
    implied = implied_outputs(model, trace_model(model), plan)
    assert implied and all(why.startswith(("implied by add in ", "implied by average pool in "))
                           for why in implied.values())
    handle = qdsl.apply(model, "specs/int8-default.qspec")
    for fqn, why in implied.items():
        lp = handle.plan.layer(fqn)
        assert lp.roles[Role.OUTPUT] is not None
        assert lp.provenance[(Role.OUTPUT, "kind")].set_by.label == why


def test_resnet_stem_pool_gets_the_implied_quantizer():
    # the first residual add reads the stem's max pool, which no bundled spec quantizes
    # (was E402 "neither quantized nor a layer's accumulator" at 'layer1.0')
    model = FACTORIES["resnet18"]()
    plan = qdsl.resolve(model, "specs/int8-default.qspec")
    assert implied_outputs(model, trace_model(model), plan) == {"maxpool": "implied by add in 'layer1.0'"}


def test_spec_quantized_values_imply_nothing():
    model = FACTORIES["resnet18"]()
    spec = open("specs/int8-default.qspec").read() + "\nrule maxpool {\n  output = a8\n}\n"
    plan = qdsl.resolve(model, parse_text(spec, "x.qspec"))
    assert implied_outputs(model, trace_model(model), plan) == {}


@pytest.mark.parametrize("stage", ["calibrated", "frozen"])
def test_inplace_relu_after_a_quantized_output_trains(stage):
    # "Output 0 of _StraightThrough is a view and is being modified inplace" before the fix
    model = FACTORIES["resnet18"]()
    spec = open("specs/int8-default.qspec").read() + "\nrule conv1 {\n  output = a8\n}\n"
    qdsl.apply(model, parse_text(spec, "x.qspec"))
    x = torch.randn(2, 3, 32, 32)
    qdsl.calibrate(model, [x])
    if stage == "frozen":
        qdsl.freeze(model)
    model.train()
    model(x).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("name", list(FACTORIES))
def test_lint_model_runs(name, capsys):
    from qdsl.cli.main import main

    rc = main(["lint", "specs/int8-default.qspec", "--hw", "specs/hw/tflite-int8.toml",
               "--model", f"tests/export/tv_models.py:small_{name}"])
    out = capsys.readouterr()
    assert rc in (0, 1), out.err
    assert "Traceback" not in out.err


def test_explain_reports_implied_quantizers(capsys):
    from qdsl.cli.main import main

    rc = main(["explain", "specs/int8-default.qspec", "--model", "tests/export/tv_models.py:small_resnet18",
               "--layer", "maxpool"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "maxpool  output  kind" in out and "implied by add in 'layer1.0'" in out


@pytest.mark.parametrize("name", [n if n == "resnet18" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in FACTORIES])
def test_sweep_runs(name, capsys):
    from qdsl.cli.main import main

    rc = main(["sweep", "specs/int8-default.qspec", "--model", f"tests/export/tv_models.py:small_{name}",
               "--data", "tests/export/tv_models.py:random_images", "--set", "weight.bits=8,4", "--calib", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "weight.bits=8" in out and "weight.bits=4" in out

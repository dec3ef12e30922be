"""torchvision-shaped CNNs (qdsl.zoo: ResNet-18/50, MobileNetV2, MobileNetV3-small,
EfficientNet-B0, small widths, 32×32 inputs) with the bundled specs unedited: apply -> a
training forward/backward -> calibrate -> freeze -> export; the C++ runtime equals the
reference executor bit for bit and the graph agrees with the fake-quant model (issue 17).
Integer adds and lookup tables read values the specs do not quantize: the plan's implied
quantizers (qdsl.patch.implied) cover them.  MobileNetV3 and EfficientNet multiply two
activations (squeeze-excitation: MUL).  Known misses of the graph-vs-fake-quant comparison are
xfails that say why (FLOAT_TIE).  Every case is also compared layer by layer
(test_graph_agrees_layer_by_layer, tests/export/layer_agreement.py): each quantized layer's graph
output vs the fake-quant layer fed the graph's own input, where one near-tie cannot spread.  Under
xnor-binary the sign codes agree exactly: a frozen binary layer sums exactly (binary64), so its
ties at 0 are the graph's (test_binary_ties).  The small U-Net (16×16 inputs) upsamples with
ConvTranspose2d (xnor-binary: on its BIN input, ±1 weights as I8; the binary conv after each skip
cat reads the parts' signs, concatenated)."""

import functools
import glob
import os

import numpy as np
import pytest
import torch

import qdsl
from qdsl.export.lower import export as export_graph
from qdsl.graph import execute
from qdsl.graph.ir import OpType
from qdsl.parse import parse_text
from qdsl.patch.handle import proxy_key
from qdsl.patch.implied import implied_outputs
from qdsl.patch.trace import trace_model
from qdsl.spec.model import Role

from .layer_agreement import WEIGHTED, layer_agreement
from .tv_models import FACTORIES, MUL_FACTORIES

SPECS = sorted(os.path.basename(p)[: -len(".qspec")] for p in glob.glob("specs/*.qspec"))
# int8-dynamic: dynamic inputs lower for Linears only (a conv with one is W321 / E402, test_lint_agrees)
# mxfp4: its fp8_e4m3 activations have no integer-graph type (E402, lint W321: test_lint_agrees)
CNN_SPECS = [s for s in SPECS if not s.startswith(("transformer", "int8-dynamic", "mxfp"))]
FAST = {("resnet18", "int8-default"), ("unet", "int8-default"), ("mobilenet_v2", "int8-default"), ("resnet18", "pot-asic"),
        ("resnet50", "int8-default"), ("mobilenet_v2", "w4a8-per-channel")}


# one float32 near-tie, amplified by the random-init network (see test_mobilenet_v3_w4a8_differs_by_one_tie);
# layer by layer the graph agrees (test_graph_agrees_layer_by_layer[mobilenet_v3_small-w4a8-per-channel] passes)
FLOAT_TIE = pytest.mark.xfail(strict=False, raises=AssertionError,
                              reason="a float32 near-tie in fake-quant flips one code; the network amplifies it "
                                     "(per layer it agrees: test_graph_agrees_layer_by_layer)")
FLOAT_TIES = {("mobilenet_v3_small", "w4a8-per-channel"), ("resnet50", "int8-default")}
WAITING = MUL_FACTORIES  # models whose export waits for an op
ALL = {**FACTORIES, **WAITING}
SIZE = {"unet": 16}  # input side (32 for the rest)


def _cases(models, fast=FAST, marks=(), export=False):
    for model in models:
        for spec in CNN_SPECS:
            slow = () if (model, spec) in fast else (pytest.mark.slow,)
            more = ()
            if export:  # the graph-vs-fake-quant comparison's known misses
                # resnet50-int8-default: layer3.1's ADD, 3 grid steps (2.9e-6 output steps) below a
                # tie; the graph rounds the exact sum, fake-quant's float32 not (test_add_grid.py)
                more += (FLOAT_TIE,) if (model, spec) in FLOAT_TIES else ()
            yield pytest.param(model, spec, marks=(*marks, *more, *slow), id=f"{model}-{spec}")


_WAITING_FAST = {(m, "int8-default") for m in WAITING}
LAST = {"resnet18": "fc", "resnet50": "fc", "mobilenet_v2": "classifier.1", "mobilenet_v3_small": "classifier.3",
        "efficientnet_b0": "classifier.1", "unet": "outc"}


@functools.lru_cache(maxsize=None)
def _exported(name: str, spec: str):
    """``(model, handle, graph, info, xt)``: apply -> a training forward/backward -> calibrate ->
    freeze -> export (``info``: each graph tensor's grid) of one case, and a test batch ``xt``;
    cached, so the end-to-end and the per-layer tests of a case share one flow."""
    torch.manual_seed(0)
    model = ALL[name]().train()
    n = SIZE.get(name, 32)
    handle = qdsl.apply(model, f"specs/{spec}.qspec")
    x = torch.randn(2, 3, n, n)
    loss = model(x).square().mean()
    loss.backward()  # ReLU(inplace=True) after quantized outputs trains
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.eval()
    calib = torch.randn(8, 3, n, n)
    qdsl.calibrate(model, [calib[:4], calib[4:]])
    qdsl.freeze(model)
    graph, info = export_graph(model, x, with_info=True)
    xt = torch.randn(4, 3, n, n)
    return model, handle, graph, info, xt


@pytest.mark.parametrize("name,spec", [*_cases(FACTORIES, export=True), *_cases(MUL_FACTORIES, _WAITING_FAST, export=True)])
def test_bundled_spec_trains_and_exports(name, spec):
    model, handle, graph, _, xt = _exported(name, spec)
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
    layer_ops = (OpType.LINEAR, OpType.CONV2D, OpType.BLINEAR, OpType.BCONV2D)
    op = next(op for op in graph.ops if op.name == last and op.type in layer_ops)
    got = execute(graph, xt.numpy(), keep_values=True).values[op.inputs[0]].astype(np.int64)
    diff = np.abs(got.reshape(fq_codes.shape) - fq_codes)
    if spec.startswith("pot"):
        assert diff.max() == 0
        np.testing.assert_array_equal(ref, fq.numpy())
    elif op.type in (OpType.BLINEAR, OpType.BCONV2D):  # sign codes
        assert diff.max() == 0
    else:
        assert (diff <= 1).mean() >= 0.995, f"{(diff <= 1).mean():.4f} within 1 LSB, max {diff.max()}"


@pytest.mark.parametrize("name,spec", [*_cases(FACTORIES), *_cases(MUL_FACTORIES, _WAITING_FAST)])
def test_graph_agrees_layer_by_layer(name, spec):
    # Each quantized layer on its own (tests/export/layer_agreement.py): its graph output vs the
    # fake-quant layer fed the graph's own dequantized input, within 1 LSB on >= 99.5% of the
    # codes (equal signs for binary outputs), exact for power-of-two scales.  Unlike the end-to-end
    # comparison, one float32 near-tie cannot spread here: MobileNetV3-small w4a8 passes (one code
    # of features.2.block.1.0, by one), though its end-to-end comparison misses (FLOAT_TIE).
    model, _, graph, info, xt = _exported(name, spec)
    rows = layer_agreement(model, graph, info, xt.numpy())
    assert {n for r in rows for n in r.layers} == {op.name for op in graph.ops if op.type in WEIGHTED}
    if spec.startswith("pot"):
        bad = [r for r in rows if r.exact < 1.0]
    else:
        bad = [r for r in rows if r.within < 0.995]
    assert not bad, "\n".join(map(str, bad))


@pytest.mark.slow
def test_mobilenet_v3_w4a8_differs_by_one_tie():
    # Why mobilenet_v3_small-w4a8-per-channel misses the 99.5% bar (35% of image 0's classifier
    # input codes more than 1 LSB off, max 4): fake-quant computes the depthwise conv
    # features.2.block.1.0 in float32 from float32 weights code·s_w, the graph exactly in
    # integers; at one output the exact value is 49.4999998 LSB (rounds to 49), fake-quant's
    # 49.500002 (rounds to 50).  The graph is right; that one code then spreads through
    # 1×1 convs, Hardswish tables and residual adds of a random-init network (gains > 1;
    # estimating BatchNorm statistics on data does not stop it: MobileNetV2 then drifts
    # the same way from a near-tie at features.1's add).  A lowering error (scale, bias, zero
    # point, per-channel w4) would show in every image: the other three are bit-exact at the
    # input of every layer, and the first difference is that one code, by one.
    torch.manual_seed(0)
    model = ALL["mobilenet_v3_small"]().train()
    # nearest-rounded weights, as when this tie was found (auto's GPTQ at 4 bits moves them)
    handle = qdsl.apply(model, "specs/w4a8-per-channel.qspec",
                        overrides=["learned_rounding=none", "bias_correction=false"])
    x = torch.randn(2, 3, 32, 32)  # the draws of test_bundled_spec_trains_and_exports
    model(x).square().mean().backward()
    model.eval()
    calib = torch.randn(8, 3, 32, 32)
    qdsl.calibrate(model, [calib[:4], calib[4:]])
    qdsl.freeze(model)
    graph = qdsl.export(model, x)
    xt = torch.randn(4, 3, 32, 32)
    values = execute(graph, xt.numpy(), keep_values=True).values
    layers = []
    for op in graph.ops:
        if op.type in (OpType.CONV2D, OpType.LINEAR) and op.name not in dict(layers):
            layers.append((op.name, op.inputs[0]))
    seen = {}
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda m, a, name=name: seen.setdefault(name, a[0].detach().clone())) for name, _ in layers]
    with torch.no_grad():
        model(xt)
    for h in hooks:
        h.remove()
    first = None
    for name, src in layers:
        q = handle.container.quantizers[proxy_key(name, Role.INPUT)]
        fq = q.int_repr(seen[name]).numpy().astype(np.int64)
        diff = np.abs(values[src].astype(np.int64).reshape(fq.shape) - fq)
        assert diff[1:].max() == 0, name
        if first is None and diff.max() > 0:
            first = (src, np.count_nonzero(diff), int(diff.max()))
    assert first == ("features.2.block.1.0", 1, 1)


@pytest.mark.parametrize("name,spec", list(_cases(WAITING, _WAITING_FAST)))
def test_models_waiting_for_an_op_train_calibrate_and_freeze(name, spec):
    # the stages before export (which waits for MUL): gradients reach every weight through
    # the implied quantizers, calibration gives each a real scale, freeze fixes it
    torch.manual_seed(0)
    model = WAITING[name]().train()
    n = SIZE.get(name, 32)
    handle = qdsl.apply(model, f"specs/{spec}.qspec")
    x = torch.randn(2, 3, n, n)
    model(x).square().mean().backward()
    kernels = [p for p in model.parameters() if p.dim() > 1]
    assert kernels and all(p.grad is not None and p.grad.abs().sum() > 0 for p in kernels)
    model.eval()
    qdsl.calibrate(model, [torch.randn(4, 3, n, n), torch.randn(4, 3, n, n)])
    qdsl.freeze(model)
    implied = [lp.fqn for lp in handle.plan.layers
               if (p := lp.provenance.get((Role.OUTPUT, "kind"))) is not None and p.set_by.label.startswith("implied")]
    assert implied
    scales = torch.tensor([float(handle.quantizer(f, "output").scale.flatten()[0]) for f in implied])
    assert torch.isfinite(scales).all() and (scales > 0).all()
    with torch.no_grad():
        y = model(x)
        assert torch.isfinite(y).all() and torch.equal(model(x), y)  # frozen: nothing moves


def test_tables_read_implied_quantizers():
    # a lookup table indexes 8-bit codes: the BN before MobileNetV3's Hardswish, the fc2 before
    # its Hardsigmoid gate, and an EfficientNet SE pool's SiLU input get one (was E402 "Hardswish
    # reads an unquantized value from 'features.0.0'")
    v3, b0 = MUL_FACTORIES["mobilenet_v3_small"](), MUL_FACTORIES["efficientnet_b0"]()
    got = {}
    for model in (v3, b0):
        got[model] = implied_outputs(model, trace_model(model), qdsl.resolve(model, "specs/int8-default.qspec"))
    assert got[v3]["features.0.1"] == "implied by hardswish 'features.0.2'"
    assert got[v3]["features.1.block.1.fc2"] == "implied by hardsigmoid 'features.1.block.1.scale_activation'"
    assert got[b0]["features.1.0.block.0.1"] == "implied by silu 'features.1.0.block.0.2'"
    assert got[b0]["features.1.0.block.0"] == "implied by average pool in 'features.1.0.block.1.avgpool'"


class _NegativeSiLU(torch.nn.Module):
    """conv (all outputs negative) -> SiLU -> conv: an SE fc1 of a random-init EfficientNet-B0."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 4, 1)
        self.act = torch.nn.SiLU()
        self.c2 = torch.nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return self.c2(self.act(self.c1(x)))


def test_unsigned_quantizers_seeing_only_negatives_export():
    # low-bit's unsigned a4 on the SiLU's input (implied) and output sees only negatives: every
    # code is 0; the scales were the 1e-12 floor, so export failed (E402 "factor 2.4e9 out of
    # range" at EfficientNet-B0's features.2.1.block.2.fc1; here "bias does not fit int32")
    from .e2e import assert_close, flow

    torch.manual_seed(0)
    model = _NegativeSiLU()
    with torch.no_grad():
        model.c1.weight.mul_(0.1)
        model.c1.bias.fill_(-5.0)
    graph, diff = flow(model, "low-bit", (4, 3, 5, 5), "c2")
    assert_close(diff, exact=True)


def test_binary_inputs_read_int8_not_sums():
    # xnor-binary: the default input is binary, so the implied recipe is the integer one the
    # plan uses (first/last layer's a8); MobileNetV2's block sums a binary conv reads get it
    model = FACTORIES["mobilenet_v2"]()
    plan = qdsl.resolve(model, "specs/xnor-binary.qspec")
    implied = implied_outputs(model, trace_model(model), plan)
    assert implied["features.1"] == "implied by the binary input of 'features.2.conv.0.0'"
    handle = qdsl.apply(model, "specs/xnor-binary.qspec")
    assert handle.plan.layer("features.1").roles[Role.OUTPUT].bits == 8


@pytest.mark.parametrize("name", list(FACTORIES))
def test_implied_quantizers_name_their_op(name):
    model = FACTORIES[name]()
    plan = qdsl.resolve(model, "specs/int8-default.qspec")
    implied = implied_outputs(model, trace_model(model), plan)
    ops = ("add", "average pool", "torch.cat")  # the U-Net's cat reads a pool's and an up-conv's result
    assert implied and all(why.startswith(tuple(f"implied by {op} in " for op in ops)) for why in implied.values())
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


@pytest.mark.parametrize("name", list(ALL))
def test_lint_model_runs(name, capsys):
    from qdsl.cli.main import main

    rc = main(["lint", "specs/int8-default.qspec", "--hw", "specs/hw/tflite-int8.toml",
               "--model", f"tests/export/tv_models.py:small_{name}"])
    out = capsys.readouterr()
    assert rc in (0, 1), out.err
    text = out.out + out.err
    assert "Traceback" not in text
    assert "W340" not in text  # torch.fx traced it: functional adds, cats and products were checked
    assert "W321" not in text  # every op lowers, MUL (squeeze-excitation) included


def test_explain_reports_implied_quantizers(capsys):
    from qdsl.cli.main import main

    rc = main(["explain", "specs/int8-default.qspec", "--model", "tests/export/tv_models.py:small_resnet18",
               "--layer", "maxpool"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "maxpool  output  kind" in out and "implied by add in 'layer1.0'" in out


@pytest.mark.parametrize("name", [n if n in ("resnet18", "unet") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in ALL])
def test_sweep_runs(name, capsys):
    from qdsl.cli.main import main

    data = "random_masks" if name == "unet" else "random_images"
    rc = main(["sweep", "specs/int8-default.qspec", "--model", f"tests/export/tv_models.py:small_{name}",
               "--data", f"tests/export/tv_models.py:{data}", "--set", "weight.bits=8,4", "--calib", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "weight.bits=8" in out and "weight.bits=4" in out


def test_layer_by_layer_check_finds_a_wrong_layer():
    # the per-layer check is not vacuous: a bias off by a few int8 steps in one layer of an
    # exported ResNet-18 shows at that layer (and not at the ones before it)
    import attrs

    model, _, graph, info, xt = _exported("resnet18", "int8-default")
    layer = "layer1.0.conv1"
    op = next(op for op in graph.ops if op.name == layer and op.type is OpType.CONV2D)
    bias = graph.tensor(op.inputs[2])
    step = float(info[op.outputs[0]][0]) / np.asarray(info[bias.name][0], dtype=np.float64)  # one output LSB
    wrong = attrs.evolve(bias, data=(bias.data + np.rint(3 * step)).astype(bias.data.dtype))
    broken = attrs.evolve(graph, tensors=[wrong if t.name == bias.name else t for t in graph.tensors])
    rows = {r.layer: r for r in layer_agreement(model, broken, info, xt.numpy())}
    assert rows["conv1"].within == 1.0
    assert rows[layer].within < 0.995, rows[layer]


FIRST = {"resnet18": "conv1", "resnet50": "conv1", "mobilenet_v2": "features.0.0",
         "mobilenet_v3_small": "features.0.0", "efficientnet_b0": "features.0.0", "unet": "inc.0"}


@pytest.mark.parametrize("name", list(ALL))
def test_xnor_binary_keeps_first_and_last_layers_8bit(name):
    # @first / @last name the image conv and the classifier whatever the model calls them
    # (before they were rules naming the zoo's test nets: features.0 here is a container, so
    # the first conv binarised the image and the classifier stayed binary)
    plan = qdsl.resolve(ALL[name](), "specs/xnor-binary.qspec")
    for fqn in (FIRST[name], LAST[name]):
        lp = plan.layer(fqn)
        assert (lp.roles[Role.WEIGHT].kind.value, lp.roles[Role.WEIGHT].bits) == ("int", 8), fqn
        assert (lp.roles[Role.INPUT].kind.value, lp.roles[Role.INPUT].bits) == ("int", 8), fqn
    binary = [lp.fqn for lp in plan.layers if lp.roles.get(Role.WEIGHT) is not None
              and lp.roles[Role.WEIGHT].kind.value == "binary"]
    assert binary and FIRST[name] not in binary and LAST[name] not in binary

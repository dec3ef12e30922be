"""ConvTranspose1d/2d end to end (issue 17): a small U-Net (conv blocks, max-pool down,
ConvTranspose2d(k=2, s=2) up, torch.cat skips along channels, functional and in-place
ReLUs) and a Conv1d/ConvTranspose1d autoencoder, with ``specs/int8-default.qspec``
unedited: apply -> a training forward/backward -> calibrate -> freeze -> export; the C++
runtime equals the reference executor bit for bit, and the graph's codes agree with the
fake-quant model's within 1 LSB on >= 99.5 % of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdsl
import qdsl.runtime as rt
from qdsl.graph import execute
from qdsl.graph.ir import OpType
from qdsl.patch.handle import proxy_key
from qdsl.spec.model import Role

SPEC = "specs/int8-default.qspec"


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU(inplace=True))


class UNet(nn.Module):
    """Two levels down, two up; the decoder's first ReLU is functional."""

    def __init__(self, c: int = 8, classes: int = 3):
        super().__init__()
        self.enc1, self.enc2 = _block(3, c), _block(c, 2 * c)
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = _block(2 * c, 4 * c)
        self.up2 = nn.ConvTranspose2d(4 * c, 2 * c, kernel_size=2, stride=2)
        self.dec2 = _block(4 * c, 2 * c)
        self.up1 = nn.ConvTranspose2d(2 * c, c, kernel_size=2, stride=2)
        self.dec1_conv = nn.Conv2d(2 * c, c, 3, padding=1)
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        b = self.bottleneck(self.pool(e2))
        d2 = self.dec2(torch.cat([self.up2(b), e2], dim=1))
        d1 = F.relu(self.dec1_conv(torch.cat([self.up1(d2), e1], dim=1)))
        return self.head(d1)


class AutoEncoder1d(nn.Module):
    """Conv1d encoder (strided), ConvTranspose1d decoder (stride 2 with output_padding, and
    a grouped, dilated, padded one)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv1d(2, 8, 5, stride=2, padding=2), nn.ReLU(inplace=True),
                                 nn.Conv1d(8, 16, 3, stride=2, padding=1), nn.ReLU(inplace=True))
        self.dec = nn.Sequential(nn.ConvTranspose1d(16, 8, 3, stride=2, padding=1, output_padding=1),
                                 nn.ReLU(inplace=True),
                                 nn.ConvTranspose1d(8, 8, 3, stride=2, padding=2, output_padding=1, dilation=2,
                                                    groups=2),
                                 nn.ReLU(inplace=True),
                                 nn.Conv1d(8, 2, 1))

    def forward(self, x):
        return self.dec(self.enc(x))


CASES = {
    "unet": (UNet, (2, 3, 16, 16), "head"),
    "autoencoder1d": (AutoEncoder1d, (2, 2, 32), "dec.4"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_int8_default_trains_and_exports(name):
    make, shape, last = CASES[name]
    torch.manual_seed(0)
    model = make().train()
    handle = qdsl.apply(model, SPEC)
    x = torch.randn(*shape)
    model(x).square().mean().backward()
    for fqn, m in model.named_modules():
        if isinstance(m, (nn.ConvTranspose1d, nn.ConvTranspose2d)):
            assert handle.layers[fqn].wq.axis == 1  # per output channel
            assert handle.layers[fqn].master("weight").grad.abs().sum() > 0
    model.eval()
    calib = torch.randn(8, *shape[1:])
    qdsl.calibrate(model, [calib[:4], calib[4:]])
    qdsl.freeze(model)
    graph = qdsl.export(model, x)
    want_ops = {OpType.CONV_TRANSPOSE2D} if name == "unet" else {OpType.CONV_TRANSPOSE1D}
    assert want_ops <= {op.type for op in graph.ops}
    xt = torch.randn(4, *shape[1:])
    ref = qdsl.run_graph(graph, xt, backend="reference")
    if rt.available():
        np.testing.assert_array_equal(qdsl.run_graph(graph, xt, backend="cpp"), ref)
    # the last layer's output is an int32 accumulator (finer than any int8 step): compare
    # the codes of its int8 input, the network's last quantized tensor
    q = handle.container.quantizers[proxy_key(last, Role.INPUT)]
    seen = []
    hook = model.get_submodule(last).register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(xt)
    hook.remove()
    fq_codes = q.int_repr(seen[0]).numpy().astype(np.int64)
    op = next(op for op in graph.ops if op.name == last)
    got = execute(graph, xt.numpy(), keep_values=True).values[op.inputs[0]].astype(np.int64)
    diff = np.abs(got.reshape(fq_codes.shape) - fq_codes)
    assert (diff <= 1).mean() >= 0.995, f"{(diff <= 1).mean():.4f} within 1 LSB, max {diff.max()}"


def test_conv_transpose_output_codes_agree_with_fake_quant():
    # a ConvTranspose2d whose output is quantized: its graph op's codes against the fake quantizer's
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ConvTranspose2d(8, 6, 3, stride=2, padding=1,
                                                                              output_padding=1, groups=2))
    spec = open(SPEC).read() + "\nrule 1 {\n  output = a8\n}\n"
    handle = qdsl.apply(model, qdsl.parse.parse_text(spec, "x.qspec"))
    calib = torch.randn(8, 3, 9, 9)
    qdsl.calibrate(model, [calib])
    qdsl.freeze(model)
    x = torch.randn(4, 3, 9, 9)
    graph = qdsl.export(model, x)
    with torch.no_grad():
        fq = model(x)
    oq = handle.container.quantizers[proxy_key("1", Role.OUTPUT)]
    fq_codes = oq.int_repr(fq).numpy().astype(np.int64)
    op = next(op for op in graph.ops if op.type is OpType.CONV_TRANSPOSE2D)
    got = execute(graph, x.numpy(), keep_values=True).values[op.outputs[0]].astype(np.int64)
    diff = np.abs(got - fq_codes)
    assert (diff <= 1).mean() >= 0.995 and diff.max() <= 1, f"{(diff <= 1).mean():.4f}, max {diff.max()}"


def test_explicit_channel_axis_zero_on_a_transposed_weight_is_refused_at_export():
    # per-channel scales along the input channels (axis 0) cannot be an accumulator's
    model = nn.Sequential(nn.ConvTranspose2d(4, 6, 2, stride=2))
    spec = ("version 1\nquantizer w = int(bits=8, signed, narrow, symmetric, granularity=channel(0), observer=minmax)\n"
            "quantizer a = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)\n"
            "defaults {\n  weight = w\n  input = a\n}\n")
    qdsl.apply(model, qdsl.parse.parse_text(spec, "x.qspec"))
    qdsl.calibrate(model, [torch.randn(4, 4, 5, 5)])
    qdsl.freeze(model)
    with pytest.raises(qdsl.QdslError, match="one scale per output channel"):
        qdsl.export(model, torch.randn(1, 4, 5, 5))


@pytest.mark.parametrize("name", sorted(CASES))
def test_onnx_qdq_conv_transpose_agrees_with_fake_quant(name):
    # ConvTranspose in QDQ form (per-channel weights along axis 1), run by onnxruntime in
    # float at its basic level; the tolerance is tests/export/test_onnx.py's (1 % of max |y|)
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from qdsl.export.onnx import export_onnx

    make, shape, _ = CASES[name]
    torch.manual_seed(0)
    model = make().eval()
    qdsl.apply(model, SPEC)
    qdsl.calibrate(model, [torch.randn(8, *shape[1:])])
    qdsl.freeze(model)
    proto = export_onnx(model, torch.randn(*shape))
    assert "ConvTranspose" in {n.op_type for n in proto.graph.node}
    basic = ort.SessionOptions()
    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    x = torch.randn(4, *shape[1:])
    y = ort.InferenceSession(proto.SerializeToString(), basic).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        fq = model(x).numpy()
    assert np.abs(y - fq).max() <= 0.01 * np.abs(fq).max()


@pytest.mark.parametrize("name", sorted(CASES))
def test_lint_model_reads_transposed_channel_axis_as_output_channels(name, capsys):
    # a profile's channel axes put the output channels at 0; a transposed conv's weight has
    # them at axis 1, which lint reported as E305 ("allowed: channel axis 0") before
    from qdsl.cli.main import main

    factory = {"unet": "UNet", "autoencoder1d": "AutoEncoder1d"}[name]
    rc = main(["lint", SPEC, "--hw", "specs/hw/tflite-int8.toml",
               "--model", f"tests/export/test_conv_transpose_models.py:{factory}"])
    out = capsys.readouterr()
    assert rc in (0, 1) and "Traceback" not in out.err
    assert "E305" not in out.out + out.err
    assert "conv_transpose" in out.out + out.err  # the profile does not list the op: E310 names it


_XNOR = """version 1
quantizer wbin = binary(signed, per_channel, observer=mean_abs)
quantizer abin = binary(signed, per_tensor, observer=mean_abs)
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, signed, asymmetric, per_tensor, observer=minmax)
defaults {
  weight = wbin
  input = abin
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
rule 0 {
  weight = w8
  input = a8
}
rule 1 {
  output = a8
}
"""


@pytest.mark.parametrize("rank", [2, 1])
def test_binary_conv_transpose_exports_exactly(rank):
    # binary input and weights (xnor-binary's defaults): CONV_TRANSPOSE on the BIN input with
    # the ±1 weights as I8, scaled by α_x·α_w[c] (was E402 "binary transposed convolutions
    # have no integer lowering"); grouped, strided, padded, with output padding
    conv, convt = (nn.Conv2d, nn.ConvTranspose2d) if rank == 2 else (nn.Conv1d, nn.ConvTranspose1d)
    torch.manual_seed(0)
    model = nn.Sequential(conv(3, 8, 3, padding=1), convt(8, 6, 3, stride=2, padding=1, output_padding=1, groups=2))
    handle = qdsl.apply(model, qdsl.parse.parse_text(_XNOR, "x.qspec"))
    shape = (4, 3) + (9,) * rank
    model.train()
    model(torch.randn(*shape)).square().mean().backward()
    assert handle.layers["1"].master("weight").grad.abs().sum() > 0
    model.eval()
    qdsl.calibrate(model, [torch.randn(*shape) for _ in range(2)])
    qdsl.freeze(model)
    x = torch.randn(*shape)
    graph = qdsl.export(model, x)
    op = next(op for op in graph.ops if op.type in (OpType.CONV_TRANSPOSE1D, OpType.CONV_TRANSPOSE2D))
    assert graph.tensor(op.inputs[0]).dtype.name == "BIN" and graph.tensor(op.inputs[1]).dtype.name == "I8"
    ref = qdsl.run_graph(graph, x, backend="reference")
    if rt.available():
        np.testing.assert_array_equal(qdsl.run_graph(graph, x, backend="cpp"), ref)
    with torch.no_grad():
        fq = model(x)
    oq = handle.container.quantizers[proxy_key("1", Role.OUTPUT)]
    fq_codes = oq.int_repr(fq).numpy().astype(np.int64)
    got = execute(graph, x.numpy(), keep_values=True).values[op.outputs[0]].astype(np.int64)
    diff = np.abs(got - fq_codes)
    assert (diff <= 1).mean() >= 0.995 and diff.max() <= 1, f"{(diff <= 1).mean():.4f}, max {diff.max()}"


class _CatToBinary(nn.Module):
    """A binary conv reading torch.cat of two binary layer results nothing quantizes to int8
    (a transposed conv's, and a ReLU'd conv's): the xnor-binary U-Net's decoder step."""

    def __init__(self):
        super().__init__()
        self.c0 = nn.Conv2d(3, 8, 3, padding=1)
        self.down = nn.Conv2d(8, 8, 2, stride=2)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.skip = nn.Conv2d(8, 4, 1)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.c0(x)
        return self.head(torch.cat([F.relu(self.skip(y)), self.up(self.down(y))], dim=1))


@pytest.mark.parametrize("first", ["int8", "binary"])
def test_binary_conv_reads_a_cat_of_layer_signs(first):
    # the cat's signs are the parts' signs, concatenated (a CONCAT with a BIN output; was E402
    # "a binary quantizer reads the result of a concat"): with an 8-bit first layer the parts
    # get implied int8 quantizers (BINARIZE each); with none (the plan has no integer
    # activation: xnor-binary's U-Net) CONV_TRANSPOSE2D and CONV2D give their signs
    torch.manual_seed(0)
    model = _CatToBinary()
    spec = _XNOR.replace("rule 1 {\n  output = a8\n}\n", "")
    spec = spec.replace("rule 0 {", "rule c0 {") if first == "int8" else spec[:spec.index("rule 0 {")]
    handle = qdsl.apply(model, qdsl.parse.parse_text(spec, "x.qspec"))
    qdsl.calibrate(model, [torch.randn(4, 3, 8, 8) for _ in range(2)])
    qdsl.freeze(model)
    x = torch.randn(4, 3, 8, 8)
    graph = qdsl.export(model, x)
    cat = next(op for op in graph.ops if op.type is OpType.CONCAT)
    assert graph.tensor(cat.outputs[0]).dtype.name == "BIN"
    bin_up = any(op.type is OpType.CONV_TRANSPOSE2D and graph.tensor(op.outputs[0]).dtype.name == "BIN"
                 for op in graph.ops)
    assert bin_up == (first == "binary")
    ref = qdsl.run_graph(graph, x, backend="reference")
    if rt.available():
        np.testing.assert_array_equal(qdsl.run_graph(graph, x, backend="cpp"), ref)
    seen = []
    hook = model.head.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(x)
    hook.remove()
    fq = handle.container.quantizers[proxy_key("head", Role.INPUT)].int_repr(seen[0]).numpy().astype(np.int64)
    got = execute(graph, x.numpy(), keep_values=True).values[cat.outputs[0]].astype(np.int64)
    np.testing.assert_array_equal(got, fq)

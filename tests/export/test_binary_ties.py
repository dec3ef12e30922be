"""A binary layer whose result another binary layer reads: the graph takes the sign of an
exact integer accumulator plus an integer threshold, and the frozen fake-quant model must
give the same sign where the sum is a tie.

Before: the fake-quant layer summed ``±s_x·s_w`` in binary32, so an exact 0 came out as
``±1e-9`` and its sign was noise (MobileNetV3-small and EfficientNet-B0 under xnor-binary:
424 of 1024 classifier input signs differed, first at a 1×1 binary conv reading all-positive
inputs); and a bias exactly ``-k`` accumulator steps away (its int32 code ``-k`` at the
bias scale ``float32(s_x·s_w)``, a rounding away from ``s_x·s_w``) got the graph's sign
``+1`` where the sum ``k·s_x·s_w + b̂`` is a rounding below 0."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import qdsl
from qdsl.graph import execute
from qdsl.graph.ir import OpType
from qdsl.parse import parse_text
from qdsl.patch.handle import proxy_key
from qdsl.spec.model import Role

SPEC = """version 1
quantizer wbin = binary(signed, per_channel, observer=mean_abs)
quantizer abin = binary(signed, per_tensor, observer=mean_abs)
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, signed, asymmetric, per_tensor, observer=minmax)
defaults {
  weight = wbin
  input = abin
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
rule c0 {
  weight = w8
  input = a8
}
"""
BALANCED = 8  # channels 0..7 of c1: four +, four - weights (sum of signs 0)


class _TieNet(nn.Module):
    """int8 conv -> ReLU (every binary input +1) -> 1×1 binary conv c1 -> 1×1 binary conv c2."""

    def __init__(self):
        super().__init__()
        self.c0 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.c1 = nn.Conv2d(8, 16, 1)
        self.c2 = nn.Conv2d(16, 4, 1)

    def forward(self, x):
        return self.c2(self.c1(self.relu(self.c0(x))))


def _model() -> _TieNet:
    torch.manual_seed(0)
    model = _TieNet()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # magnitudes with full significands, so s_x·s_w[c] is no binary32 number
        mag = 0.1 + torch.rand(16, 8, generator=g)
        signs = torch.ones(16, 8)
        signs[:BALANCED, 4:] = -1  # sum of signs 0
        signs[BALANCED:, 5:] = -1  # sum of signs +2
        model.c1.weight.copy_((mag * signs).reshape(16, 8, 1, 1))
        model.c1.bias.zero_()
    return model


def _signs(model, handle, graph, x):
    """(graph's sign codes at c2's input, fake-quant's)."""
    op = next(op for op in graph.ops if op.name == "c2" and op.type is OpType.BCONV2D)
    got = execute(graph, x.numpy(), keep_values=True).values[op.inputs[0]].astype(np.int64)
    seen = []
    hook = model.c2.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(x)
    hook.remove()
    q = handle.container.quantizers[proxy_key("c2", Role.INPUT)]
    return got.reshape(seen[0].shape), q.int_repr(seen[0]).numpy().astype(np.int64)


def _frozen(model):
    handle = qdsl.apply(model, parse_text(SPEC, "ties.qspec"))
    qdsl.calibrate(model, [torch.randn(4, 3, 6, 6) for _ in range(2)])
    qdsl.freeze(model)
    return handle


def test_an_exact_zero_sum_has_the_graphs_sign():
    model = _model()
    handle = _frozen(model)
    x = torch.randn(2, 3, 6, 6)
    seen = []
    hook = model.c1.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        model(x)
    hook.remove()
    assert seen[0].dtype is torch.float32  # the layer's own dtype outside
    assert torch.all(seen[0][:, :BALANCED] == 0)  # Σ ±s_x·s_w[c] with as many + as -: exactly 0
    graph = qdsl.export(model, x)
    got, fq = _signs(model, handle, graph, x)
    assert np.all(got[:, :BALANCED] == 1)  # sign(0) = +1 in both
    np.testing.assert_array_equal(got, fq)


def test_a_bias_tie_has_the_fake_quant_sign():
    model = _model()
    handle = _frozen(model)
    patch = handle.layers["c1"]
    s_acc = (patch.iq.scale.double() * patch.wq.scale.double().reshape(-1))  # exact products
    s_b = patch.bq.scale.reshape(-1).double()  # binary32(s_x·s_w)
    below = (s_b > s_acc)[BALANCED:]
    assert below.any() and (~below).any()  # both sides of a tie are exercised
    with torch.no_grad():  # bias code -2 at s_b: 2·s_acc + b̂ = 2·(s_acc - s_b), a rounding from 0
        model.c1.bias_float[BALANCED:] = (-2 * s_b[BALANCED:]).float()
    x = torch.randn(2, 3, 6, 6)
    graph = qdsl.export(model, x)
    got, fq = _signs(model, handle, graph, x)
    expect = np.where(below.numpy(), -1, 1).reshape(1, -1, 1, 1)
    assert np.all(fq[:, BALANCED:] == expect)
    np.testing.assert_array_equal(got, fq)


def test_training_keeps_the_layers_dtype():
    # binary64 only once frozen: QAT computes in the model's dtype
    model = _model()
    qdsl.apply(model, parse_text(SPEC, "ties.qspec"))
    seen = []
    model.c1.register_forward_pre_hook(lambda m, a: seen.append((a[0].dtype, m.weight.dtype)))
    model.train()
    model(torch.randn(2, 3, 6, 6)).sum().backward()
    assert seen == [(torch.float32, torch.float32)]
    assert model.c1.weight_float.grad is not None


def test_a_float_bias_parameter_is_viewed_not_replaced():
    # no bias quantizer, no BN: the bias stays a float32 parameter, which the binary64 forward
    # reads through a view for that call only (was "Input type (double) and bias type (float)")
    model = _model()
    handle = qdsl.apply(model, parse_text(SPEC.replace("  bias = int(bits=32, signed, symmetric, scale=input*weight)\n",
                                                       "  bias = float\n"), "ties.qspec"))
    qdsl.calibrate(model, [torch.randn(4, 3, 6, 6) for _ in range(2)])
    qdsl.freeze(model)
    x = torch.randn(2, 3, 6, 6)
    seen = []
    hook = model.c1.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        model(x)
    hook.remove()
    assert torch.all(seen[0][:, :BALANCED] == 0)
    assert isinstance(model.c1.bias, nn.Parameter) and "bias" in model.c1.state_dict()
    got, fq = _signs(model, handle, qdsl.export(model, x), x)
    np.testing.assert_array_equal(got, fq)

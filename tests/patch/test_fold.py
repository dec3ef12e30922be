"""BatchNorm folding for PTQ: which pairs, what the quantizers see, exact removal."""

import pytest
import torch
from torch import nn

import qdsl
from qdsl.patch import get_handle
from qdsl.patch.fold import find_bn_pairs
from qdsl.zoo.models import conv1d_net, conv_bn_relu_net, digits_resnet
from patch_helpers import same_state, snapshot, spec


def test_pairs_found_by_tracing():
    pairs = find_bn_pairs(digits_resnet())
    assert pairs["stem.0"] == "stem.1"
    assert pairs["layer1.0.conv1"] == "layer1.0.bn1" and pairs["layer1.0.conv2"] == "layer1.0.bn2"
    assert pairs["layer2.0.downsample.0"] == "layer2.0.downsample.1"
    assert "fc" not in pairs
    assert find_bn_pairs(conv1d_net()) == {"features.0": "features.1", "features.3": "features.4",
                                           "features.6": "features.7"}


class _Branchy(nn.Module):
    """Data-dependent control flow: fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.shared = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.bn(self.conv(x))
        if y.sum() > 0:
            y = y * 2
        return self.shared(y)


class _Shared(nn.Module):
    """The conv's output also feeds a second branch: folding would change that branch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


def test_fallback_to_module_order_warns():
    with pytest.warns(UserWarning, match="could not trace _Branchy.*registered right after"):
        pairs = find_bn_pairs(_Branchy())
    assert pairs == {"conv": "bn"}
    assert find_bn_pairs(_Shared()) == {}


def test_quantizers_see_the_folded_weight_and_bias():
    model = conv_bn_relu_net(width=8)
    conv, bn = model.features[0], model.features[1]
    w0 = conv.weight.detach().clone()
    handle = qdsl.apply(model, spec())
    patch = handle.layer("features.0")
    assert patch.bn is bn and patch.bn_fqn == "features.1"
    k = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    w, b = patch.float_params()
    assert torch.allclose(w, w0 * k[:, None, None, None], rtol=1e-6, atol=0)
    assert torch.allclose(b, bn.bias - bn.running_mean * k, rtol=1e-6, atol=1e-7)
    qdsl.calibrate(model, [torch.randn(2, 3, 16, 16)], progress=False)
    qdsl.freeze(model)
    ints = qdsl.int_tensors(model)["features.0"]
    assert ints.folded_bn == "features.1"
    with torch.no_grad():
        assert torch.equal(ints.weight, patch.wq.int_repr(patch.float_params()[0]))
        assert torch.equal(conv.weight, patch.wq(patch.float_params()[0]))
    # the model had no conv bias: folding created one, quantized as int32 at s_in * s_w
    assert ints.bias.dtype == torch.int32
    assert torch.equal(ints.bias_scale, handle.quantizer("features.0", "input").scale * ints.weight_scale)


def test_remove_restores_bn_even_after_train_mode_forwards():
    model = digits_resnet()
    before = snapshot(model)
    qdsl.apply(model, spec())
    model.train()  # BN would update its running stats in train mode
    with torch.no_grad():
        model(torch.randn(4, 1, 8, 8))
    model.eval()
    qdsl.remove(model)
    assert same_state(before, snapshot(model))


def test_no_folding_without_fold_bn():
    model = conv_bn_relu_net(width=8)
    plain = qdsl.parse_spec("version 1\ndefaults { weight = int(bits=8) }\n")
    assert plain.fold_bn is None
    handle = qdsl.apply(model, plain)
    assert all(p.bn is None for p in handle)
    assert model.features[0].bias is None  # nothing folded, no bias created
    qdsl.remove(model)


def test_quantizers_on_a_folded_bn_itself():
    model = conv_bn_relu_net(width=8)
    text = """
version 1
fold_bn
defaults { weight = int(bits=8, per_channel) }
rule features.1 {
  input = int(bits=8, signed)
  output = int(bits=4, signed)
}
"""
    handle = qdsl.apply(model, qdsl.parse_spec(text))
    g = torch.Generator().manual_seed(0)
    qdsl.calibrate(model, [torch.randn(2, 3, 16, 16, generator=g)], progress=False)
    qdsl.freeze(model)
    got = {}
    hook = model.features[2].register_forward_pre_hook(lambda m, a: got.update(x=a[0]))
    with torch.no_grad():
        model(torch.randn(2, 3, 16, 16, generator=g))
    hook.remove()
    q = handle.quantizer("features.1", "output")
    codes = got["x"] * (1.0 / q.scale)
    # on the BN's 4-bit output grid (k·s / s is an integer up to float rounding)
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.round().abs().max() <= 8
    assert handle.quantizer("features.1", "input").observer.observed
    qdsl.remove(model)

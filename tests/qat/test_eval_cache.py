"""Evaluation during QAT (before freeze) reuses the fake-quantized weights until something
they depend on changes (qdsl.patch.layer: the refresh cache), and static activations use
their cached range on the fast path (qdsl.quantizers.proxy)."""

import copy
from pathlib import Path

import pytest
import torch

import qdsl
import qdsl.qat
from qdsl import calibrate
from qdsl.patch import apply
from qdsl.patch.handle import get_handle
from qdsl.zoo.models import conv_bn_relu_net

SPECS = Path(__file__).resolve().parents[2] / "specs"


def _model(spec="pot-asic.qspec"):
    torch.manual_seed(0)
    model = conv_bn_relu_net(width=8)
    apply(model, SPECS / spec)
    x = torch.randn(8, 3, 16, 16)
    calibrate(model, [x])
    qdsl.qat.prepare_qat(model)
    return model, x


def _train_step(model, x, opt):
    model.train()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _eval(model, x):
    model.eval()
    with torch.no_grad():
        return model(x)


def _cold(model, x):
    """The same model evaluated with empty caches (a deep copy drops them)."""
    return _eval(copy.deepcopy(model), x)


def _weight_calls(model):
    calls = []
    for patch in get_handle(model).layers.values():
        if patch.wq is not None:
            patch.wq.register_forward_hook(lambda *a: calls.append(1))
    return calls


@pytest.mark.parametrize("spec", ["pot-asic.qspec", "int8-default.qspec", "w4a8-per-channel.qspec"])
def test_eval_reuses_weights_and_equals_the_uncached_path(spec):
    model, x = _model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _train_step(model, x, opt)
    first = _eval(model, x)
    calls = _weight_calls(model)
    second = _eval(model, x)
    assert calls == []  # no weight was fake-quantized again
    assert torch.equal(first, second)
    assert torch.equal(second, _cold(model, x))


def test_optimizer_step_invalidates():
    model, x = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _train_step(model, x, opt)
    before = _eval(model, x)
    _train_step(model, x, opt)
    after = _eval(model, x)
    assert not torch.equal(before, after)
    assert torch.equal(after, _cold(model, x))


def test_in_place_weight_edit_invalidates():
    model, x = _model()
    before = _eval(model, x)
    patch = get_handle(model).layer("features.3")
    with torch.no_grad():
        patch.master("weight").mul_(-1.5)
    after = _eval(model, x)
    assert not torch.equal(before, after)
    assert torch.equal(after, _cold(model, x))


def test_load_state_dict_invalidates():
    model, x = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = copy.deepcopy(model.state_dict())
    _train_step(model, x, opt)
    trained = _eval(model, x)
    model.load_state_dict(start)
    restored = _eval(model, x)
    assert not torch.equal(trained, restored)
    assert torch.equal(restored, _cold(model, x))


def test_new_activation_statistics_invalidate():
    model, x = _model("int8-default.qspec")
    before = _eval(model, x)
    calibrate(model, [3 * torch.randn(8, 3, 16, 16)])  # wider statistics: new ranges
    after = _eval(model, x)
    assert not torch.equal(before, after)
    assert torch.equal(after, _cold(model, x))

"""Evaluation during QAT (before freeze) reuses the fake-quantized weights until something
they depend on changes (qdsl.patch.layer: the refresh cache; qdsl.patch.attention: the
q/k/v projections), static activations use their cached range on the fast path and dynamic
ones their batch's aminmax (qdsl.quantizers.proxy); none of it changes training."""

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import qdsl
import qdsl.qat
from qdsl import calibrate
from qdsl.patch import apply
from qdsl.patch.attention import AttentionPatch
from qdsl.patch.handle import get_handle
from qdsl.quantizers import TensorQuantizer, functional
from qdsl.quantizers import eval_fast as EF
from qdsl.zoo.models import conv_bn_relu_net

SPECS = Path(__file__).resolve().parents[2] / "specs"


def _model(spec="pot-asic.qspec", activation="relu"):
    torch.manual_seed(0)
    model = conv_bn_relu_net(width=8, activation=activation)
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


# int8-dynamic: its input proxies re-observed every evaluation batch, which changed their
# buffers and so the cache key: every layer fake-quantized its weights on every batch
@pytest.mark.parametrize("spec", ["pot-asic.qspec", "int8-default.qspec", "w4a8-per-channel.qspec",
                                  "int8-dynamic.qspec"])
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


def _encoder(spec="transformer-w8.qspec"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16),
                          nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True))
    apply(model, SPECS / spec)
    x = torch.randn(4, 6, 16)
    calibrate(model, [x])
    qdsl.qat.prepare_qat(model)
    return model, x


def _attention_weight_calls(model):
    calls = []
    for patch in get_handle(model).layers.values():
        if isinstance(patch, AttentionPatch):
            for q in patch.param_proxies():
                if q is not None:
                    q.register_forward_hook(lambda *a: calls.append(1))
    assert calls == [] and any(isinstance(p, AttentionPatch) for p in get_handle(model).layers.values())
    return calls


@pytest.mark.parametrize("spec", ["transformer-w8.qspec", "transformer-int8.qspec", "int8-dynamic.qspec"])
def test_eval_reuses_attention_projections_until_a_step(spec):
    # nn.MultiheadAttention's q/k/v rows were fake-quantized on every evaluation forward
    model, x = _encoder(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _train_step(model, x, opt)
    first = _eval(model, x)
    calls = _attention_weight_calls(model)
    second = _eval(model, x)
    assert calls == []
    assert torch.equal(first, second)
    assert torch.equal(second, _cold(model, x))
    _train_step(model, x, opt)
    after = _eval(model, x)
    assert calls != [] and not torch.equal(after, second)
    assert torch.equal(after, _cold(model, x))


def _xnor():
    return _model("xnor-binary.qspec", activation="hardtanh")


@pytest.mark.parametrize("build", [lambda: _model("int8-dynamic.qspec"), _xnor, lambda: _model("pot-asic.qspec"),
                                   _encoder, lambda: _encoder("int8-dynamic.qspec")],
                         ids=["int8-dynamic", "xnor-binary", "pot-asic", "encoder-w8", "encoder-dynamic"])
def test_training_and_validation_equal_the_general_path(monkeypatch, build):
    """A few QAT steps with evaluation between them: the losses, gradients and evaluation
    outputs are those of the general path (the eval fast paths and the attention cache
    switched off), value for value."""

    def run(general: bool):
        with monkeypatch.context() as m:
            if general:
                m.setattr(EF, "eval_fast", lambda q, x, kind: None)  # every eval fast path off
                m.setattr(functional, "_select_by_mask", lambda *a, **k: False)
                m.setattr(AttentionPatch, "_cache_key", lambda self: None)
            model, x = build()
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            out = []
            for _ in range(3):
                model.train()
                opt.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                out.append(loss.detach())
                out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
                opt.step()
                out.append(_eval(model, x))
            return out

    general, fast = run(True), run(False)
    assert len(general) == len(fast)
    assert all(torch.equal(a, b) for a, b in zip(general, fast))


def test_in_place_edit_of_an_observer_buffer_invalidates():
    # the cache key walks each proxy's parts' own buffers (qdsl.patch.layer.proxy_state_key):
    # an observer is a child module of its proxy, so its statistics are part of the key
    model, x = _model("int8-default.qspec")
    _eval(model, x)
    patch = get_handle(model).layer("features.3")
    calls = _weight_calls(model)
    _eval(model, x)
    assert calls == []
    obs = patch.iq.observer
    buf = next(t for t in obs.buffers() if t.numel())
    with torch.no_grad():
        buf.mul_(2.0)
    after = _eval(model, x)
    assert calls != []  # recomputed: the derived bias follows the input's statistics
    assert torch.equal(after, _cold(model, x))

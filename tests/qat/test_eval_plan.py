"""The per-state evaluation plan of a quantizer (qdsl.quantizers.eval_fast.plan) and the
cheaper cache keys (qdsl.patch.layer.proxy_state_key, TensorQuantizer._static_range): after
every event that changes what a forward computes, evaluation equals the general path (every
eval fast path and shared result off, caches empty) bit for bit, and training is unchanged."""

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import qdsl
import qdsl.qat
from qdsl import calibrate
from qdsl.patch import apply
from qdsl.patch.handle import get_handle
from qdsl.quantizers import TensorQuantizer
from qdsl.quantizers import eval_fast as EF
from qdsl.zoo.models import conv_bn_relu_net

from tests.qat.test_eval_cache import _encoder  # the same small encoder under a spec

SPECS = Path(__file__).resolve().parents[2] / "specs"


def _cnn(spec):
    torch.manual_seed(0)
    model = conv_bn_relu_net(width=8, activation="relu")
    apply(model, SPECS / spec)
    x = torch.randn(8, 3, 16, 16)
    calibrate(model, [x])
    qdsl.qat.prepare_qat(model)
    return model, x


def _eval(model, x):
    model.eval()
    with torch.no_grad():
        return model(x)


def _general(model, x, monkeypatch):
    """``model`` evaluated on the general path: a deep copy (no caches), no fast path, no sharing."""
    twin = copy.deepcopy(model)
    with monkeypatch.context() as m:
        m.setattr(EF, "eval_fast", lambda q, x, kind: None)
        m.setattr(EF.SHARED, "get", lambda x, fp: None)
        return _eval(twin, x)


def _bits(t):
    return t.view(torch.int32)


def _same(model, x, monkeypatch):
    got = _eval(model, x)
    want = _general(model, x, monkeypatch)
    assert torch.equal(_bits(got), _bits(want))
    return got


def _step(model, x, opt):
    model.train()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


MODELS = [lambda: _encoder("transformer-int8.qspec"), lambda: _encoder("transformer-w8.qspec"),
          lambda: _encoder("int8-dynamic.qspec"), lambda: _cnn("int8-default.qspec"),
          lambda: _cnn("pot-asic.qspec")]
IDS = ["encoder-int8", "encoder-w8", "encoder-dynamic", "cnn-int8", "cnn-pot"]


@pytest.mark.parametrize("build", MODELS, ids=IDS)
def test_every_invalidation_event_equals_the_general_path(monkeypatch, build):
    model, x = build()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    start = copy.deepcopy(model.state_dict())
    outs = [_same(model, x, monkeypatch)]
    _same(model, x, monkeypatch)  # a second evaluation: every cache warm
    # optimizer step
    _step(model, x, opt)
    outs.append(_same(model, x, monkeypatch))
    # a master weight changed in place (no optimizer)
    patch = next(p for p in get_handle(model).layers.values()
                 if isinstance(p.module, (nn.Linear, nn.Conv2d)) and p.master("weight") is not None)
    with torch.no_grad():
        patch.master("weight").mul_(-1.25)
    outs.append(_same(model, x, monkeypatch))
    # requires_grad toggled off and on
    for p in model.parameters():
        p.requires_grad_(False)
    outs.append(_same(model, x, monkeypatch))
    with torch.no_grad():
        patch.master("weight").mul_(0.5)
    outs.append(_same(model, x, monkeypatch))
    for p in model.parameters():
        p.requires_grad_(True)
    # train/eval switch: a training forward without a step, then evaluation
    model.train()
    model(x).sum().backward()
    outs.append(_same(model, x, monkeypatch))
    # load_state_dict
    model.load_state_dict(start)
    outs.append(_same(model, x, monkeypatch))
    # quantizer state: one activation quantizer off and on again, new statistics
    acts = [q for q in model.modules() if isinstance(q, TensorQuantizer) and not q.role.is_param]
    acts[0].enabled = False
    outs.append(_same(model, x, monkeypatch))
    acts[0].enabled = True
    calibrate(model, [2.5 * x])
    outs.append(_same(model, x, monkeypatch))
    # freeze: every quantizer's plan changes kind
    qdsl.freeze(model)
    outs.append(_same(model, x, monkeypatch))
    assert not torch.equal(outs[0], outs[1])  # the step changed the model


def test_plan_follows_freeze_load_and_offsets(monkeypatch):
    model, x = _encoder("transformer-int8.qspec")
    _eval(model, x)
    acts = [q for q in model.modules() if isinstance(q, TensorQuantizer) and q.role.value == "input"]
    q = acts[0]
    assert q._eplan is not None and q._eplan[0] == EF.STATIC
    frozen = copy.deepcopy(model)
    qdsl.freeze(frozen)
    fq = [m for m in frozen.modules() if isinstance(m, TensorQuantizer) and m.name == q.name][0]
    assert fq._eplan is None or fq._eplan[0] != EF.STATIC  # reset by freeze (_refresh)
    _eval(frozen, x)
    assert fq._eplan[0] == EF.FROZEN
    # a frozen state dict loaded into the unfrozen model: frozen from then on (load -> _refresh)
    model.load_state_dict(frozen.state_dict())
    assert torch.equal(_bits(_same(model, x, monkeypatch)), _bits(_eval(frozen, x)))
    assert q._eplan[0] == EF.FROZEN
    # an offset added after the plan was made (bias correction on an activation) is applied
    before = _eval(model, x)
    q.add_offset(torch.full((), 0.75))
    after = _same(model, x, monkeypatch)
    assert not torch.equal(before, after)


def test_lean_entry_leaves_autograd_observing_check_finite_and_half_to_the_general_path():
    model, x = _encoder("transformer-int8.qspec")
    _eval(model, x)
    q = next(m for m in model.modules() if isinstance(m, TensorQuantizer) and m.role.value == "input")
    t = torch.randn(4, 6, 16)
    with torch.no_grad():
        ref = q(t)
    tg = t.clone().requires_grad_()
    y = q(tg)  # autograd: the straight-through path, with a gradient
    assert y.grad_fn is not None and torch.equal(y.detach(), ref)
    with torch.no_grad():
        th = t.half()  # half precision: the general path, in float32 on the same values
        assert torch.equal(q(th), q(th.float()).half())
        q.check_finite = True
        bad = t.clone()
        bad[0, 0, 0] = float("nan")
        with pytest.raises(Exception):
            q(bad)
        q.check_finite = False
        q.observing = True
        assert q(t * 7) is not None and torch.equal(q(t), t)  # observing: passes through
        q.observing = False
        assert not torch.equal(q(t), ref)  # the new statistics are used at once


def test_dynamic_scale_is_kept_as_a_number_and_read_as_a_tensor():
    model, x = _encoder("int8-dynamic.qspec")
    _eval(model, x)
    qs = [m for m in model.modules() if isinstance(m, TensorQuantizer) and m.dynamic]
    assert qs and all(q._eplan[0] == EF.DYN_SCALAR for q in qs)
    assert any(isinstance(q.__dict__.get("_last_scale"), float) for q in qs)
    for q in qs:
        s = q.current_scale()
        assert isinstance(s, torch.Tensor) and s.dtype == torch.float32 and s.dim() == 0
    # the number equals the scale the general path derives
    q = qs[0]
    t = torch.randn(4, 6, 16) * 3 + 1
    with torch.no_grad():
        q(t)
    fast = q.current_scale()
    q(t.clone().requires_grad_())
    assert torch.equal(fast, q.current_scale().detach())


def test_pickled_plan_is_not_copied():
    model, x = _encoder("int8-dynamic.qspec")
    _eval(model, x)
    q = next(m for m in model.modules() if isinstance(m, TensorQuantizer) and m.dynamic)
    assert "_eplan" in q.__dict__
    state = q.__getstate__()
    assert "_eplan" not in state


def test_input_state_keys_the_weights_only_through_a_derived_bias(monkeypatch):
    # int8-dynamic: float biases, so a layer's fake-quantized weight does not read its input
    # proxy: an edit of the input proxy's state leaves the cached weights in place (and the
    # result equal to the general path); transformer-w8 derives its bias scale from the
    # input's: the same edit recomputes them
    for spec, recomputed in (("int8-dynamic.qspec", False), ("transformer-w8.qspec", True)):
        model, x = _encoder(spec)
        _eval(model, x)
        patch = get_handle(model).layer("0")
        calls = []
        patch.wq.register_forward_hook(lambda *a: calls.append(1))
        _eval(model, x)
        assert calls == []
        with torch.no_grad():
            patch.iq.scale.add_(0.5)  # an in-place edit (empty before freeze: only its version moves)
        got = _eval(model, x)
        assert (calls != []) == recomputed, spec
        del calls[:]  # (the general path's deep copy carries the hook too)
        assert torch.equal(_bits(got), _bits(_general(model, x, monkeypatch)))


_NARROW = """version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax{dyn})
defaults {{
  weight = w8
  input = a8
  bias = {bias}
  accumulator(bits=12, overflow=wrap)
}}
"""


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_accumulator_hook_reads_the_scale_its_input_quantizer_used(monkeypatch, dynamic):
    # the narrow accumulator's hook reads the input scale the layer's input quantizer used on
    # this call (TensorQuantizer.used_scale: no statistics key walk, the dynamic scalar path's
    # number as is); the oracle is the general path with the hook asking current_scale()
    # (which derives a static scale from the statistics) as before.  Every event that moves
    # the input scale: new statistics, a loaded state, an in-place edit of the observer,
    # disable/enable, freeze; and the wrap really happens.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 12), nn.ReLU(), nn.Linear(12, 6))
    spec = _NARROW.format(dyn=", dynamic" if dynamic else "",
                          bias="float" if dynamic else "int(bits=32, signed, symmetric, scale=input*weight)")
    qdsl.apply(model, qdsl.parse_spec(spec))
    x = torch.randn(16, 48).abs() * 3
    calibrate(model, [x])
    qdsl.qat.prepare_qat(model)

    def oracle():
        with monkeypatch.context() as m:
            m.setattr(TensorQuantizer, "used_scale", TensorQuantizer.current_scale)
            return _general(model, x, monkeypatch)

    def same():
        got = _eval(model, x)
        assert torch.equal(_bits(got), _bits(oracle()))
        return got

    sims = [p.acc_sim for p in get_handle(model).layers.values() if p.acc_sim is not None]
    first = same()
    assert any(s.simulated and s.overflows for s in sims)  # the 12-bit sums wrap
    start = copy.deepcopy(model.state_dict())
    calibrate(model, [0.25 * x])  # new statistics (static) / nothing kept (dynamic)
    same()
    model.load_state_dict(start)
    assert torch.equal(_bits(same()), _bits(first))
    iq = get_handle(model).layers["0"].iq
    with torch.no_grad():  # the observer's statistics edited in place
        for t in iq.observer._buffers.values():
            if t is not None and t.numel():
                t.mul_(3.0)
    same()
    iq.enabled = False
    same()
    iq.enabled = True
    same()
    qdsl.freeze(model)
    same()


def test_used_scale_is_current_scale_after_a_forward():
    for spec in ("transformer-int8.qspec", "int8-dynamic.qspec"):
        model, x = _encoder(spec)
        acts = [q for q in model.modules() if isinstance(q, TensorQuantizer) and q.role.value == "input"]
        for frozen in (False, True):
            if frozen:
                qdsl.freeze(model)
            _eval(model, x)
            for q in acts:
                u, c = q.used_scale(), q.current_scale()
                assert (u is None) == (c is None)
                if u is not None:
                    assert torch.equal(torch.as_tensor(u, dtype=torch.float32), c)


def test_proxy_state_key_equals_the_walk_and_follows_the_tree():
    # the key's tensors come from dicts kept per proxy: the same tensors in the same order as
    # walking the modules, also after a buffer is reassigned, a part is replaced, or a part
    # gains a child of its own (then walked each time)
    from qdsl.patch.layer import _tensors, proxy_state_key

    model, x = _encoder("transformer-int8.qspec")
    _eval(model, x)
    qs = [q for q in model.modules() if isinstance(q, TensorQuantizer)][:6]

    def walked():
        out = []
        for q in qs:
            ts = []
            _tensors(q, ts)
            out.append([id(t) for t in ts])
        return out

    def keyed():
        key, _ = proxy_state_key(qs)
        out, i = [], 0
        while i < len(key):
            n = key[i + 5]
            out.append(key[i + 6:i + 6 + n])
            i += 6 + 3 * n
        return out

    assert keyed() == walked()
    q = qs[0]
    q.scale = torch.ones(3)  # a buffer reassigned
    assert keyed() == walked()
    q.observer = copy.deepcopy(q.observer)  # a part replaced
    assert keyed() == walked()
    q.observer.extra = nn.Linear(2, 2)  # a part with a child of its own
    assert keyed() == walked() and any(id(q.observer.extra.weight) in k for k in keyed())
    del q.observer.extra
    assert keyed() == walked()

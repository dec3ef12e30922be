"""``qdsl.apply(..., materialize=False)``: no fake-quantized copy at install; ``module.weight``
computes on first use and everything else is the eager install's, bit for bit."""

import copy
import gc
import io
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdsl
from qdsl.export import export
from qdsl.patch import get_handle
from qdsl.patch.ints import int_tensors
from qdsl.patch.lazy_weight import LazyQuantized
from qdsl.quantizers import proxy_grad
from qdsl.runtime.run import run_graph
from qdsl.spec.diagnostics import QdslError
from qdsl.zoo.models import conv_bn_relu_net, mlp
from patch_helpers import same_state, snapshot, spec

MODELS = [
    ("mlp", lambda: mlp(seed=0, sizes=(61, 67, 10)), (8, 61)),  # odd sizes: the weights are found by shape
    ("conv_bn", lambda: conv_bn_relu_net(width=8), (4, 3, 16, 16)),  # folded BN: weight and bias computed
]
IDS = [m[0] for m in MODELS]


def _pair(make):
    eager, lazy = make(), make()
    qdsl.apply(eager, spec())
    qdsl.apply(lazy, spec(), materialize=False)
    return eager, lazy


def _moved(model):
    return [(fqn, p) for fqn, p in get_handle(model).layers.items() if getattr(p, "_moved", None)]


def _x(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make,shape", [m[1:] for m in MODELS], ids=IDS)
def test_forward_and_gradients_equal_the_eager_install(make, shape):
    eager, lazy = _pair(make)
    for fqn, patch in _moved(lazy):
        assert all(isinstance(patch.module.__dict__[n], LazyQuantized) for n in patch._moved)
    x = _x(shape)
    qdsl.calibrate(eager, [x])
    qdsl.calibrate(lazy, [x])
    for model in (eager, lazy):
        proxy_grad.install(model)
        model.train()
    outs, grads = [], []
    for model in (eager, lazy):
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for i in range(2):
            opt.zero_grad()
            out = model(_x(shape, seed=2 + i))
            F.cross_entropy(out, torch.arange(out.shape[0]) % out.shape[1]).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
        outs.append(out.detach())
    assert torch.equal(outs[0], outs[1])
    assert grads[0].keys() == grads[2].keys() and grads[1].keys() == grads[3].keys()
    for a, b in ((grads[0], grads[2]), (grads[1], grads[3])):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert same_state(snapshot(eager), snapshot(lazy))


@pytest.mark.parametrize("make,shape", [m[1:] for m in MODELS], ids=IDS)
def test_reading_the_weight_before_a_forward(make, shape):
    eager, lazy = _pair(make)
    pairs = [(pe.module, pl.module, name) for (_, pe), (_, pl) in zip(_moved(eager), _moved(lazy)) for name in pl._moved]
    for me, ml, name in pairs:  # metadata computes nothing
        we, wl = getattr(me, name), getattr(ml, name)
        assert (wl is None) == (we is None)
        if we is not None:
            assert isinstance(wl, torch.Tensor) and isinstance(wl, LazyQuantized)
            assert (wl.shape, wl.dtype, wl.device, wl.dim(), wl.numel()) == (we.shape, we.dtype, we.device, we.dim(), we.numel())
            assert ml.__dict__[name] is wl and wl._value is None
    for me, ml, name in pairs:  # any use computes the eager install's value and stores it on the module
        we, wl = getattr(me, name), getattr(ml, name)
        if we is None:
            continue
        assert torch.equal(wl, we) and torch.equal(wl * 2, we * 2) and torch.equal(wl.sum(0), we.sum(0))
        assert wl.requires_grad == we.requires_grad
        real = ml.__dict__[name]
        assert not isinstance(real, LazyQuantized) and torch.equal(real, we)
        assert type(real) is type(we) and real.requires_grad == we.requires_grad
        assert getattr(ml, name) is real
    eager.eval(), lazy.eval()
    x = _x(shape)
    with torch.no_grad():
        assert torch.equal(eager(x), lazy(x))


def test_repr_copy_and_pickle_compute_the_value():
    eager, lazy = _pair(MODELS[0][1])
    w = eager[0].weight if isinstance(eager, nn.Sequential) else eager.net[1].weight
    fqn = next(f for f, p in _moved(lazy) if p.module.weight.shape == w.shape)
    assert repr(get_handle(lazy).layers[fqn].module.weight) == repr(w)
    for copier in (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
        _, fresh = _pair(MODELS[0][1])
        dup = copier(fresh)
        for (f1, p1), (f2, p2) in zip(_moved(eager), _moved(dup)):
            for name in p1._moved:
                a, b = p1.module.__dict__[name], p2.module.__dict__[name]
                assert type(b) is type(a) and torch.equal(a, b)
    buf = io.BytesIO()
    torch.save(_pair(MODELS[0][1])[1], buf)
    buf.seek(0)
    assert isinstance(torch.load(buf, weights_only=False), nn.Module)


def test_a_stale_lazy_weight_is_an_error():
    _, lazy = _pair(MODELS[0][1])
    fqn, patch = _moved(lazy)[0]
    held = patch.module.weight
    lazy(_x((2, 61)))  # the forward computes module.weight itself
    assert type(patch.module.__dict__["weight"]) is torch.Tensor
    with pytest.raises(QdslError, match="read module.weight again"):
        held + 1


@pytest.mark.parametrize("make,shape", [m[1:] for m in MODELS], ids=IDS)
def test_remove_restores_the_model_exactly(make, shape):
    model = make()
    before = snapshot(model)
    params = dict(model.named_parameters())
    types = {n: type(m) for n, m in model.named_modules()}
    dicts = {n: set(m.__dict__) for n, m in model.named_modules()}
    x = _x(shape)
    with torch.no_grad():
        y = model(x)
    qdsl.apply(model, spec(), materialize=False)
    assert all(type(m) is types[n] for n, m in model.named_modules() if n in types)  # no class swap
    qdsl.remove(model)
    assert same_state(before, snapshot(model))
    assert all(p is params[n] for n, p in model.named_parameters())
    assert {n: type(m) for n, m in model.named_modules()} == types
    assert {n: set(m.__dict__) for n, m in model.named_modules()} == dicts
    with torch.no_grad():
        assert torch.equal(model(x), y)


@pytest.mark.parametrize("make,shape", [m[1:] for m in MODELS], ids=IDS)
def test_state_dict_round_trip(make, shape):
    eager, lazy = _pair(make)
    x = _x(shape)
    qdsl.calibrate(eager, [x])
    state = lazy.state_dict()  # before anything computed: the masters and qdsl's state
    assert [k for k in state] == [k for k in eager.state_dict()]
    target = make()
    qdsl.apply(target, spec(), materialize=False)
    target.load_state_dict(eager.state_dict())
    assert same_state(snapshot(eager), snapshot(target))
    eager.eval(), target.eval()
    with torch.no_grad():
        assert torch.equal(eager(x), target(x))
    del state


def test_no_full_size_copy_is_held():
    model = mlp(seed=0, sizes=(59, 71, 13))  # shapes no other test's tensors have
    qdsl.apply(model, spec(), materialize=False)
    gc.collect()
    for fqn, patch in _moved(model):
        w = patch.master("weight")
        lazy = patch.module.__dict__["weight"]
        assert isinstance(lazy, LazyQuantized)
        assert lazy._value is None  # nothing computed, nothing referenced
        # every float tensor of the weight's shape alive in the process shares the master's
        # storage (a wrapper subclass has none)
        alive = [t for t in gc.get_objects() if type(t) in (torch.Tensor, nn.Parameter)
                 and t.shape == w.shape and t.is_floating_point()]
        assert alive and {t.untyped_storage().data_ptr() for t in alive} == {w.untyped_storage().data_ptr()}


def test_freeze_export_and_lint_on_a_lazily_applied_model():
    x = _x((16, 3, 16, 16))
    eager, lazy = _pair(lambda: conv_bn_relu_net(width=8))
    qdsl.calibrate(eager, [x])
    qdsl.calibrate(lazy, [x])
    qdsl.freeze(eager)
    qdsl.freeze(lazy)
    ge, gl = export(eager, x[:2]), export(lazy, x[:2])
    ie, il = int_tensors(eager), int_tensors(lazy)
    assert ie.keys() == il.keys() and all(torch.equal(ie[k].weight, il[k].weight) for k in ie)
    np.testing.assert_array_equal(run_graph(ge, x, backend="reference"), run_graph(gl, x, backend="reference"))
    with torch.no_grad():
        assert torch.equal(eager(x), lazy(x))
    # lint on a model applied lazily and never run
    fresh = conv_bn_relu_net(width=8)
    qdsl.apply(fresh, spec(), materialize=False)
    codes = [d.code for d in qdsl.lint(spec(), "x86-fbgemm", model=fresh)]
    ref = conv_bn_relu_net(width=8)
    qdsl.apply(ref, spec())
    assert codes == [d.code for d in qdsl.lint(spec(), "x86-fbgemm", model=ref)]

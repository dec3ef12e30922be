"""An applied model is an ordinary nn.Module: ``copy.deepcopy``, ``pickle`` and
``torch.save(model)`` work in every lifecycle state (prepared, calibrated, QAT-trained,
frozen); the copy gives identical outputs, shares no state with the original, and
``qdsl.remove`` on it restores it exactly without touching the original."""

import copy
import gc
import io
import pickle
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdsl
import qdsl.qat
from qdsl.graph.qgraph import graph_to_bytes
from qdsl.parse import load_spec
from qdsl.patch import State, get_handle, state_of
from qdsl.zoo.models import conv_bn_relu_net, digits_binary_cnn
from patch_helpers import same_state, snapshot, spec

SPECS = Path(__file__).resolve().parents[2] / "specs"

LEARNED = """
version 1
fold_bn
defaults {
  weight = int(bits=4, signed, narrow, symmetric, per_channel, scale=learned, observer=minmax)
  input = int(bits=8, signed, symmetric, per_tensor, scale=learned_pot, observer=minmax)
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
"""

POT_WEIGHTS = """
version 1
fold_bn
defaults {
  weight = pot(bits=4, per_channel)
  input = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
}
"""

# name -> (spec, model factory, input channels)
CASES = {
    "int8": (lambda: load_spec(SPECS / "int8-default.qspec"), lambda: conv_bn_relu_net(width=8), 3),
    "w4_mse": (lambda: load_spec(SPECS / "w4a8-per-channel.qspec"), lambda: conv_bn_relu_net(width=8), 3),
    "pot_scales": (lambda: load_spec(SPECS / "pot-asic.qspec"), lambda: conv_bn_relu_net(width=8), 3),
    "xnor": (lambda: load_spec(SPECS / "xnor-binary.qspec"), lambda: digits_binary_cnn(width=8), 1),
    "lsq": (lambda: spec(LEARNED), lambda: conv_bn_relu_net(width=8), 3),
    "pot_weights": (lambda: spec(POT_WEIGHTS), lambda: conv_bn_relu_net(width=8), 3),
}
STATES = ["prepared", "calibrated", "qat", "frozen"]


def _x(ch, seed, n=6):
    return torch.randn(n, ch, 8, 8, generator=torch.Generator().manual_seed(seed))


def _train_step(model, x, lr=1e-2):
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    opt.zero_grad()
    F.cross_entropy(model(x), torch.arange(len(x)) % 10).backward()
    opt.step()


def _model_in(state, case):
    make_spec, make_model, ch = CASES[case]
    model = make_model()
    qdsl.apply(model, make_spec())
    if state == "prepared":
        return model, ch
    qdsl.calibrate(model, [_x(ch, s) for s in range(3)], progress=False)
    if state == "calibrated":
        return model, ch
    qdsl.qat.prepare_qat(model)
    # after a backward and an optimizer step; left in train mode with module.weight a
    # non-leaf (what an EMA copy or a mid-training checkpoint sees)
    _train_step(model, _x(ch, 10))
    model(_x(ch, 11))
    if state == "qat":
        return model, ch
    model.eval()
    qdsl.freeze(model)
    return model, ch


def _torch_save(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)  # a whole model is not weights-only data


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch_save": _torch_save,
}


def _tracked(o) -> bool:
    """Objects a copy must not share with its original (mutable state)."""
    return isinstance(o, (torch.Tensor, nn.Module, dict, list, set, torch.Generator)) or (
        type(o).__module__.startswith("qdsl.") and hasattr(o, "__dict__"))


def _reachable(root) -> dict[int, object]:
    """Every tracked object reachable from ``root``: through containers, instance state,
    bound methods and closures (a function's globals and classes are not followed)."""
    seen: dict[int, object] = {}
    visited: set[int] = set()
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in visited or isinstance(o, (type, types.ModuleType, str, bytes, int, float, bool)):
            continue
        visited.add(id(o))
        if _tracked(o):
            seen[id(o)] = o
        if isinstance(o, torch.Tensor):
            continue
        if isinstance(o, types.FunctionType):
            stack += [c.cell_contents for c in (o.__closure__ or ())] + list(o.__defaults__ or ())
            continue
        stack += gc.get_referents(o)
    return seen


def _same_outputs(a, b, x):
    a.eval(), b.eval()
    with torch.no_grad():
        ya, yb = a(x), b(x)
    return torch.equal(ya, yb)


def _no_hooks_left(model) -> bool:
    return all(not (m._forward_pre_hooks or m._forward_hooks or m._load_state_dict_pre_hooks)
               for m in model.modules())


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("case", list(CASES))
def test_copy_is_identical_independent_and_removable(case, state, how):
    model, ch = _model_in(state, case)
    training = model.training
    c = COPIES[how](model)
    assert c.training == training
    # the same outputs, in eval and (for the trained state) in a train-mode forward
    if state == "qat":
        model.train(), c.train()
        x = _x(ch, 12)
        assert torch.equal(model(x), c(x))
    assert _same_outputs(model, c, _x(ch, 20))

    # no shared mutable state (tensors, modules, dicts, hooks' objects, closures' cells)
    shared = set(_reachable(model)) & set(_reachable(c))
    assert not shared, [type(_reachable(model)[i]).__name__ for i in list(shared)[:5]]

    # the copy has its own handle, in the same state, pointing at the copy
    h, hc = get_handle(model), get_handle(c)
    assert hc is not h and hc.model is c and h.model is model
    assert state_of(c) is state_of(model)
    assert all(hc.quantizer(*k) is q for k, q in hc.quantizers().items())
    assert all(p.module is dict(c.named_modules())[fqn] for fqn, p in hc.layers.items())

    # changing the copy (statistics, scales, a training step) leaves the original alone
    before, y_before = snapshot(model), None
    with torch.no_grad():
        y_before = model.eval()(_x(ch, 21))
    if state != "frozen":
        qdsl.calibrate(c, [_x(ch, 30) * 3], progress=False)
    _train_step(c, _x(ch, 31), lr=0.5)
    with torch.no_grad():
        for q in hc.container.quantizers.values():
            if q.scale.numel():
                q.scale.mul_(2)
    assert same_state(before, snapshot(model))
    with torch.no_grad():
        assert torch.equal(model.eval()(_x(ch, 21)), y_before)

    # remove() on the copy restores it and does not affect the original
    qdsl.remove(c)
    assert "_qdsl" not in c._modules and _no_hooks_left(c) and state_of(c) is None
    assert state_of(model) is not None  # still applied
    assert get_handle(model) is h and same_state(before, snapshot(model))


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("state", ["calibrated", "qat", "frozen"])
def test_remove_on_a_copy_equals_remove_on_the_original(state, how):
    model, ch = _model_in(state, "lsq")
    c = COPIES[how](model)
    qdsl.remove(c)
    qdsl.remove(model)
    assert same_state(snapshot(model), snapshot(c))
    assert [type(m) for m in model.modules()] == [type(m) for m in c.modules()]
    assert _same_outputs(model, c, _x(ch, 40))
    assert _no_hooks_left(model) and _no_hooks_left(c)


def test_loaded_model_exports_the_same_graph(tmp_path):
    model, ch = _model_in("frozen", "int8")
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    x = _x(ch, 50)
    g1, g2 = qdsl.export(model, x), qdsl.export(loaded, x)
    assert graph_to_bytes(g1) == graph_to_bytes(g2)
    assert state_of(loaded) is State.EXPORTED


def test_prepare_qat_after_unpickling_trains_the_copy():
    """prepare_qat on a loaded model (its patches are new objects) installs fresh hooks
    whose ids do not collide with the loaded ones."""
    model, ch = _model_in("calibrated", "w4_mse")
    c = pickle.loads(pickle.dumps(model))
    qdsl.qat.prepare_qat(c)
    qdsl.qat.prepare_qat(model)
    for m in (model, c):
        torch.manual_seed(0)
        _train_step(m, _x(ch, 60))
    assert same_state(snapshot(model), snapshot(c))
    assert _same_outputs(model, c, _x(ch, 61))
    qdsl.remove(c)
    assert _no_hooks_left(c)


@pytest.mark.parametrize("state", ["calibrated", "qat", "frozen"])
@pytest.mark.parametrize("case", ["int8", "lsq", "xnor"])
def test_state_dict_loads_into_a_freshly_applied_model(case, state):
    model, ch = _model_in(state, case)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    make_spec, make_model, _ = CASES[case]
    fresh = make_model()
    qdsl.apply(fresh, make_spec())
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert state_of(fresh) is state_of(model)
    assert _same_outputs(model, fresh, _x(ch, 70))


def test_ema_of_a_qat_model_with_averaged_model():
    """torch's AveragedModel deep-copies the model mid-training (the EMA workflow)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model, ch = _model_in("qat", "lsq")
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for seed in (80, 81):
        _train_step(model, _x(ch, seed))
        ema.update_parameters(model)
    x = _x(ch, 82)
    ema.eval(), model.eval()
    with torch.no_grad():
        y_ema, y = ema(x), model(x)
    assert torch.isfinite(y_ema).all() and not torch.equal(y_ema, y)
    assert get_handle(ema.module).model is ema.module and state_of(ema.module) is state_of(model)

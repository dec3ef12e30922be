"""QAT BatchNorm folding on an applied model: live statistics, frozen statistics, eval, removal."""

import copy

import pytest
import torch
from torch import nn

import qdsl.qat
from qdsl.parse import parse_text
from qdsl.patch.apply import apply, remove
from qdsl.patch.handle import get_handle
from qdsl.quantizers import functional as F
from qdsl.zoo import models

WEIGHT_ONLY = """version 1
fold_bn
defaults {
  weight = int(bits=4, signed, narrow, symmetric, per_channel, observer=minmax)
}
"""


def _spec():
    return parse_text(WEIGHT_ONLY, "w4.qspec")


def _x(shape=(8, 3, 12, 12), seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _manual_reference(float_model, handle, x):
    """The live-statistics form computed by hand: every folded conv gets Q(W·f)/f, BN runs as is."""
    ref = copy.deepcopy(float_model).train()
    mods = dict(ref.named_modules())
    with torch.no_grad():
        for fqn, patch in handle.layers.items():
            w = mods[fqn].weight
            q = patch.wq
            if patch.bn is not None:
                bn = mods[patch.bn_fqn]
                f = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).reshape(-1, *([1] * (w.dim() - 1)))
                wf = w * f
                s, zp, _ = q.qparams(wf)
                w.copy_(F.fake_quant_affine(wf, s, zp, q.qmin, q.qmax, axis=0) / f)
            else:
                s, zp, _ = q.qparams(w)
                w.copy_(F.fake_quant_affine(w, s, zp, q.qmin, q.qmax, axis=0))
    return ref, ref(x)


@pytest.mark.parametrize("factory,shape", [(models.conv_bn_relu_net, (8, 3, 12, 12)), (models.conv1d_net, (8, 1, 64))])
def test_live_statistics_form_matches_hand_computation(factory, shape):
    base = factory(width=4) if factory is models.conv_bn_relu_net else factory(width=8)
    model = copy.deepcopy(base)
    handle = apply(model, _spec())
    assert qdsl.qat.prepare_qat(model) == 3
    x = _x(shape)
    ref, y_ref = _manual_reference(base, handle, x)
    model.train()
    y = model(x)
    assert torch.allclose(y, y_ref, atol=1e-5, rtol=1e-4)
    # BN running statistics were updated from the batch, exactly like the reference's
    for fqn, patch in handle.layers.items():
        if patch.bn is not None:
            ref_bn = dict(ref.named_modules())[patch.bn_fqn]
            assert torch.allclose(patch.bn.running_mean, ref_bn.running_mean, atol=1e-6)
            assert torch.allclose(patch.bn.running_var, ref_bn.running_var, atol=1e-5)
    y.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_eval_is_the_inference_fold_and_freeze_makes_train_equal_eval():
    base = models.conv_bn_relu_net(width=4)
    plain = copy.deepcopy(base)
    apply(plain, _spec())
    model = copy.deepcopy(base)
    apply(model, _spec())
    qdsl.qat.prepare_qat(model)
    x = _x()
    plain.eval()
    model.eval()
    assert torch.equal(model(x), plain(x))
    model.train()
    model(x)  # live statistics: running stats move
    assert qdsl.qat.freeze_bn_stats(model) == 3
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    y_train = model(x)
    for k, v in model.state_dict().items():
        if ":weight.observer" not in k:  # weight observers re-observe W·f every call
            assert torch.equal(v, before[k]), k
    model.eval()
    assert torch.allclose(y_train, model(x))
    y_train.sum().backward()  # gradients still reach the master weights through the fold
    assert model.features[0].weight_float.grad.abs().sum() > 0
    assert qdsl.qat.unfreeze_bn_stats(model) == 3
    model.train()
    model(x)
    assert not torch.equal(model.features[1].running_mean, before["features.1.running_mean"])


def test_freeze_bn_after_n_batches():
    model = models.conv_bn_relu_net(width=4)
    apply(model, _spec())
    qdsl.qat.prepare_qat(model, freeze_bn_after=2)
    model.train()
    x = _x()
    means = []
    for _ in range(4):
        model(x + torch.randn_like(x))
        means.append(model.features[1].running_mean.clone())
    assert not torch.equal(means[0], means[1])
    assert torch.equal(means[1], means[2]) and torch.equal(means[2], means[3])
    assert int(model.features[1].num_batches_tracked) == 2


def test_frozen_model_uses_inference_fold_for_export():
    import qdsl.patch as patch_api

    model = models.conv_bn_relu_net(width=4)
    apply(model, _spec())
    qdsl.qat.prepare_qat(model)
    model.train()
    model(_x())
    model.eval()
    if not hasattr(patch_api, "freeze"):
        pytest.skip("qdsl.freeze not available yet")
    patch_api.freeze(model)
    model.train()  # even in train mode a frozen model computes the folded integer form
    handle = get_handle(model)
    y = model(_x())
    model.eval()
    assert torch.equal(y, model(_x()))
    w, _ = handle.layer("features.0").float_params()
    assert torch.equal(model.features[0].weight, handle.layer("features.0").wq(w.detach()))


def test_prepare_is_idempotent_and_remove_restores():
    base = models.conv_bn_relu_net(width=4)
    model = copy.deepcopy(base)
    apply(model, _spec())
    assert qdsl.qat.prepare_qat(model) == qdsl.qat.prepare_qat(model) == 3
    assert sum(len(m._forward_hooks) for m in model.modules() if isinstance(m, nn.BatchNorm2d)) == 3
    remove(model)
    assert all(len(m._forward_hooks) == 0 for m in model.modules())
    for (k, v), (k2, v2) in zip(model.state_dict().items(), base.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def test_searching_weight_observer_reruns_every_n_forwards(monkeypatch):
    from qdsl.quantizers import range_search

    spec = parse_text(WEIGHT_ONLY.replace("observer=minmax", "observer=mse"), "w4mse.qspec")
    model = models.conv_bn_relu_net(width=4)
    apply(model, spec)
    qdsl.qat.prepare_qat(model, weight_search_every=3)
    calls = []
    search = range_search.mse_clip_ratio
    monkeypatch.setattr(range_search, "mse_clip_ratio", lambda *a, **k: calls.append(1) or search(*a, **k))
    model.train()
    # real optimizer steps: the weights change every step (an unchanged weight tensor is
    # never observed twice, see TensorQuantizer._observed)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(4):
        opt.zero_grad()
        model(_x((2, 3, 8, 8))).sum().backward()
        opt.step()
    # every weight was searched at apply; in between, the clip ratio is carried.  The 3
    # folded convs (a new tensor each forward) are observed at forwards 0-3 and search at
    # their 3rd training observation (forward 2); the classifier's plain weight is unchanged
    # at forward 0, observed at forwards 1-3 and searches at forward 3
    assert len(calls) == 3 + 1
    model.eval()
    with torch.no_grad():
        model(_x((2, 3, 8, 8)))
    # once training has carried, eval carries too (it uses the grid training used)
    assert len(calls) == 3 + 1


def test_static_activation_ranges_are_memoized_until_statistics_change():
    spec = parse_text(WEIGHT_ONLY.replace("}", "  input = int(bits=8, signed, symmetric, per_tensor, "
                                                "observer=histogram(percentile=99.9))\n}"), "a8.qspec")
    model = models.conv_bn_relu_net(width=4)
    handle = apply(model, spec)
    from qdsl import calibrate

    calibrate(model, [_x((4, 3, 8, 8))])
    obs = handle.layer("features.3").iq.observer
    calls = []
    compute = type(obs).range
    # counted for this observer only: the end of a calibration takes every static range
    type(obs).range = lambda self: (calls.append(1) if self is obs else None) or compute(self)
    try:
        qdsl.qat.prepare_qat(model)
        model.train()
        first = obs.range()
        for _ in range(3):
            assert obs.range() is first
        assert len(calls) == 1
        calibrate(model, [_x((4, 3, 8, 8), seed=5)])  # new statistics: recomputed
        second = obs.range()
        assert len(calls) == 2 and second is not first
        handle.layer("features.3").iq.observer.load_state_dict(obs.state_dict())
        obs.range()
        assert len(calls) == 3  # a loaded state (in-place copies) invalidates it too
    finally:
        type(obs).range = compute

"""Searched weight ranges in QAT (issue 24): searched once, then carried as a clip ratio.

* the vectorised search equals a per-channel reference loop (kept here, tiny);
* QAT forwards do not search again (counted), with or without calibration;
* right after calibration the carried range is the searched one, exactly;
* ``qdsl.qat.research_ranges`` searches on request; ``search_every`` from the spec wins;
* ``state_dict`` round-trips the carried ratios.
"""

import copy

import pytest
import torch
import torch.nn.functional as TF

import qdsl
import qdsl.qat
from qdsl.parse import parse_text
from qdsl import apply, calibrate, freeze
from qdsl.patch import get_handle
from qdsl.quantizers import functional as F
from qdsl.quantizers import observers as O
from qdsl.quantizers import range_search as RS
from qdsl.spec.diagnostics import QdslError
from qdsl.zoo.models import mlp

W4 = "version 1\ndefaults {{ weight = int(bits=4, signed, narrow, symmetric, per_channel{extra}) }}\n"


def _spec(extra=""):
    return parse_text(W4.format(extra=extra), "w4.qspec")


def _data(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)


_SEARCH = RS.mse_clip_ratio  # the unpatched search, for expected values


def _count_searches(monkeypatch):
    calls = []
    monkeypatch.setattr(RS, "mse_clip_ratio", lambda *a, **k: calls.append(1) or _SEARCH(*a, **k))
    return calls


def _train(model, x, y, steps=4, lr=1e-2):
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for i in range(steps):
        opt.zero_grad()
        TF.cross_entropy(model(x[i * 16 : i * 16 + 16]), y[i * 16 : i * 16 + 16]).backward()
        opt.step()
    return opt


# ------------------------------------------------------------------ the search itself


def _reference_ratio(rows, qmin, qmax, symmetric, grid, norm, pot):
    """The old search, one channel and one candidate at a time, scored with the
    quantizer's own arithmetic (functional.fake_quant_affine) in float64 sums."""
    ratios = torch.arange(1, grid + 1, dtype=torch.float32) / grid
    best = []
    for row in rows:
        lo0 = torch.clamp(row.min(), max=0.0)
        hi0 = torch.clamp(row.max(), min=0.0)
        if symmetric and qmin >= 0:
            lo0 = torch.zeros(())
        errs = []
        for r in ratios:
            lo, hi = lo0 * r, hi0 * r
            s, z = RS.range_to_qparams(lo, hi, qmin, qmax, symmetric=symmetric)
            if pot:
                s = torch.exp2(torch.round(torch.log2(s)))
                if not symmetric:
                    z = torch.clamp(qmin - torch.round(lo / s), qmin, qmax)
            xq = F.fake_quant_affine(row, s, z, qmin, qmax)
            errs.append(float((xq - row).double().abs().pow(norm).sum()))
        m = min(errs)
        best.append(float(ratios[max(i for i, e in enumerate(errs) if e == m)]))  # widest among ties
    return best


@pytest.mark.parametrize("qmin,qmax,symmetric,pot,norm", [
    (-7, 7, True, False, 2.0), (-8, 7, True, False, 2.0), (0, 15, False, False, 2.0), (-8, 7, False, False, 1.0),
    (0, 7, True, False, 2.0), (-7, 7, True, True, 2.0), (0, 15, False, True, 2.4), (-1, 1, True, False, 2.0),
])
def test_vectorised_search_equals_per_channel_reference(monkeypatch, qmin, qmax, symmetric, pot, norm):
    monkeypatch.setattr(RS, "_BLOCK_ELEMENTS", 100)  # several row blocks
    g = torch.Generator().manual_seed(7)
    w = torch.randn(6, 5, 3, 3, generator=g)
    w[2, 0, 0, 0] = 9.0  # an outlier worth clipping
    w[4] += 0.7  # a skewed channel
    ratio = RS.mse_clip_ratio(w, qmin, qmax, symmetric=symmetric, axis=0, grid=40, norm=norm, pot=pot)
    assert ratio.tolist() == _reference_ratio(w.reshape(6, -1), qmin, qmax, symmetric, 40, norm, pot)
    # axis 1 and per tensor go through the same code
    r1 = RS.mse_clip_ratio(w, qmin, qmax, symmetric=symmetric, axis=1, grid=40, norm=norm, pot=pot)
    assert r1.tolist() == _reference_ratio(w.movedim(1, 0).reshape(5, -1), qmin, qmax, symmetric, 40, norm, pot)
    rt = RS.mse_clip_ratio(w, qmin, qmax, symmetric=symmetric, grid=40, norm=norm, pot=pot)
    assert [float(rt)] == _reference_ratio(w.reshape(1, -1), qmin, qmax, symmetric, 40, norm, pot)
    # mse_range is the ratio applied to the min/max range
    lo, hi = RS.mse_range(w, qmin, qmax, symmetric=symmetric, axis=0, grid=40, norm=norm, pot=pot)
    lo0, hi0 = RS.channel_minmax(w.reshape(6, -1), symmetric, qmin)
    elo, ehi = RS.range_from_ratio(lo0, hi0, ratio, qmin, qmax, symmetric=symmetric, pot=pot)
    assert torch.equal(lo, elo) and torch.equal(hi, ehi)


# ---------------------------------------------------------------- carried during QAT


@pytest.mark.parametrize("calibrated", [True, False])
def test_qat_forwards_do_not_search_again(monkeypatch, calibrated):
    calls = _count_searches(monkeypatch)
    x, y = _data()
    model = mlp(seed=0, sizes=(64, 48, 32, 10))
    handle = apply(model, _spec())  # the first forward of the weights: one search per layer
    assert len(calls) == 3
    if calibrated:
        calibrate(model, [x[:32]])
        assert len(calls) == 3  # same weights: nothing to search again
    _train(model, x, y, steps=4)
    assert len(calls) == 3  # four optimizer steps changed every weight: carried, not searched
    for patch in handle.layers.values():
        assert bool(patch.wq.observer.carrying) and patch.wq.observer.searches == 1
    model.eval()
    with torch.no_grad():
        model(x)
    freeze(model)
    assert len(calls) == 3  # eval and freeze use the grid training used


def test_ptq_still_searches_every_new_weight(monkeypatch):
    # before any training forward the observer is in PTQ mode: a changed weight is searched
    calls = _count_searches(monkeypatch)
    model = mlp(seed=0, sizes=(64, 48, 32, 10))
    handle = apply(model, _spec())
    with torch.no_grad():
        handle.layers["net.1"].master("weight").mul_(1.5)
        model(torch.randn(2, 64))
    assert len(calls) == 4 and not bool(handle.layers["net.1"].wq.observer.carrying)


@pytest.mark.parametrize("weight", [
    "int(bits=4, signed, narrow, symmetric, per_channel)",
    "int(bits=4, signed, narrow, symmetric, per_channel, scale=pot)",
    "int(bits=4, unsigned, asymmetric, per_channel)",
    "int(bits=3, unsigned, asymmetric, per_channel, scale=pot)",
])
def test_carried_range_equals_searched_right_after_calibration(monkeypatch, weight):
    x, _ = _data()
    spec = parse_text(f"version 1\ndefaults {{ weight = {weight} }}\n", "w.qspec")
    model = mlp(seed=0, sizes=(64, 48, 32, 10))
    handle = apply(model, spec)
    calibrate(model, [x[:32]])
    calls = _count_searches(monkeypatch)
    for patch in handle.layers.values():
        q, w = patch.wq, patch.master("weight")
        assert isinstance(q.observer, O.MseObserver)
        s0, z0, _ = (t.clone() if t is not None else t for t in q.qparams(w))
        lo0, hi0 = (t.clone() for t in q.observer.range())
        ctx = q.observer.ctx
        ratio = _SEARCH(w.detach(), q.qmin, q.qmax, symmetric=q.recipe.symmetric, axis=0, pot=ctx.pot)
        expect = RS.range_from_ratio(*RS.channel_minmax(w.detach(), q.recipe.symmetric, q.qmin), ratio, q.qmin,
                                     q.qmax, symmetric=q.recipe.symmetric, pot=ctx.pot)
        assert torch.equal(lo0, expect[0]) and torch.equal(hi0, expect[1])
        q._observed = None  # observe the same weight again, now as a training forward
        with torch.enable_grad():
            q(w)
        assert bool(q.observer.carrying)
        lo1, hi1 = q.observer.range()
        s1, z1, _ = q.qparams(w)
        assert torch.equal(lo1, lo0) and torch.equal(hi1, hi0)
        assert torch.equal(s1, s0) and torch.equal(z1, z0)
    assert calls == []


def test_carry_follows_the_weight_scale():
    # the carried range is ratio x the *current* min/max: scaling the weight scales it
    x, y = _data()
    model = mlp(seed=0, sizes=(64, 48, 32, 10))
    handle = apply(model, _spec())
    _train(model, x, y, steps=1)
    q, w = handle.layers["net.3"].wq, handle.layers["net.3"].master("weight")
    ratio = q.observer.clip_ratio.clone()
    with torch.no_grad():
        w.mul_(3.0)
    model(x[:4])
    amax = w.detach().abs().amax(1)
    assert torch.equal(q.observer.clip_ratio, ratio)
    assert torch.equal(q.qparams(w)[0], amax * ratio / q.qmax)


def test_research_on_request(monkeypatch):
    x, y = _data()
    model = mlp(seed=0, sizes=(64, 48, 32, 10))
    handle = apply(model, _spec())
    calibrate(model, [x[:32]])
    _train(model, x, y, steps=4, lr=5e-2)
    calls = _count_searches(monkeypatch)
    assert qdsl.qat.research_ranges(model, ["net.3"]) == 1 and len(calls) == 1
    assert qdsl.qat.research_ranges(model) == 3 and len(calls) == 4
    for patch in handle.layers.values():
        q, w = patch.wq, patch.master("weight")
        expect = _SEARCH(w.detach(), q.qmin, q.qmax, symmetric=True, axis=0)
        assert torch.equal(q.observer.clip_ratio, expect) and bool(q.observer.carrying)
        # module.weight is quantized with the new range
        s, z, _ = q.qparams(w)
        assert torch.equal(patch.module.weight, F.fake_quant_affine(w.detach(), s, z, q.qmin, q.qmax, axis=0))
    _train(model, x, y, steps=2)
    assert len(calls) == 4  # and it is carried again afterwards
    with pytest.raises(QdslError, match="nope"):
        qdsl.qat.research_ranges(model, ["nope"])


def test_search_every_spec_setting_wins_over_prepare_qat(monkeypatch):
    x, y = _data(n=128)
    model = mlp(seed=0, sizes=(64, 48, 32, 10))
    handle = apply(model, _spec(", observer=mse(search_every=2)"))
    other = mlp(seed=0, sizes=(64, 48, 32, 10))
    other_handle = apply(other, _spec())
    qdsl.qat.prepare_qat(model, weight_search_every=5)
    qdsl.qat.prepare_qat(other, weight_search_every=5)
    assert handle.layers["net.1"].wq.observer.search_every == 2
    assert other_handle.layers["net.1"].wq.observer.search_every == 5
    calls = _count_searches(monkeypatch)
    _train(model, x, y, steps=5)
    # forward 0 sees the unchanged weights (not observed); forwards 1-4 observe: 2nd and 4th search
    assert len(calls) == 3 * 2


def test_explicit_observers_are_not_replaced():
    model = mlp(seed=0, sizes=(64, 48, 32, 10))
    handle = apply(model, _spec(", observer=minmax"))
    assert type(handle.layers["net.1"].wq.observer) is O.MinMaxObserver
    eight = mlp(seed=0, sizes=(64, 48, 32, 10))
    h8 = apply(eight, parse_text(W4.format(extra="").replace("bits=4", "bits=8"), "w8.qspec"))
    assert type(h8.layers["net.1"].wq.observer) is O.MinMaxObserver  # auto at 8 bits: min/max


def test_state_dict_round_trips_carried_ratios(monkeypatch):
    x, y = _data()
    model = mlp(seed=0, sizes=(64, 48, 32, 10))
    handle = apply(model, _spec())
    calibrate(model, [x[:32]])
    _train(model, x, y, steps=3, lr=5e-2)
    sd = copy.deepcopy(model.state_dict())
    keys = [k for k in sd if k.endswith("clip_ratio")]
    assert len(keys) == 3 and all(sd[k].numel() > 0 for k in keys)

    fresh = mlp(seed=5, sizes=(64, 48, 32, 10))  # other weights: its own search at apply
    fresh_handle = apply(fresh, _spec())
    fresh.load_state_dict(sd)
    for fqn, patch in fresh_handle.layers.items():
        obs, ref = patch.wq.observer, handle.layers[fqn].wq.observer
        assert torch.equal(obs.clip_ratio, ref.clip_ratio) and bool(obs.carrying)
        assert int(obs.since_search) == int(ref.since_search)
    calls = _count_searches(monkeypatch)
    model.train()
    fresh.train()
    assert torch.equal(fresh(x[:8]), model(x[:8]))  # resumes with the carried ratios
    assert calls == []


def test_checkpoint_without_carried_state_still_loads():
    # a state dict saved before ratios were carried has no clip_ratio/carrying keys
    x, _ = _data()
    model = mlp(seed=0, sizes=(64, 48, 32, 10))
    apply(model, _spec())
    calibrate(model, [x[:32]])
    old = {k: v for k, v in model.state_dict().items()
           if not k.endswith(("clip_ratio", "carrying", "since_search"))}
    fresh = mlp(seed=0, sizes=(64, 48, 32, 10))
    apply(fresh, _spec())
    fresh.load_state_dict(old)  # strict: no missing keys
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))

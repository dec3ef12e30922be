"""TensorQuantizer: frozen numerics equal torch's kernels exactly; each kind hand-checked;
state round-trips; lifecycle of stateless / static / dynamic / learned quantizers."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from qdsl.quantizers import TensorQuantizer, functional as F
from qdsl.resolve.plan import QuantizerRecipe
from qdsl.spec.diagnostics import QdslError
from qdsl.spec.model import Granularity, GranularityKind, Kind, ObserverSpec, Role

CH0 = Granularity(GranularityKind.CHANNEL, 0)


def recipe(kind=Kind.INT, bits=8, signed=True, narrow=False, symmetric=True, scale="float",
           gran=Granularity(), observer="minmax", params=(), rounding="half_even", dynamic=False):
    return QuantizerRecipe(kind, bits, signed, narrow, symmetric, scale, gran,
                           ObserverSpec(observer, params), rounding, dynamic)


@st.composite
def int_cases(draw):
    bits = draw(st.integers(2, 8))
    signed, narrow, symmetric = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    per_channel = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(5, 3, 3, generator=g) * draw(st.floats(0.01, 10.0))
    return recipe(bits=bits, signed=signed, narrow=narrow, symmetric=symmetric,
                  gran=CH0 if per_channel else Granularity()), w, torch.randn(5, 3, 3, generator=g) * 3


@given(int_cases())
def test_frozen_proxy_equals_torch_fake_quantize(case):
    r, w, x = case
    q = TensorQuantizer(r, Role.WEIGHT)
    q.freeze(w)
    assert q.scale.dtype == torch.float32 and q.zero_point.dtype == torch.int32
    assert ((q.zero_point >= q.qmin) & (q.zero_point <= q.qmax)).all()
    if q.axis is None:
        ref = torch.fake_quantize_per_tensor_affine(x, float(q.scale), int(q.zero_point), q.qmin, q.qmax)
    else:
        ref = torch.fake_quantize_per_channel_affine(x, q.scale, q.zero_point, 0, q.qmin, q.qmax)
    with torch.no_grad():
        assert torch.equal(q(x), ref)  # the frozen fast path
    assert torch.equal(q(x.clone().requires_grad_()).detach(), ref)  # the autograd path
    assert torch.equal(F.dequantize_affine(q.int_repr(x), q.scale, q.zero_point, q.axis), ref)


def test_stateless_weight_tracks_the_weight_until_frozen():
    q = TensorQuantizer(recipe(gran=CH0), Role.WEIGHT)
    w = torch.randn(4, 6)
    y1 = q(w)
    y2 = q(w * 2)
    assert torch.allclose(y2, 2 * y1)
    q.freeze(w)
    s = q.scale.clone()
    q(w * 2)
    assert torch.equal(q.scale, s)


def test_static_activation_passes_through_until_observed():
    q = TensorQuantizer(recipe(signed=False, symmetric=False, observer="ema", params={"momentum": 0.5}), Role.INPUT)
    x = torch.randn(8, 3)
    assert q(x) is x and not q.calibrated
    q.observing = True
    assert q(x) is x
    q.observing = False
    assert q.calibrated and not torch.equal(q(x), x)
    with pytest.raises(QdslError, match="already frozen"):
        q.freeze()
        q.freeze()


def test_uncalibrated_freeze_and_int_repr_are_errors():
    q = TensorQuantizer(recipe(), Role.OUTPUT, name="fc:output")
    with pytest.raises(QdslError, match="fc:output never observed"):
        q.freeze()
    with pytest.raises(QdslError, match="fc:output has no scale"):
        q.int_repr(torch.randn(3))


def test_dynamic_scale_follows_each_batch():
    q = TensorQuantizer(recipe(dynamic=True), Role.INPUT)
    q.freeze()  # dynamic quantizers stay dynamic
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    y_small, s_small = q(x), q.current_scale()
    y_big, s_big = q(10 * x), q.current_scale()
    assert torch.allclose(s_big, 10 * s_small)
    # the same codes up to a rare rounding flip at a tie: within one step of the big grid
    assert (y_big - 10 * y_small).abs().max() <= s_big * 1.001


def test_pot_scale_and_pot_ceil():
    w = torch.randn(6, 5)
    for rule, check in (("pot", lambda s, raw: (s / raw).max() <= 2**0.5 + 1e-6),
                        ("pot_ceil", lambda s, raw: (s >= raw).all())):
        q = TensorQuantizer(recipe(scale=rule, gran=CH0), Role.WEIGHT)
        q.freeze(w)
        log2 = torch.log2(q.scale)
        assert torch.equal(log2, log2.round())
        raw = w.abs().amax(dim=1) / 127
        assert check(q.scale, raw)


def test_binary_ternary_pot_weights_hand_checked():
    w = torch.tensor([[0.5, -1.5, 0.0, 1.0], [-2.0, -2.0, 4.0, 0.0]])
    b = TensorQuantizer(recipe(kind=Kind.BINARY, bits=1, gran=CH0, observer="mean_abs"), Role.WEIGHT)
    assert b(w).tolist() == [[0.75, -0.75, 0.75, 0.75], [-2.0, -2.0, 2.0, 2.0]]
    assert b.int_repr(w).tolist() == [[1, -1, 1, 1], [-1, -1, 1, 1]]
    t = TensorQuantizer(recipe(kind=Kind.TERNARY, bits=2, gran=CH0, observer="mean_abs"), Role.WEIGHT)
    t.freeze(w)
    assert torch.allclose(t.threshold, torch.tensor([0.525, 1.4]))
    assert torch.allclose(t(w), torch.tensor([[0, -1.25, 0, 1.25], [-8 / 3, -8 / 3, 8 / 3, 0]]))
    p = TensorQuantizer(recipe(kind=Kind.POT, bits=3, gran=CH0), Role.WEIGHT)  # scale = max|w|
    # row 0: s = 1.5, levels 1.5, 0.75, 0.375; row 1: s = 4, levels 4, 2, 1
    assert p(w).tolist() == [[0.375, -1.5, 0.0, 0.75], [-2.0, -2.0, 4.0, 0.0]]
    assert p.int_repr(w).tolist() == [[1, -3, 0, 2], [-2, -2, 3, 0]]


def test_group_granularity():
    w = torch.randn(4, 2, 3, 3)
    q = TensorQuantizer(recipe(bits=4, gran=Granularity(GranularityKind.GROUP, None, 6)), Role.WEIGHT)
    q.freeze(w)
    assert tuple(q.scale.shape) == (4, 3)
    rows = w.reshape(4, 3, 6)
    assert torch.allclose(q.scale, rows.abs().amax(dim=2) / 7)
    assert torch.equal(q(w), F.fake_quant_affine(w, q.scale, q.zero_point, -8, 7, group_size=6))


def test_other_roundings_and_generator():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5]) * 0.1
    for mode, expect in (("half_away", [1, 2, 3, -1]), ("floor", [0, 1, 2, -1])):
        q = TensorQuantizer(recipe(rounding=mode), Role.WEIGHT)
        q.freeze(torch.tensor([12.7]))  # scale 0.1
        assert q.int_repr(x).tolist() == expect and not q._fast_ok
    q = TensorQuantizer(recipe(rounding="stochastic"), Role.WEIGHT)
    q.generator = torch.Generator().manual_seed(0)
    q.freeze(torch.tensor([12.7]))
    r = q.int_repr(torch.full((4000,), 0.025))
    assert set(r.unique().tolist()) == {0, 1} and abs(r.float().mean().item() - 0.25) < 0.05


def test_state_dict_round_trip_of_lazy_buffers():
    src = TensorQuantizer(recipe(signed=False, observer="histogram", params={"bins": 64}), Role.INPUT)
    src.observing = True
    src(torch.rand(100))
    src(torch.rand(100) * 2)
    src.observing = False
    sd = src.state_dict()
    dst = TensorQuantizer(recipe(signed=False, observer="histogram", params={"bins": 64}), Role.INPUT)
    dst.load_state_dict(sd)
    x = torch.rand(50) * 2
    assert torch.equal(dst(x), src(x))
    src.freeze()
    dst2 = TensorQuantizer(recipe(signed=False, observer="histogram", params={"bins": 64}), Role.INPUT)
    dst2.load_state_dict(src.state_dict())
    assert dst2.frozen and dst2._fast_ok
    with torch.no_grad():
        assert torch.equal(dst2(x), src(x))


@pytest.mark.parametrize("observer,params", [("minmax", ()), ("ema", {"momentum": 0.1}), ("mse", {"grid": 20}),
                                             ("percentile", {"percentile": 99.0, "bins": 128}),
                                             ("histogram", {"bins": 128})])
def test_every_observer_gives_a_usable_scale(observer, params):
    g = torch.Generator().manual_seed(0)
    for role in (Role.WEIGHT, Role.INPUT):
        q = TensorQuantizer(recipe(symmetric=False, observer=observer, params=params,
                                   gran=CH0 if role is Role.WEIGHT else Granularity()), role)
        x = torch.randn(4, 50, generator=g)
        if role is Role.INPUT:
            q.observing = True
            q(x)
            q(x * 1.5)
            q.observing = False
            q.freeze()
        else:
            q.freeze(x)
        assert (q.scale > 0).all() and torch.isfinite(q.scale).all()
        err = (q(x) - x).abs().mean() / x.abs().mean()
        assert err < 0.1, (observer, role, err)


def test_learned_scale_is_initialised_from_the_observer():
    w = torch.randn(3, 8)
    q = TensorQuantizer(recipe(scale="learned", gran=CH0), Role.WEIGHT)
    params = [p for p in q.parameters()]
    assert len(params) == 1
    q(w)
    assert torch.allclose(params[0].detach().reshape(-1), w.abs().amax(1) / 127, rtol=1e-6)
    q.freeze(w)
    assert torch.allclose(q.scale.reshape(-1), w.abs().amax(1) / 127, rtol=1e-6)


def test_unknown_part_names_are_clear_errors():
    with pytest.raises(QdslError, match="unknown observer 'minmaxx'.*did you mean 'minmax'"):
        TensorQuantizer(recipe(observer="minmaxx"), Role.INPUT)
    with pytest.raises(QdslError, match="unknown rounding 'nearest'.*half_even"):
        TensorQuantizer(recipe(rounding="nearest"), Role.INPUT)


def test_fast_path_threads_setting_is_restored_and_value_neutral():
    q = TensorQuantizer(recipe(signed=False, symmetric=False), Role.WEIGHT)
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(0))
    q.freeze(x)
    torch.set_num_threads(2)  # the autouse fixture restores the original count
    with torch.no_grad():
        y1 = q(x)
        assert torch.get_num_threads() == 2
        old = TensorQuantizer.fast_path_threads
        TensorQuantizer.fast_path_threads = None
        try:
            y2 = q(x)
        finally:
            TensorQuantizer.fast_path_threads = old
    assert torch.equal(y1, y2)
    assert torch.equal(y1, F.fake_quant_affine(x, q.scale, q.zero_point, q.qmin, q.qmax))


def test_unchanged_weight_is_not_searched_twice_but_a_modified_one_is(monkeypatch):
    import qdsl
    from qdsl.quantizers import range_search
    from qdsl.zoo.models import mlp

    model = mlp()
    calls = []
    search = range_search.mse_clip_ratio
    monkeypatch.setattr(range_search, "mse_clip_ratio", lambda *a, **k: calls.append(1) or search(*a, **k))
    qdsl.apply(model, "specs/w4a8-per-channel.qspec")  # mse weight search, no BN to fold
    qdsl.calibrate(model, [torch.rand(8, 1, 8, 8)], progress=False)
    qdsl.freeze(model)
    n = len(calls)
    assert n == 3  # one search per Linear weight across apply, calibrate and freeze
    with torch.no_grad():
        model(torch.rand(2, 1, 8, 8))
    assert len(calls) == n  # frozen: scales fixed


def test_unfrozen_weight_is_searched_again_after_an_in_place_change(monkeypatch):
    import qdsl
    from qdsl.quantizers import range_search
    from qdsl.zoo.models import mlp

    model = mlp()
    calls = []
    search = range_search.mse_clip_ratio
    monkeypatch.setattr(range_search, "mse_clip_ratio", lambda *a, **k: calls.append(1) or search(*a, **k))
    handle = qdsl.apply(model, "specs/w4a8-per-channel.qspec")
    n = len(calls)
    with torch.no_grad():
        model(torch.rand(2, 1, 8, 8))
    assert len(calls) == n  # same tensors, same versions: cached
    with torch.no_grad():
        handle.layers["net.1"].master("weight").mul_(1.5)  # in-place change bumps _version
        model(torch.rand(2, 1, 8, 8))
    assert len(calls) == n + 1

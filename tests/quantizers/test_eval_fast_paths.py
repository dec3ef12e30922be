"""Evaluation fast paths (issue 23, eval before freeze): a dynamic activation's batch range
in one ``aminmax`` pass (qdsl.quantizers.eval_fast.dynamic_views) and binary values as a
float mask times α (qdsl.quantizers.functional ``fake_quant_binary``).  Both must give the
values of the general path: the same codes, the same floats."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from qdsl.quantizers import TensorQuantizer, functional as F
from qdsl.resolve.plan import QuantizerRecipe
from qdsl.spec.model import Granularity, GranularityKind, Kind, ObserverSpec, Role

CH1 = Granularity(GranularityKind.CHANNEL, 1)
SPECIAL = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 0.5, -0.5, 2.5, -2.5]


def _dynamic(bits=8, signed=False, symmetric=False, gran=Granularity(), observer="minmax", scale="float"):
    r = QuantizerRecipe(Kind.INT, bits, signed, False, symmetric, scale, gran, ObserverSpec(observer, ()),
                        "half_even", True)
    return TensorQuantizer(r, Role.INPUT)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@st.composite
def batches(draw):
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(3, 4, 5, generator=g) * draw(st.floats(1e-3, 1e3))
    if draw(st.booleans()):  # values on exact rounding ties of the batch's own grid
        x = torch.round(x * 4) / 4
    if draw(st.booleans()):
        flat = x.view(-1)
        for i in draw(st.lists(st.integers(0, flat.numel() - 1), max_size=4)):
            flat[i] = draw(st.sampled_from(SPECIAL))
    return x


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from([(8, False, False), (8, True, True), (4, True, False), (3, False, True)]),
       st.booleans(), st.sampled_from(["float", "pot"]), st.sampled_from(["minmax", "ema"]))
def test_dynamic_eval_equals_the_observed_path(x, grid, per_channel, scale, observer):
    bits, signed, symmetric = grid
    q = _dynamic(bits, signed, symmetric, CH1 if per_channel else Granularity(), observer, scale)
    with torch.no_grad():
        fast = q(x)
        codes = q.int_repr(x)  # observes the batch: the general path's parameters
    slow = q(x.clone().requires_grad_()).detach()  # autograd: observe, then fake-quantize
    assert torch.equal(fast, slow)
    assert torch.equal(_bits(fast.abs()), _bits(slow.abs()))  # every bit but a zero's sign
    # and what the codes decode to (QUANTIZE_DYNAMIC's rule: this batch's min/max)
    s, z, _ = q.qparams(x)
    assert torch.equal(fast, F.dequantize_affine(codes, s, z, q.axis))
    assert torch.equal(q.current_scale(), s)


def test_dynamic_eval_leaves_the_observer_alone():
    # the fast path takes the range itself: no reset, no re-observation per batch (before
    # the change every evaluation batch replaced the observer's buffers, which also made
    # the layer's cached fake-quantized weights look stale)
    q = _dynamic()
    q(torch.randn(4, 8).requires_grad_())  # a training forward observes
    before = [t for t in q.observer.buffers()]
    with torch.no_grad():
        q(torch.randn(4, 8) * 3)
    assert all(a is b for a, b in zip(before, q.observer.buffers()))


def test_dynamic_eval_with_a_nan_takes_the_general_path():
    q = _dynamic()
    x = torch.tensor([[0.5, float("nan"), -1.0, 3.0]])
    with torch.no_grad():
        y = q(x)
    assert y[0, 1] == 0  # NaN -> the zero point's code, as the general path
    assert torch.equal(y, q(x.clone().requires_grad_()).detach())


@st.composite
def binary_cases(draw):
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(4, 3, 5, generator=g)
    flat = x.view(-1)
    for i in draw(st.lists(st.integers(0, flat.numel() - 1), max_size=6)):
        flat[i] = draw(st.sampled_from(SPECIAL))
    axis = draw(st.sampled_from([None, 0, 2]))
    alpha = torch.rand(() if axis is None else (x.shape[axis],), generator=g) + 0.1
    special = draw(st.sampled_from([None, 0.0, float("inf"), float("nan"), -0.7, 3e38, 1e-45]))
    if special is not None:
        alpha = alpha.clone().fill_(special) if axis is None else alpha.index_fill(0, torch.tensor([0]), special)
    return x, alpha, axis


def _where_reference(x, a, signed):
    return torch.where(x < 0, -a, a) if signed else torch.where(x >= a * 0.5, a, torch.zeros_like(a))


@settings(max_examples=80, deadline=None)
@given(binary_cases(), st.booleans())
def test_binary_values_equal_the_where_definition_bit_for_bit(case, signed):
    x, alpha, axis = case
    got = F.fake_quant_binary(x, alpha, signed, axis)
    want = _where_reference(x, F.param_view(alpha, x, axis), signed)
    assert got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))  # signs of zeros and NaN payloads included


def test_binary_values_need_no_where(monkeypatch):
    # the common case (finite non-zero α) computes the values as a float mask times α
    # (torch.where with a broadcast α is ~3x slower on CPU); fails where the old code ran
    x = torch.randn(2, 3, 4, 4)
    want = _where_reference(x, torch.tensor(0.7), True)

    def no_where(*args, **kwargs):
        raise AssertionError("torch.where called")

    monkeypatch.setattr(torch, "where", no_where)
    assert torch.equal(F.fake_quant_binary(x, torch.tensor(0.7)), want)
    assert F.fake_quant_binary(x, torch.tensor([0.5, 1.0, 2.0]), False, axis=1).shape == x.shape


def test_thresholded_binary_values_need_no_where(monkeypatch):
    # a learned threshold (the bundled xnor spec's) takes the same mask path: -α below
    # t[c], +α at and above it and for NaN; fails while the thresholded fake used where
    x = torch.randn(2, 3, 4, 4)
    t = torch.nn.Parameter(torch.tensor([-0.5, 0.0, 0.25]))
    x[0, :, 0, 0] = t.detach()  # ties -> +α
    x[1, 0, 1, 1] = float("nan")
    tv = t.view(1, 3, 1, 1)
    a = torch.tensor(0.7)
    want = torch.where(x < tv, -a, a)
    monkeypatch.setattr(torch, "where", lambda *args, **kw: (_ for _ in ()).throw(AssertionError("where")))
    with torch.no_grad():
        got = F.fake_quant_binary(x, a, True, threshold=tv)
    assert torch.equal(_bits(got), _bits(want))


def test_binary_gradient_to_alpha_is_where_s():
    x = torch.randn(3, 5)
    a1 = torch.tensor(0.8, requires_grad=True)
    a2 = torch.tensor(0.8, requires_grad=True)
    F.fake_quant_binary(x, a1).sum().backward()
    _where_reference(x, a2, True).sum().backward()
    assert torch.equal(a1.grad, a2.grad)


@pytest.mark.parametrize("signed", [True, False])
def test_binary_activation_proxy_no_grad_equals_grad_path(signed):
    r = QuantizerRecipe(Kind.BINARY, 1, signed, False, True, "float", Granularity(), ObserverSpec("mean_abs", ()),
                        "half_even", False)
    q = TensorQuantizer(r, Role.INPUT)
    q.observing = True
    q(torch.randn(8, 16))
    q.observing = False
    x = torch.randn(8, 16)
    x[0, :3] = torch.tensor([0.0, -0.0, float("nan")])
    with torch.no_grad():
        fast = q(x)
    assert torch.equal(_bits(fast), _bits(q(x.clone().requires_grad_()).detach()))


FP8 = [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]


def _fp8_grid(dtype):
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    return grid[torch.isfinite(grid)].sort().values


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(FP8), st.integers(0, 2**31 - 1), st.integers(-40, 40))
def test_fp8_cast_rounding_equals_the_minifloat_definition(fmt_dtype, seed, shift):
    from qdsl.quantizers.formats.minifloat import _cast_round, minifloat_round
    from qdsl.spec.formats import MINIFLOAT_PRESETS

    name, dtype = fmt_dtype
    fmt = MINIFLOAT_PRESETS[name]
    g = torch.Generator().manual_seed(seed)
    grid = _fp8_grid(dtype)
    mids = (grid[1:] + grid[:-1]) / 2  # every tie, subnormal ones included
    y = torch.cat([torch.randn(4096, generator=g) * 2.0 ** shift, grid, mids, -mids,
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45,
                                 fmt.max_normal * 1.03, -fmt.max_normal * 1.1])])
    want = minifloat_round(y, fmt)
    got = _cast_round(y, fmt, dtype)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.isnan(_cast_round(torch.tensor([float("nan")]), fmt, dtype)).all()


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_activation_in_eval_casts(monkeypatch, name):
    # an fp8 activation (specs/mxfp4's inputs) rounds through torch's float8 cast in
    # evaluation; before, the frexp/ldexp grid rounding cost ~8x as much (fails there)
    from qdsl.quantizers.formats import minifloat as M
    from qdsl.spec.formats import MINIFLOAT_PRESETS

    fmt = MINIFLOAT_PRESETS[name]
    r = QuantizerRecipe(name, fmt.bits, True, False, True, "float", Granularity(), ObserverSpec("minmax"),
                        "half_even", False, format=fmt)
    q = TensorQuantizer(r, Role.INPUT)
    q.observing = True
    q(torch.randn(64) * 10)
    q.observing = False
    x = torch.randn(4, 8, 5) * 20
    want = q(x.clone().requires_grad_()).detach()

    def no_round(*args, **kwargs):
        raise AssertionError("minifloat_round called")

    monkeypatch.setattr(M, "minifloat_round", no_round)
    with torch.no_grad():
        got = q(x)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))

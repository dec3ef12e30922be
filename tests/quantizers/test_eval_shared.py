"""Evaluation fast paths added for the transformer encoders (issue 23): the dynamic
per-tensor scale in scalar binary32 arithmetic (qdsl.quantizers.eval_fast.dynamic_int_params)
and one fake-quantized result shared by the input quantizers of one tensor
(qdsl.quantizers.eval_fast.SharedInputs).  Each must equal the general path bit for bit and
stop applying when the state it depends on changes."""

import gc

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from torch import nn

import qdsl
from qdsl.quantizers import TensorQuantizer
from qdsl.quantizers import eval_fast as EF
from qdsl.quantizers import functional as F
from qdsl.quantizers import native_fq as NFQ
from qdsl.resolve.plan import QuantizerRecipe
from qdsl.spec.model import Granularity, Kind, ObserverSpec, Role

GRIDS = [(8, False, False), (8, True, True), (8, False, True), (4, True, False), (3, False, True), (16, True, False)]


def _recipe(bits=8, signed=False, symmetric=False, dynamic=True, observer="minmax"):
    return QuantizerRecipe(Kind.INT, bits, signed, False, symmetric, "float", Granularity(),
                           ObserverSpec(observer, ()), "half_even", dynamic)


def _q(role=Role.INPUT, **kw) -> TensorQuantizer:
    return TensorQuantizer(_recipe(**kw), role)


def _f32(draw_value: float) -> float:
    return float(np.float32(draw_value))


finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=300, deadline=None)
@given(finite32, finite32, st.sampled_from(GRIDS))
def test_scalar_qparams_equal_the_tensor_formula(a, b, grid):
    bits, signed, symmetric = grid
    q = _q(bits=bits, signed=signed, symmetric=symmetric)
    lo, hi = min(a, b), max(a, b)
    got = EF.dynamic_int_params(lo, hi, q.qmin, q.qmax, symmetric)
    if got is None:  # left to the tensor path
        assert max(hi, 0.0) - min(lo, 0.0) >= EF._WIDE
        return
    want_s, want_z, _ = q._ops.qparams(q, None, torch.tensor(lo), torch.tensor(hi), q.scale_rule)
    s, z = got
    assert np.float32(s).view(np.int32) == np.float32(float(want_s)).view(np.int32)
    assert z == int(want_z)
    assert np.float32(EF.reciprocal(s)) == np.float32(float(F.reciprocal(want_s)))


@pytest.mark.parametrize("lo,hi", [(0.0, 0.0), (-0.0, 0.0), (-1e-45, 1e-45), (-1.4e38, 1.4e38), (2.0, 5.0),
                                   (-5.0, -2.0), (-0.5, 127.5), (-1.0, 2.0)])
@pytest.mark.parametrize("grid", GRIDS)
def test_scalar_qparams_edge_ranges(lo, hi, grid):
    bits, signed, symmetric = grid
    q = _q(bits=bits, signed=signed, symmetric=symmetric)
    want_s, want_z, _ = q._ops.qparams(q, None, torch.tensor(lo), torch.tensor(hi), q.scale_rule)
    s, z = EF.dynamic_int_params(_f32(lo), _f32(hi), q.qmin, q.qmax, symmetric)
    assert np.float32(s).view(np.int32) == np.float32(float(want_s)).view(np.int32)
    assert z == int(want_z)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("seed", range(4))
def test_scalar_dynamic_path_is_taken_and_equals_the_observed_path(monkeypatch, grid, seed):
    bits, signed, symmetric = grid
    q = _q(bits=bits, signed=signed, symmetric=symmetric)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 33, 17, generator=g) * 10 ** (seed - 1) + seed
    x = torch.where(torch.rand(x.shape, generator=g) < 0.2, torch.round(x * 8) / 8, x)  # ties
    monkeypatch.setattr(EF, "dynamic_views", lambda *a: pytest.fail("tensor-op path taken"))
    with torch.no_grad():
        fast = q(x)
        scale = q.current_scale()
    slow = q(x.clone().requires_grad_()).detach()  # autograd: observe, then fake-quantize
    assert torch.equal(fast, slow)
    assert torch.equal(fast.abs().view(torch.int32), slow.abs().view(torch.int32))
    assert torch.equal(scale, q.current_scale()) and scale.dtype == torch.float32 and scale.dim() == 0


def test_scalar_dynamic_path_leaves_a_nan_batch_to_the_general_path():
    q = _q()
    x = torch.tensor([[0.5, float("nan"), -1.0, float("inf")]])
    with torch.no_grad():
        y = q(x)
    assert torch.equal(y, q(x.clone().requires_grad_()).detach())


# ------------------------------------------------------------------------ sharing
def _count_fast(monkeypatch) -> list:
    calls = []
    orig = EF.fast

    def counted(q, x, v=None, finite=False):
        calls.append(q)
        return orig(q, x, v, finite)
    monkeypatch.setattr(EF, "fast", counted)
    return calls


def _unshared(monkeypatch):
    monkeypatch.setattr(EF.SHARED, "get", lambda x, fp: None)


@pytest.mark.parametrize("dynamic", [True, False])
def test_readers_of_one_tensor_share_one_result(monkeypatch, dynamic):
    EF.SHARED.clear()
    qs = [_q(dynamic=dynamic) for _ in range(3)]
    x = torch.randn(8, 16, 32)
    if not dynamic:
        for q in qs:  # calibrated alike (as BERT's query/key/value inputs: the same tensors)
            q.observing = True
            q(x * 1.5)
            q.observing = False
    calls = _count_fast(monkeypatch)
    with torch.no_grad():
        outs = [q(x) for q in qs]
    assert len(calls) == 1
    assert all(o is outs[0] for o in outs)
    monkeypatch.undo()
    _unshared(monkeypatch)
    with torch.no_grad():
        alone = [q(x) for q in qs]
    for a, o in zip(alone, outs):
        assert a is not o and torch.equal(a, o)
    assert all(torch.equal(q.current_scale(), qs[0].current_scale()) for q in qs)


def test_different_parameters_are_not_shared():
    EF.SHARED.clear()
    a, b = _q(dynamic=False), _q(dynamic=False)
    for q, k in ((a, 1.0), (b, 2.0)):
        q.observing = True
        q(torch.linspace(-k, k, 50))
        q.observing = False
    x = torch.randn(64)
    with torch.no_grad():
        ya, yb = a(x), b(x)
    assert ya is not yb and not torch.equal(ya, yb)
    c = _q(bits=4)  # dynamic, another grid
    d = _q()
    with torch.no_grad():
        assert not torch.equal(c(x), d(x))


def test_output_quantizers_do_not_share():
    EF.SHARED.clear()
    a, b = _q(role=Role.OUTPUT), _q(role=Role.OUTPUT)
    x = torch.randn(32)
    with torch.no_grad():
        assert a(x) is not b(x)


def test_in_place_edit_of_the_input_ends_sharing():
    EF.SHARED.clear()
    a, b = _q(), _q()
    x = torch.randn(256)
    with torch.no_grad():
        ya = a(x)
        x.mul_(3.0)
        yb = b(x)
    assert yb is not ya
    assert torch.equal(yb, b(x.clone().requires_grad_()).detach())


def test_in_place_edit_of_the_result_ends_sharing():
    # a reader that writes into the tensor it got (an inplace ReLU after the quantizer)
    EF.SHARED.clear()
    a, b = _q(), _q()
    x = torch.randn(256)
    with torch.no_grad():
        a(x).relu_()
        yb = b(x)
    assert bool((yb < 0).any())  # not the edited tensor
    assert torch.equal(yb, b(x.clone().requires_grad_()).detach())


def test_a_freed_input_leaves_nothing_behind():
    EF.SHARED.clear()
    q = _q()
    with torch.no_grad():
        q(torch.randn(128))
    gc.collect()
    assert len(EF.SHARED._entries()) == 0
    # a new tensor (possibly at the same address) is computed afresh
    x = torch.zeros(128)
    with torch.no_grad():
        assert torch.equal(q(x), torch.zeros(128))


def test_sharing_is_bounded():
    EF.SHARED.clear()
    q = _q()
    xs = [torch.randn(64) for _ in range(10)]
    with torch.no_grad():
        for x in xs:
            q(x)
    assert len(EF.SHARED._entries()) <= EF.SHARED.size


class _QKV(nn.Module):
    """BERT's pattern: three Linears reading one tensor, then an in-place consumer."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(24, 24), nn.Linear(24, 24), nn.Linear(24, 24)
        self.out = nn.Linear(24, 8)

    def forward(self, x):
        return self.out(torch.relu_(self.query(x) * self.key(x) + self.value(x)))


@pytest.mark.parametrize("spec", ["int8-dynamic.qspec", "transformer-w8.qspec", "transformer-int8.qspec"])
def test_model_with_shared_inputs_equals_unshared_and_follows_training(monkeypatch, spec):
    from pathlib import Path

    torch.manual_seed(0)
    model = _QKV()
    x = torch.randn(6, 10, 24)
    qdsl.apply(model, str(Path(__file__).resolve().parents[2] / "specs" / spec))
    qdsl.calibrate(model, [x], progress=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model.train()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        model.eval()
        calls = _count_fast(monkeypatch)
        with torch.no_grad():
            shared = model(x)
        n_shared = len(calls)
        monkeypatch.undo()
        _unshared(monkeypatch)
        calls = _count_fast(monkeypatch)
        with torch.no_grad():
            alone = model(x)
        monkeypatch.undo()
        assert torch.equal(shared, alone)
        assert n_shared <= len(calls) - 2  # key and value took query's input


# ------------------------------------------------------------- static NaN check
@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf"), -0.0])
def test_static_fast_path_nan_check_equals_the_general_path(monkeypatch, special):
    # the static/frozen fast path finds a NaN by summing the clamped codes (no nan_to_num
    # pass unless one is there): a NaN must still become 0, infinities the clamp bounds.
    # Those are the torch passes: the native one-pass kernel (test_native_fq.py) is off here.
    monkeypatch.setattr(NFQ, "_switch", False)  # (QDSL_NATIVE_FQ=0 is read at import)
    q = _q(dynamic=False)
    q.observing = True
    q(torch.linspace(-2, 3, 40))
    q.observing = False
    x = torch.randn(1000) * 4
    x[[3, 500, 999]] = special
    nan_passes = []
    orig = torch.Tensor.nan_to_num_
    monkeypatch.setattr(torch.Tensor, "nan_to_num_", lambda t, *a, **k: nan_passes.append(1) or orig(t, *a, **k))
    with torch.no_grad():
        fast = q(x)
    monkeypatch.undo()
    assert len(nan_passes) == (1 if special != special else 0)
    slow = q(x.clone().requires_grad_()).detach()
    assert torch.equal(fast, slow) and not torch.isnan(fast).any()
    q.freeze()
    with torch.no_grad():
        assert torch.equal(q(x), slow)


# ---------------------------------------------------------------- fp8 in place
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_eval_decodes_in_place_with_the_same_values(name, per_channel):
    from qdsl.quantizers.formats.minifloat import minifloat_round
    from qdsl.spec.formats import MINIFLOAT_PRESETS
    from qdsl.spec.model import GranularityKind

    fmt = MINIFLOAT_PRESETS[name]
    gran = Granularity(GranularityKind.CHANNEL, 1) if per_channel else Granularity()
    r = QuantizerRecipe(name, fmt.bits, True, False, True, "float", gran, ObserverSpec("minmax"),
                        "half_even", False, format=fmt)
    q = TensorQuantizer(r, Role.INPUT)
    q.observing = True
    q(torch.randn(4, 6, 5) * 10)
    q.observing = False
    x = torch.randn(4, 6, 5) * 30
    x[0, 0, :4] = torch.tensor([float("inf"), -float("inf"), -0.0, 1e-30])
    with torch.no_grad():
        got = q(x)
        s, _, _ = q.qparams(x)
    view = s.reshape(1, -1, 1) if per_channel else s
    want = minifloat_round(x / view, fmt) * view
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(got.view(torch.int32), q(x.clone().requires_grad_()).detach().view(torch.int32))


# ------------------------------------------------------- scalar qparams in Python floats
GRIDS_WIDE = GRIDS + [(24, True, False), (32, True, True), (32, False, False), (26, False, False)]


@settings(max_examples=2000, deadline=None)
@given(st.one_of(finite32, st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, 3.0e38, -3.0e38, 1e-12, 2.5e-13])),
       st.one_of(finite32, st.sampled_from([0.0, -0.0, 1e-45, 3.4e38, 1e-12, 1.0, 127.5])),
       st.sampled_from(GRIDS_WIDE))
def test_scalar_qparams_equal_numpy_float32_arithmetic(a, b, grid):
    # dynamic_int_params does each binary32 operation in binary64 and rounds once (exact for
    # + - × / of binary32 operands); the numpy float32 version is its reference, also for
    # code counts binary32 cannot hold (32-bit grids) and ranges near the limits
    bits, signed, symmetric = grid
    qmin, qmax = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)
    lo, hi = min(a, b), max(a, b)
    with np.errstate(all="ignore"):
        want = EF._dynamic_int_params_np(lo, hi, qmin, qmax, symmetric)
    got = EF.dynamic_int_params(lo, hi, qmin, qmax, symmetric)
    if want is None:
        assert got is None
        return
    assert got is not None
    assert np.float32(got[0]).view(np.int32) == np.float32(want[0]).view(np.int32)
    assert got[1] == want[1]


def test_binary32_rounding_helper_ties_to_even_and_overflows_to_inf():
    assert EF._f32(1.0 + 2.0 ** -24) == 1.0  # a tie: to the even neighbour
    assert EF._f32(1.0 + 3 * 2.0 ** -24) == 1.0 + 2.0 ** -22
    assert EF._f32(1e-46) == 0.0 and EF._f32(-0.0) == 0.0 and str(EF._f32(-0.0)) == "-0.0"
    assert EF._f32(3.5e38) == float("inf") and EF._f32(-1e300) == -float("inf")
    assert EF._f32(3.4028235e38) == float(np.float32(3.4028235e38))

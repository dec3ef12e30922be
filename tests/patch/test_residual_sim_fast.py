"""The frozen encoder simulations' cheaper forms (qdsl.patch.residual_sim: ``rescale_codes``
without the clamp copy and the distance temporaries, the per-channel rescales derived once
per frozen Linear) give the same bits as the formulas they replace, copied here as they
were: hypothesis over shapes, per-channel/per-tensor factors, the three roundings, values
outside int32, left shifts and exact ties (the reference fallback)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qdsl.graph.requant import INT32_MAX, INT32_MIN, apply_rescale, make_rescale
from qdsl.graph.schema import Rescale, RescaleKind, Rounding
from qdsl.patch.residual_sim import NEAR_TIE, rescale_codes


def _old_rescale_codes(acc: torch.Tensor, rescale: Rescale) -> torch.Tensor:
    """``rescale_codes`` before this change (the formula the fast form must equal)."""
    kind = rescale.kind
    if kind not in (RescaleKind.POT, RescaleKind.FIXED_SINGLE):
        ref = apply_rescale(acc.to(torch.int64).numpy(), rescale, axis=acc.dim() - 1)
        return torch.from_numpy(ref).double()
    m = np.asarray(rescale.multiplier, dtype=np.int64)
    sh = np.asarray(rescale.shift, dtype=np.int64)
    single = kind == RescaleKind.FIXED_SINGLE
    t = acc.clamp(INT32_MIN, INT32_MAX)
    if (sh < 0).any():
        t = (t * torch.from_numpy(np.exp2(np.maximum(-sh, 0)))).clamp(INT32_MIN, INT32_MAX)
    scale = (m if single else np.ones_like(m)) * np.exp2(-(np.maximum(sh, 0) + (31 if single else 0)))
    y = t * torch.from_numpy(scale.astype(np.float64))
    rounding = Rounding(rescale.rounding)
    out = torch.floor(y) if rounding == Rounding.FLOOR else torch.round(y)
    dist = (y - torch.round(y)).abs() if rounding == Rounding.FLOOR else ((y - out).abs() - 0.5).abs()
    tol = NEAR_TIE * (float(y.abs().max()) + 1.0) if y.numel() else 0.0
    near = dist <= tol
    if bool(near.any()):
        idx = near.nonzero(as_tuple=True)
        ch = idx[-1].numpy() if m.size > 1 else np.zeros(idx[-1].numel(), dtype=np.int64)
        sub = Rescale(kind, [int(v) for v in m[ch]], [int(v) for v in sh[ch]], rescale.rounding)
        vals = acc[idx].to(torch.int64).numpy()
        out[idx] = torch.from_numpy(apply_rescale(vals, sub, axis=0) if vals.size > 1 else
                                    apply_rescale(vals, Rescale(kind, [int(m[ch[0]])], [int(sh[ch[0]])],
                                                                rescale.rounding), axis=0)).double()
    return out.clamp(INT32_MIN, INT32_MAX)


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(0, 9), ch=st.integers(1, 12), per_channel=st.booleans(),
       rounding=st.sampled_from([Rounding.HALF_EVEN, Rounding.HALF_AWAY, Rounding.FLOOR]),
       big=st.integers(0, 40), factor_exp=st.integers(-30, 3), ties=st.booleans(), seed=st.integers(0, 2**16))
def test_rescale_codes_equals_the_old_formula(rows, ch, per_channel, rounding, big, factor_exp, ties, seed):
    rng = np.random.default_rng(seed)
    acc = rng.integers(-(2**big), 2**big + 1, size=(rows, ch)).astype(np.float64)
    if ties and acc.size:  # multiples of 2^k at factor 2^-k-1: exact halves, the reference decides
        acc = np.round(acc / 8) * 8 + 4
    n = ch if per_channel else 1
    factors = rng.uniform(0.5, 1.0, size=n) * 2.0**factor_exp
    if ties:
        factors = np.full(n, 2.0**-3)
    for single in (True, False):
        r = make_rescale(factors, rounding, single=single)
        a = torch.from_numpy(acc.copy())
        got, want = rescale_codes(a, r), _old_rescale_codes(torch.from_numpy(acc.copy()), r)
        assert torch.equal(a, torch.from_numpy(acc))  # the input is left alone
        assert torch.equal(got, want)


def test_rescale_codes_equals_the_old_formula_beyond_int32_and_with_nan():
    acc = torch.tensor([[2.0**40, -(2.0**40), 3.0], [float("nan"), 5.0, -7.0]], dtype=torch.float64)
    for factors in ([0.3], [0.25, 0.5, 3.0]):
        r = make_rescale(np.array(factors), Rounding.HALF_EVEN, single=True)
        got, want = rescale_codes(acc.clone(), r), _old_rescale_codes(acc.clone(), r)
        assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0))


def test_per_channel_rescales_are_derived_once_per_frozen_linear(monkeypatch):
    """A frozen encoder's second forward derives no per-channel rescale (before: one
    ``make_rescale`` per simulated Linear per forward, a Python loop over its channels),
    and gives the same bits as the first; a re-freeze derives them afresh."""
    import qdsl
    import qdsl.patch.residual_sim as rs
    from tests.export.attn_models import bert_int8_spec
    from tests.export.bert_models import TinyBert

    torch.manual_seed(0)
    model = TinyBert(pooler=False, softmax_module=True).eval()
    ids = torch.randint(0, 50, (8, 12))
    qdsl.apply(model, bert_int8_spec())
    qdsl.calibrate(model, [{"input_ids": ids}])
    qdsl.freeze(model)
    calls = []
    real = rs.make_rescale
    monkeypatch.setattr(rs, "make_rescale", lambda f, *a, **k: calls.append(np.size(f)) or real(f, *a, **k))
    with torch.no_grad():
        first = model(ids)
        per_channel_first = sum(n > 1 for n in calls)
        calls.clear()
        second = model(ids)
    assert per_channel_first > 0 and sum(n > 1 for n in calls) == 0
    assert torch.equal(first, second)


def _old_rounding_shift(x, s, rounding):
    """qdsl.graph.requant.rounding_shift's per-element form before this change."""
    from qdsl.graph.requant import _rounds_up

    x = np.asarray(x, dtype=np.int64)
    s = np.broadcast_to(np.asarray(s, dtype=np.int64), x.shape)
    left = np.where(s < 0, -s, 0)
    right = np.where(s > 0, s, 0)
    floor = x >> right
    rem = x - (floor << right)
    half = np.where(right > 0, np.int64(1) << np.maximum(right - 1, 0), 0)
    shifted = floor + np.where(right > 0, _rounds_up(x, floor, rem, half, rounding), False)
    return np.where(s < 0, x << left, shifted)


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 9), per=st.sampled_from(["row", "col", "elem"]),
       rounding=st.sampled_from([Rounding.HALF_EVEN, Rounding.HALF_AWAY, Rounding.FLOOR, Rounding.HALF_UP]),
       seed=st.integers(0, 2**16))
def test_rounding_shift_with_row_or_channel_shifts_equals_the_old_form(rows, cols, per, rounding, seed):
    from qdsl.graph.requant import rounding_shift

    rng = np.random.default_rng(seed)
    x = rng.integers(-(2**31), 2**31, size=(rows, cols))
    x[0, 0] = 2**30 + 2**9  # an exact half at shift 10
    shape = {"row": (rows, 1), "col": (1, cols), "elem": (rows, cols)}[per]
    s = rng.integers(-31, 32, size=shape)
    got = rounding_shift(x, s, rounding)
    assert got.shape == x.shape and np.array_equal(got, _old_rounding_shift(x, s, rounding))

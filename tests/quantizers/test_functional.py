"""qdsl's quantization arithmetic against torch's own kernels (exact equality) and
hand-derived cases for what torch cannot express (PoT, binary, ternary, groups)."""

import doctest

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from qdsl.quantizers import functional as F


def test_doctests():
    res = doctest.testmod(F)
    assert res.failed == 0 and res.attempted > 15


@st.composite
def affine_configs(draw, per_channel: bool):
    bits = draw(st.integers(2, 8))
    signed = draw(st.booleans())
    narrow = draw(st.booleans())
    qmin, qmax = F.qrange(bits, signed, narrow)
    symmetric = draw(st.booleans())
    shape = draw(st.sampled_from([(7,), (3, 5), (4, 3, 2), (2, 3, 2, 2)]))
    axis = draw(st.integers(0, len(shape) - 1)) if per_channel else None
    nscale = shape[axis] if per_channel else 1
    scales = draw(st.lists(st.floats(2.0**-13, 10.0, width=32), min_size=nscale, max_size=nscale))
    if symmetric:
        zps = [0 if signed else qmin] * nscale
    else:
        zps = draw(st.lists(st.integers(qmin, qmax), min_size=nscale, max_size=nscale))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.floats(0.1, 50.0))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * spread
    # put some values exactly on rounding ties (k + 0.5) * s and on the clamp edges
    s0 = torch.tensor(scales[0], dtype=torch.float32)
    ties = (torch.randint(-20, 20, shape, generator=g).float() + 0.5) * s0
    x = torch.where(torch.rand(shape, generator=g) < 0.3, ties, x)
    return x, qmin, qmax, axis, torch.tensor(scales, dtype=torch.float32), torch.tensor(zps)


@given(affine_configs(per_channel=False))
def test_per_tensor_equals_torch(cfg):
    x, qmin, qmax, _, scale, zp = cfg
    s, z = scale[0], zp[0]
    ref = torch.fake_quantize_per_tensor_affine(x, float(s), int(z), qmin, qmax)
    out = F.fake_quant_affine(x, s, z, qmin, qmax)
    assert torch.equal(out, ref)
    q = F.quantize_affine(x, s, z, qmin, qmax)
    assert q.dtype in (torch.int8, torch.uint8)
    assert torch.equal(F.dequantize_affine(q, s, z), ref)


@given(affine_configs(per_channel=True))
def test_per_channel_equals_torch(cfg):
    x, qmin, qmax, axis, scale, zp = cfg
    ref = torch.fake_quantize_per_channel_affine(x, scale, zp.to(torch.int32), axis, qmin, qmax)
    out = F.fake_quant_affine(x, scale, zp, qmin, qmax, axis=axis)
    assert torch.equal(out, ref)
    q = F.quantize_affine(x, scale, zp, qmin, qmax, axis=axis)
    assert torch.equal(F.dequantize_affine(q, scale, zp, axis=axis), ref)


def test_division_would_not_match_torch():
    # Why functional multiplies by the reciprocal: for these (found by search) x / s is
    # -27.499998 (rounds to -27) but x * (1/s) is exactly -27.5 (rounds to -28, like torch).
    s = torch.tensor(0.06601718813180923, dtype=torch.float32)
    x = torch.tensor([-1.8154726028442383], dtype=torch.float32)
    ref = torch.fake_quantize_per_tensor_affine(x, float(s), 0, -128, 127)
    by_div = torch.round(x / s).clamp(-128, 127) * s
    assert torch.equal(F.fake_quant_affine(x, s, torch.tensor(0), -128, 127), ref)
    assert not torch.equal(by_div, ref)


def test_roundings_hand_derived():
    t = torch.tensor([-1.5, -0.5, 0.5, 1.5, 2.5, 1.2, -1.7])
    assert F.round_(t, "half_away").tolist() == [-2, -1, 1, 2, 3, 1, -2]
    assert F.round_(t, "floor").tolist() == [-2, -1, 0, 1, 2, 1, -2]
    g = torch.Generator().manual_seed(0)
    x = torch.full((20000,), 0.25)
    r = F.round_(x, "stochastic", generator=g)
    assert set(r.unique().tolist()) == {0.0, 1.0}
    assert abs(r.mean().item() - 0.25) < 0.02
    ints = torch.tensor([-3.0, 0.0, 4.0])
    assert torch.equal(F.round_(ints, "stochastic"), ints)
    with pytest.raises(ValueError, match="known: half_even"):
        F.round_(t, "nearest")


def test_pot_scale_hand_derived():
    # log-domain rounding: boundary at 2^k * sqrt(2)
    s = torch.tensor([1.0, 1.41, 1.42, 0.3, 2.0**-10, 6.0])
    assert F.pot_scale(s).tolist() == [1.0, 1.0, 2.0, 0.25, 2.0**-10, 8.0]
    assert F.pot_scale(s, "ceil").tolist() == [1.0, 2.0, 2.0, 0.5, 2.0**-10, 8.0]
    assert (F.pot_scale(s, "ceil") >= s).all()


def test_binary_and_ternary_hand_derived():
    w = torch.tensor([[0.5, -1.5, 0.0, 1.0], [-2.0, -2.0, 4.0, 0.0]])
    alpha = w.abs().mean(dim=1)  # mean_abs: [0.75, 2.0]
    out = F.fake_quant_binary(w, alpha, axis=0)
    assert out.tolist() == [[0.75, -0.75, 0.75, 0.75], [-2.0, -2.0, 2.0, 2.0]]
    assert F.binary_codes(w).tolist() == [[1, -1, 1, 1], [-1, -1, 1, 1]]
    # ternary: delta = 0.7*mean|w| = [0.525, 1.4]; alpha = mean over |w|>delta
    d, a = F.ternary_params(w, axis=0)
    assert torch.allclose(d, torch.tensor([0.525, 1.4]))
    assert torch.allclose(a, torch.tensor([(1.5 + 1.0) / 2, (2 + 2 + 4) / 3]))
    assert F.ternary_codes(w, d, axis=0).tolist() == [[0, -1, 0, 1], [-1, -1, 1, 0]]


def test_pot_weights_hand_derived():
    # 4 bits: magnitudes s*2^0 .. s*2^-6, and 0; s = 2
    x = torch.tensor([2.0, 1.6, 1.4, 0.03, 0.0157, 0.015, -0.7, 100.0])
    out = F.fake_quant_pot_weight(x, torch.tensor(2.0), 4)
    assert out.tolist() == [2.0, 2.0, 1.0, 2.0**-5, 2.0**-5, 0.0, -0.5, 2.0]
    codes = F.pot_weight_codes(x, torch.tensor(2.0), 4)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 7


def test_groups_hand_derived():
    # rows of w.reshape(C, -1): C=2, R=8, group 4 -> [2, 2] scales
    w = torch.arange(16.0).reshape(2, 4, 2)
    scale = torch.tensor([[1.0, 2.0], [4.0, 8.0]])
    zp = torch.zeros(2, 2, dtype=torch.int32)
    q = F.quantize_affine(w, scale, zp, -128, 127, group_size=4)
    rows = w.reshape(2, 8)
    expect = torch.round(rows / scale.repeat_interleave(4, dim=1)).reshape(2, 4, 2)
    assert torch.equal(q.float(), expect)
    # group (1, 1) is row 1, elements 4..7 = 12..15, scale 8 -> 1.5, 1.625, 1.75, 1.875
    assert q.reshape(2, 8)[1, 4:].tolist() == [2, 2, 2, 2]
    assert q.reshape(2, 8)[0, :4].tolist() == [0, 1, 2, 3]
    # per-group fake quant equals per-channel fake quant of the (C*G, g) view
    fq = F.fake_quant_affine(w, scale, zp, -128, 127, group_size=4)
    ref = torch.fake_quantize_per_channel_affine(
        w.reshape(4, 4), scale.reshape(4), zp.reshape(4), 0, -128, 127)
    assert torch.equal(fq.reshape(4, 4), ref)
    # a group size that does not divide the row: the last group is shorter (minifloats,
    # OCP MX's padded block; the resolver keeps E217 for the other formats)
    assert F.param_shape((2, 5, 3), group_size=2) == (2, 8)
    assert F.reduce_view(torch.ones(2, 5, 3), group_size=2).shape == (16, 2)
    assert F.reduce_view(torch.ones(2, 5, 3), group_size=2)[7].tolist() == [1.0, 0.0]  # zero-padded
    assert F.param_view(torch.arange(16.0).reshape(2, 8), torch.zeros(2, 5, 3), group_size=2)[1, 4].tolist() \
        == [14.0, 14.0, 15.0]
    with pytest.raises(ValueError, match="positive"):
        F.param_shape((2, 5, 3), group_size=0)

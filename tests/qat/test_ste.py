"""Gradients of the straight-through estimators: closed forms, finite differences, torch cross-checks."""

import math

import pytest
import torch
from hypothesis import given, strategies as st

from qdsl.quantizers import ste
from qdsl.quantizers import functional as F


def _x(n=200, seed=0, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("qmin,qmax,zp", [(-128, 127, 0), (0, 255, 37), (-7, 7, 0), (0, 15, 3)])
def test_fake_quant_matches_torch_fake_quantize(qmin, qmax, zp):
    x = _x().requires_grad_()
    y = ste.fake_quant(x, torch.tensor(0.05), torch.tensor(float(zp)) if zp else None, qmin, qmax)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = torch.fake_quantize_per_tensor_affine(x_ref, 0.05, zp, qmin, qmax)
    g = torch.randn(x.shape)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(y, y_ref)
    assert torch.equal(x.grad, x_ref.grad)


def test_clipping_mask_closed_form():
    s, qmin, qmax = 0.25, -4, 3
    x = torch.linspace(-2, 2, 401, dtype=torch.float64, requires_grad=True)
    ste.fake_quant(x, torch.tensor(s, dtype=torch.float64), None, qmin, qmax).sum().backward()
    code = torch.round(x.detach() / s)
    expected = ((code >= qmin) & (code <= qmax)).double()
    assert torch.equal(x.grad, expected)
    assert x.grad.sum() > 0 and (x.grad == 0).sum() > 0  # both regions exercised


@pytest.mark.parametrize("with_zp", [False, True])
def test_lsq_scale_gradient_closed_form(with_zp):
    x = _x(300, seed=1, dtype=torch.float64)
    s = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    z = torch.tensor(2.0, dtype=torch.float64, requires_grad=True) if with_zp else None
    qmin, qmax = -8, 7
    gf = ste.lsq_grad_factor(x.numel(), qmax)
    g = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    ste.fake_quant(x, s, z, qmin, qmax, grad_factor=gf).backward(g)
    zv = 2.0 if with_zp else 0.0
    v = x / 0.3
    r = torch.round(v) + zv
    lo, hi = r < qmin, r > qmax
    inside = ~(lo | hi)
    ds = torch.where(inside, torch.round(v) - v, torch.where(lo, qmin - zv, qmax - zv))
    assert math.isclose(s.grad.item(), (g * ds).sum().item() * gf, rel_tol=1e-9)
    assert math.isclose(gf, 1 / math.sqrt(300 * 7))
    if with_zp:
        dz = torch.where(inside, torch.zeros_like(x), torch.full_like(x, -0.3))
        assert math.isclose(z.grad.item(), (g * dz).sum().item() * gf, rel_tol=1e-9)


def test_lsq_matches_torch_learnable_kernel():
    """torch ships LSQ as a fused op; ours must agree on values and all three gradients."""
    x = _x(500, seed=2)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    x1, s1, z1 = x.clone().requires_grad_(), torch.tensor([0.4], requires_grad=True), torch.tensor([2.0], requires_grad=True)
    torch._fake_quantize_learnable_per_tensor_affine(x1, s1, z1, -8, 7, 0.3).backward(g)
    x2, s2, z2 = x.clone().requires_grad_(), torch.tensor(0.4, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    ste.fake_quant(x2, s2, z2, -8, 7, grad_factor=0.3).backward(g)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.allclose(s1.grad, s2.grad.reshape(1), rtol=1e-5)
    assert torch.allclose(z1.grad, z2.grad.reshape(1), rtol=1e-5)


def test_per_channel_scale_gradient_sums_per_channel():
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    s = torch.tensor([0.1, 0.2, 0.05, 0.3], dtype=torch.float64).reshape(4, 1, 1, 1).requires_grad_()
    ste.fake_quant(w, s, None, -7, 7).sum().backward()
    for c in range(4):
        sc = torch.tensor(s[c, 0, 0, 0].item(), dtype=torch.float64, requires_grad=True)
        ste.fake_quant(w[c], sc, None, -7, 7).sum().backward()
        assert math.isclose(s.grad[c].item(), sc.grad.item(), rel_tol=1e-12)


def test_scale_gradient_finite_difference_when_clipped():
    """Where every element is clipped, x̂ = qmax·s is smooth in s, so gradcheck applies exactly."""
    x = torch.tensor([5.0, 7.0, -9.0], dtype=torch.float64)

    def f(s):
        return ste.fake_quant(x, s, None, -4, 3)

    assert torch.autograd.gradcheck(f, (torch.tensor(0.5, dtype=torch.float64, requires_grad=True),))


def test_scale_grad_and_round_ste():
    t = torch.tensor([1.2, -0.7], requires_grad=True)
    (ste.round_ste(ste.scale_grad(t, 0.25)) * torch.tensor([2.0, 3.0])).sum().backward()
    assert t.grad.tolist() == [0.5, 0.75]


@given(st.floats(-12, 4).filter(lambda t: min(abs(t - round(t)), abs(abs(t - math.floor(t)) - 0.5)) > 1e-6))
def test_pot_scale_is_power_of_two_with_log_gradient(t0):
    t = torch.tensor(t0, dtype=torch.float64, requires_grad=True)
    s = ste.pot_scale(t)
    s.backward()
    assert math.log2(s.item()) == round(t0)
    assert math.isclose(t.grad.item(), s.item() * math.log(2), rel_tol=1e-12)
    sc = ste.pot_scale(t.detach(), ceil=True)
    assert math.log2(sc.item()) == math.ceil(t0)


def test_learned_pot_scale_end_to_end_gradient():
    """dL/dt = dL/ds · s·ln2 · grad_factor, with dL/ds the LSQ gradient at s = 2^round(t)."""
    x = _x(100, seed=4, dtype=torch.float64)
    t = torch.tensor(-2.3, dtype=torch.float64, requires_grad=True)
    s = ste.pot_scale(t)
    ste.fake_quant(x, s, None, -8, 7, grad_factor=0.1).sum().backward()
    s_ref = torch.tensor(0.25, dtype=torch.float64, requires_grad=True)
    ste.fake_quant(x, s_ref, None, -8, 7, grad_factor=0.1).sum().backward()
    assert math.isclose(t.grad.item(), s_ref.grad.item() * 0.25 * math.log(2), rel_tol=1e-12)


def test_sign_ste_clipped_mask():
    x = torch.tensor([-1.5, -1.0, -0.1, 0.0, 0.99, 1.01], requires_grad=True)
    y = ste.sign_ste(x)
    y.sum().backward()
    assert y.tolist() == [-1, -1, -1, 1, 1, 1]
    assert x.grad.tolist() == [0, 1, 1, 1, 1, 0]
    xs = torch.tensor([-0.3, 0.7, 2.0], requires_grad=True)
    ys = ste.binary_act(xs, torch.tensor(0.5))
    ys.sum().backward()
    assert ys.tolist() == [-0.5, 0.5, 0.5]
    assert xs.grad.tolist() == [1.0, 0.0, 0.0]  # clip at |x| <= s; d(s·sign(x/s))/dx = 1 inside


def test_binary_weight_values_and_closed_form_gradient():
    w = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 0.8
    w.requires_grad_()
    y = ste.binary_weight(w)
    alpha = w.detach().abs().mean(1, keepdim=True)
    sgn = torch.where(w.detach() >= 0, 1.0, -1.0).double()
    assert torch.allclose(y, alpha * sgn)
    g = torch.randn(3, 5, dtype=torch.float64)
    y.backward(g)
    n = 5
    expected = (g * sgn).sum(1, keepdim=True) * sgn / n + alpha * g * (w.detach().abs() <= 1)
    assert torch.allclose(w.grad, expected)


def test_binary_weight_alpha_gradient_finite_difference():
    """With every |w| > 1 the STE term vanishes and the gradient is the true derivative."""
    w = torch.tensor([[1.5, -2.0, 1.2], [-3.0, 1.1, 2.5]], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ste.binary_weight, (w,))
    per_tensor = lambda t: ste.binary_weight(t, axis=None)
    assert torch.autograd.gradcheck(per_tensor, (w,))


def test_unsigned_binary():
    x = torch.tensor([-1.0, 0.2, 0.3, 0.8, 1.5], requires_grad=True)
    s = torch.tensor(0.5, requires_grad=True)
    y = ste.unsigned_binary(x, s)
    y.sum().backward()
    assert y.tolist() == [0.0, 0.0, 0.5, 0.5, 0.5]
    # representable range [0, s] passes the gradient; d/ds is the code
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert s.grad.item() == 3.0


def test_ternary_weight_values_and_gradient():
    w = torch.tensor([[0.9, -0.05, -1.2, 0.2, 0.6], [0.01, 0.02, -0.03, 0.5, 0.04]], dtype=torch.float64,
                     requires_grad=True)
    y = ste.ternary_weight(w)
    wd = w.detach()
    delta = 0.7 * wd.abs().mean(1, keepdim=True)
    keep = (wd.abs() > delta).double()
    alpha = (wd.abs() * keep).sum(1, keepdim=True) / keep.sum(1, keepdim=True)
    codes = torch.sign(wd) * keep
    assert torch.allclose(y, alpha * codes)
    assert set(torch.unique(torch.round(y / alpha, decimals=6)).tolist()) <= {-1.0, 0.0, 1.0}
    g = torch.randn(w.shape, dtype=torch.float64)
    y.backward(g)
    # codes pass straight through (alpha·g); alpha = sum(|w|·keep)/count adds sign(w)·keep/count·Σ g·codes
    expected = alpha * g + (g * codes).sum(1, keepdim=True) * torch.sign(wd) * keep / keep.sum(1, keepdim=True)
    assert torch.allclose(w.grad, expected)


def test_pot_weight_levels_budget_and_values():
    s = torch.tensor(0.5)
    w = torch.linspace(-0.7, 0.7, 1001)
    for bits in (2, 3, 4, 5):
        y = ste.pot_weight(w, s, bits)
        mags = torch.unique((y.abs() / s))
        nonzero = mags[mags > 0]
        assert len(mags) <= 2 ** (bits - 1)  # 0 plus 2^(bits-1)-1 magnitudes: fits sign + (bits-1)
        assert torch.equal(torch.log2(nonzero), torch.round(torch.log2(nonzero)))
        # nearest representable value (in the linear domain)
        levels = torch.cat([torch.zeros(1), 2.0 ** -torch.arange(F.pot_weight_levels(bits), dtype=torch.float32)]) * 0.5
        cand = torch.cat([levels, -levels])
        best = cand[(w.clamp(-0.5, 0.5)[:, None] - cand[None]).abs().argmin(1)]
        wc = w.clamp(-0.5, 0.5)
        assert ((y - wc).abs() <= (best - wc).abs() + 1e-6).all()  # ties may go either way
        assert (y.abs() <= 0.5).all() and (torch.sign(y) * torch.sign(w) >= 0).all()


def test_pot_weight_gradient_mask():
    w = torch.tensor([0.3, -0.6, 0.1, 2.0, -1.5], requires_grad=True)
    ste.pot_weight(w, torch.tensor(1.0), 4).sum().backward()
    assert w.grad.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_pot_weight_rejects_one_bit():
    with pytest.raises(ValueError, match="at least 2 bits|>= 2 bits"):
        ste.pot_weight(torch.ones(2), torch.tensor(1.0), 1)


def test_unknown_rounding_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown rounding 'nearest'"):
        ste.round_ste(torch.ones(2), "nearest")


@pytest.mark.parametrize("rounding", ["half_even", "half_away", "floor"])
@pytest.mark.parametrize("axis", [None, 0])
def test_forward_values_are_functional_bit_for_bit(rounding, axis):
    """QAT must compute exactly what PTQ/export compute once frozen."""
    w = torch.randn(8, 4, 3, 3, generator=torch.Generator().manual_seed(7))
    scale = torch.rand(8) * 0.1 + 0.01 if axis == 0 else torch.tensor(0.037)
    zp = torch.zeros_like(scale)
    assert torch.equal(ste.fake_quant(w, scale, zp, -8, 7, rounding=rounding, axis=axis),
                       F.fake_quant_affine(w, scale, zp, -8, 7, rounding, axis=axis))
    assert torch.equal(ste.pot_weight(w, scale * 20, 4, axis), F.fake_quant_pot_weight(w, scale * 20, 4, axis))
    assert torch.equal(ste.unsigned_binary(w, scale, axis), F.fake_quant_binary(w, scale, signed=False, axis=axis))
    delta, alpha = F.ternary_params(w, axis)
    assert torch.allclose(ste.ternary_weight(w, axis), F.fake_quant_ternary(w, delta, alpha, axis), rtol=1e-6, atol=0)
    alpha_b = w.abs().mean(dim=(1, 2, 3)) if axis == 0 else w.abs().mean()
    assert torch.allclose(ste.binary_weight(w, axis), F.fake_quant_binary(w, alpha_b, axis=axis))
    t = torch.log2(scale)
    assert torch.equal(ste.pot_scale(t), F.pot_scale(scale))
    assert torch.equal(ste.pot_scale(t, ceil=True), F.pot_scale(scale, "ceil"))


def test_per_channel_axis_api_gradients():
    w = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    s = torch.tensor([0.1, 0.2, 0.3, 0.05], dtype=torch.float64, requires_grad=True)
    ste.fake_quant(w, s, None, -4, 3, axis=0).sum().backward()
    s2 = s.detach().reshape(4, 1).requires_grad_()
    ste.fake_quant(w, s2, None, -4, 3).sum().backward()
    assert s.grad.shape == (4,) and torch.allclose(s.grad, s2.grad.reshape(4))


def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    x = torch.full((20000,), 0.3)
    assert abs(ste.round_ste(x, "stochastic").mean().item() - 0.3) < 0.02


@pytest.mark.parametrize("axis,zp", [(None, 0), (None, 3), (0, 0)])
def test_fused_and_lsq_paths_agree(axis, zp):
    """Without a scale gradient the fused torch kernel runs; with one, the LSQ function: same values and x-grads."""
    x = (torch.randn(8, 4, 5, 5, generator=torch.Generator().manual_seed(9)) * 2).requires_grad_()
    s = torch.rand(8) * 0.05 + 0.01 if axis == 0 else torch.tensor(0.043)
    z = torch.full(s.shape, float(zp))
    y_fused = ste.fake_quant(x, s, z, 0 if zp else -8, 15 if zp else 7, axis=axis)
    g = torch.randn(x.shape)
    (gx_fused,) = torch.autograd.grad(y_fused, x, g)
    y_lsq = ste.fake_quant(x, s.clone().requires_grad_(), z, 0 if zp else -8, 15 if zp else 7, axis=axis)
    (gx_lsq,) = torch.autograd.grad(y_lsq, x, g)
    assert torch.equal(y_fused, y_lsq) and torch.equal(gx_fused, gx_lsq)


@pytest.mark.parametrize("shape,axis,asym", [((24, 5, 3, 3), 0, False), ((24, 5, 3, 3), 0, True),
                                             ((6, 24, 4), 1, False), ((40, 7), 0, True)])
def test_per_channel_fast_path_equals_torch_kernel(monkeypatch, shape, axis, asym):
    # the blocked per-channel path (several blocks: a tiny block size) against torch's fused
    # per-channel kernel, values and clipping-mask gradient, bit for bit
    monkeypatch.setattr(ste, "_BLOCK_ELEMENTS", 64)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(shape, generator=g) * 2).requires_grad_()
    c = shape[axis]
    s = torch.rand(c, generator=g) * 0.3 + 0.05
    z = torch.randint(-3, 4, (c,), generator=g, dtype=torch.int32) if asym else torch.zeros(c, dtype=torch.int32)
    y = ste.fake_quant(w, s, z if asym else None, -8, 7, axis=axis)
    gy = torch.randn(shape, generator=g)
    y.backward(gy)
    w2 = w.detach().clone().requires_grad_()
    ref = torch.fake_quantize_per_channel_affine(w2, s, z, axis, -8, 7)
    ref.backward(gy)
    assert torch.equal(y, ref) and torch.equal(w.grad, w2.grad)

"""QAT gradients through ``TensorQuantizer``: values unchanged, gradients per kind as documented."""

import math

import pytest
import torch

from qdsl.quantizers import proxy_grad, ste
from qdsl.quantizers.proxy import TensorQuantizer as _TensorQuantizer
from qdsl.resolve.plan import QuantizerRecipe
from qdsl.spec.model import Granularity, GranularityKind, Kind, ObserverSpec, Role


def recipe(kind="int", bits=8, signed=True, scale="float", channel=False, observer="minmax", symmetric=True,
           narrow=False):
    gran = Granularity(GranularityKind.CHANNEL, 0) if channel else Granularity()
    return QuantizerRecipe(Kind(kind), bits, signed, narrow, symmetric, scale, gran, ObserverSpec(observer),
                           "half_even", False)


def TensorQuantizer(*args, **kwargs):
    """A proxy with the QAT gradient path installed on it (what prepare_qat does per model)."""
    q = _TensorQuantizer(*args, **kwargs)
    assert proxy_grad.install(q) == 1
    return q


def _w(shape=(4, 3, 3, 3), seed=0, scale=0.3):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).requires_grad_()


def _values_equal_without_grad(q, x):
    with torch.no_grad():
        ref = q(x.detach())
    y = q(x)
    assert torch.equal(y.detach(), ref)
    return y


def test_int_weight_clipping_mask_reaches_weight():
    q = TensorQuantizer(recipe(bits=4, channel=True), Role.WEIGHT)
    w = _w()
    y = _values_equal_without_grad(q, w)
    y.sum().backward()
    # minmax per channel: nothing is clipped, so the mask is all ones
    assert torch.equal(w.grad, torch.ones_like(w))


def test_learned_int_scale_gets_scaled_lsq_gradient():
    q = TensorQuantizer(recipe(bits=4, channel=True, scale="learned"), Role.WEIGHT)
    w = _w()
    y = _values_equal_without_grad(q, w)  # first call initialises the parameter
    rule = q.scale_rule
    assert bool(rule.initialized) and rule.scale.shape == (4,)
    g = torch.randn(w.shape, generator=torch.Generator().manual_seed(3))
    w.grad = None
    q(w).backward(g)
    s_ref = rule.scale.detach().clone().requires_grad_()
    ste.fake_quant(w.detach(), s_ref, None, q.qmin, q.qmax, axis=0).backward(g)
    factor = 1 / math.sqrt(27 * q.qmax)
    assert torch.allclose(rule.scale.grad, s_ref.grad * factor, rtol=1e-5)
    assert rule.scale.grad.abs().sum() > 0


def test_learned_pot_activation_scale_trains_and_stays_pot():
    q = TensorQuantizer(recipe(bits=8, signed=False, scale="learned_pot"), Role.INPUT)
    x = torch.rand(16, 8, 4, 4) * 3
    q.observing = True
    q(x)
    q.observing = False
    y = q(x.requires_grad_())
    s = q.qparams()[0]
    assert math.log2(s.item()) == round(math.log2(s.item()))
    (y - 2 * x).square().mean().backward()  # wants a larger range: clipping at 2 codes
    assert q.scale_rule.log2_scale.grad is not None and q.scale_rule.log2_scale.grad.abs().item() > 0
    assert q.scale_rule.numel == 8 * 4 * 4  # LSQ counts per sample for activations


def test_binary_weight_xnor_gradient():
    q = TensorQuantizer(recipe(kind="binary", bits=1, channel=True, observer="mean_abs"), Role.WEIGHT)
    w = _w((3, 5), seed=1)
    y = _values_equal_without_grad(q, w)
    alpha = w.detach().abs().mean(1, keepdim=True)
    assert torch.allclose(y.detach(), alpha * torch.where(w.detach() >= 0, 1.0, -1.0))
    g = torch.randn(3, 5)
    y.backward(g)
    w2 = w.detach().clone().requires_grad_()
    ste.binary_weight(w2, 0).backward(g)
    assert torch.allclose(w.grad, w2.grad)


def test_binary_activation_clipped_ste():
    q = TensorQuantizer(recipe(kind="binary", bits=1, observer="minmax"), Role.INPUT)
    x = torch.linspace(-2, 1, 31)
    q.observing = True
    q(x)
    q.observing = False
    xr = x.clone().requires_grad_()
    y = q(xr)
    y.sum().backward()
    s = q.qparams()[0].item()
    assert s == 2.0 and set(y.detach().tolist()) == {-2.0, 2.0}
    assert torch.equal(xr.grad, (x.abs() <= s).float())


def test_ternary_weight_twn_gradient():
    q = TensorQuantizer(recipe(kind="ternary", bits=2, channel=True, observer="mean_abs"), Role.WEIGHT)
    w = _w((4, 10), seed=2)
    y = _values_equal_without_grad(q, w)
    g = torch.randn(4, 10)
    y.backward(g)
    w2 = w.detach().clone().requires_grad_()
    ste.ternary_weight(w2, 0).backward(g)
    assert torch.allclose(w.grad, w2.grad, atol=1e-6)


def test_pot_weight_gradient_mask():
    q = TensorQuantizer(recipe(kind="pot", bits=4, channel=True), Role.WEIGHT)
    w = _w((4, 8), seed=3)
    y = _values_equal_without_grad(q, w)
    y.sum().backward()
    s = q.qparams(w.detach())[0]
    assert torch.equal(w.grad, (w.detach().abs() <= s[:, None]).float())


@pytest.mark.parametrize("kind,bits,obs", [("int", 4, "minmax"), ("binary", 1, "mean_abs"), ("pot", 4, "minmax")])
def test_plain_ste_differs_from_qat_only_in_gradient(kind, bits, obs):
    """Uninstalling the QAT path must not change values (it only changes gradients)."""
    q = TensorQuantizer(recipe(kind=kind, bits=bits, channel=True, observer=obs), Role.WEIGHT)
    w = _w((4, 6), seed=4)
    y_qat = q(w)
    proxy_grad.uninstall(q)
    y_plain = q(w)
    assert torch.equal(y_qat, y_plain)

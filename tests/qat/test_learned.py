"""The ``learned`` / ``learned_pot`` scale rules on their own (protocol of qdsl.quantizers.parts)."""

import math
import types

import torch

from qdsl.quantizers import ste
from qdsl.quantizers.learned import LearnedPotScale, LearnedScale
from qdsl.quantizers import functional as F


def _ctx(qmax=7):
    return types.SimpleNamespace(qmax=qmax, qmin=-qmax - 1)


def test_learned_scale_initialises_from_raw_and_learns_with_lsq_gradient():
    rule = LearnedScale(_ctx(7))
    raw = torch.tensor([0.1, 0.2, 0.05])
    assert torch.equal(rule(raw), raw)
    assert bool(rule.initialized) and rule.scale.shape == (3,)
    assert torch.equal(rule(torch.tensor([9.0, 9.0, 9.0])), raw)  # initialised once
    w = torch.randn(3, 4, 3, 3, generator=torch.Generator().manual_seed(0))
    rule.bind(w.shape, per_sample=False, slots=3)
    assert rule.numel == 36
    y = ste.fake_quant(w, rule(None), None, -8, 7, axis=0)
    g = torch.randn(w.shape)
    y.backward(g)
    s_ref = raw.clone().requires_grad_()
    ste.fake_quant(w, s_ref, None, -8, 7, axis=0).backward(g)
    assert torch.allclose(rule.scale.grad, s_ref.grad / math.sqrt(36 * 7))


def test_activation_bind_counts_per_sample():
    rule = LearnedScale(_ctx(255))
    rule.bind((64, 32, 8, 8), per_sample=True)
    assert rule.numel == 32 * 64 and math.isclose(rule.grad_factor, 1 / math.sqrt(2048 * 255))


def test_learned_scale_stays_positive():
    rule = LearnedScale(_ctx())
    rule(torch.tensor(0.1))
    with torch.no_grad():
        rule.scale.fill_(-1.0)
    assert rule(None).item() > 0


def test_learned_pot_scale_starts_at_ptq_pot_and_has_log_gradient():
    rule = LearnedPotScale(_ctx(7))
    raw = torch.tensor([0.1, 0.3, 0.75])
    s = rule(raw)
    assert torch.equal(s, F.pot_scale(raw))
    rule.bind((3, 10), per_sample=False, slots=3)
    s = rule(None)
    s.sum().backward()
    assert torch.allclose(rule.log2_scale.grad, s.detach() * math.log(2) * ste.lsq_grad_factor(10, 7))


def test_learned_pot_scale_moves_exponent_under_training():
    rule = LearnedPotScale(_ctx(7))
    rule(torch.tensor(0.01))  # far too small for data in [-1, 1]: everything clips
    rule.bind((256,), per_sample=False)
    x = torch.linspace(-1, 1, 256)
    opt = torch.optim.Adam(rule.parameters(), lr=0.1)  # log2 steps ~0.1 whatever the scale
    start = rule(None).item()
    for _ in range(50):
        opt.zero_grad()
        (ste.fake_quant(x, rule(None), None, -8, 7) - x).square().mean().backward()
        opt.step()
    end = rule(None).item()
    assert end > start * 4 and math.log2(end) == round(math.log2(end))


def test_state_dict_round_trip_into_fresh_rule():
    for cls, name in ((LearnedScale, "scale"), (LearnedPotScale, "log2_scale")):
        rule = cls(_ctx())
        rule(torch.tensor([0.1, 0.2]))
        fresh = cls(_ctx())
        fresh.load_state_dict(rule.state_dict())
        assert bool(fresh.initialized) and torch.equal(getattr(fresh, name), getattr(rule, name))
        assert torch.equal(fresh(None), rule(None))

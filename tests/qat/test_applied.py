"""End to end on applied models: loss.backward() reaches weights and learned scales with the right values."""

import math

import torch
from torch import nn

import qdsl.qat
from qdsl.parse import parse_text
from qdsl import calibrate, freeze
from qdsl.patch import apply, get_handle
from qdsl.quantizers import ste

LEARNED = """version 1
defaults {
  weight = int(bits=4, signed, narrow, symmetric, per_channel, scale=learned, observer=minmax)
  input = int(bits=8, signed, symmetric, per_tensor, scale=learned_pot, observer=minmax)
}
"""


def _linear_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))


def test_learned_scales_get_lsq_gradients_through_apply():
    model = _linear_model()
    apply(model, parse_text(LEARNED, "learned.qspec"))
    x = torch.randn(16, 6)
    calibrate(model, [x])
    model.train()
    y = model(x)
    y.square().sum().backward()
    handle = get_handle(model)
    wq = handle.quantizer("0", "weight")
    iq = handle.quantizer("0", "input")
    assert wq.scale_rule.scale.grad is not None and wq.scale_rule.scale.grad.abs().sum() > 0
    assert iq.scale_rule.log2_scale.grad is not None and iq.scale_rule.log2_scale.grad.abs().item() > 0
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # the weight scale's gradient is LSQ's closed form, scaled by 1/sqrt(numel·qmax)
    w = model[0].weight_float.detach()
    s = wq.scale_rule.scale.detach().clone().requires_grad_()
    x_q = ste.fake_quant(x, iq.qparams()[0].detach(), None, iq.qmin, iq.qmax)
    out = nn.functional.linear(x_q, ste.fake_quant(w, s, None, wq.qmin, wq.qmax, axis=0), model[0].bias)
    model2_rest = model[2]
    # reproduce the rest of the forward with the patched second layer's current weights
    iq2 = handle.quantizer("2", "input")
    h = ste.fake_quant(torch.relu(out), iq2.qparams()[0].detach(), None, iq2.qmin, iq2.qmax)
    y_ref = nn.functional.linear(h, model2_rest.weight.detach(), model2_rest.bias.detach())
    assert torch.allclose(y_ref, y.detach(), atol=1e-6)
    y_ref.square().sum().backward()
    factor = 1 / math.sqrt(6 * wq.qmax)
    assert torch.allclose(wq.scale_rule.scale.grad, s.grad * factor, rtol=1e-4, atol=1e-7)


def test_learned_pot_stays_power_of_two_through_training_and_freeze():
    model = _linear_model()
    apply(model, parse_text(LEARNED, "learned.qspec"))
    x = torch.randn(64, 6)
    calibrate(model, [x[:16]])
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    model.train()
    for _ in range(5):
        opt.zero_grad()
        (model(x) - 1).square().mean().backward()
        opt.step()
    freeze(model)
    iq = get_handle(model).quantizer("0", "input")
    s = iq.scale
    assert math.log2(s.item()) == round(math.log2(s.item()))
    assert torch.equal(s, ste.pot_scale(iq.scale_rule.log2_scale.detach()))

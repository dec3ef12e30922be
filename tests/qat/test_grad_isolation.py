"""The QAT gradient path is per model (per proxy), never process-wide (issue 16).

Importing ``qdsl.qat``, applying a learned-scale spec to model A and preparing A for QAT
must leave model B's forward values and gradients exactly as they were: B keeps the plain
straight-through estimator (gradient of the identity), which differs from the QAT
clipping-mask STE for inputs outside the calibrated range.
"""

import torch
from torch import nn

from qdsl import calibrate
from qdsl.parse import parse_text
from qdsl.patch import apply, get_handle

PLAIN = """version 1
defaults {
  weight = int(bits=4, signed, narrow, symmetric, per_channel, observer=minmax)
  input = int(bits=8, signed, symmetric, per_tensor, observer=minmax)
}
"""
LEARNED = PLAIN.replace("observer=minmax)\n  input", "scale=learned, observer=minmax)\n  input")


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))


def _forward_backward(model, x):
    x = x.clone().requires_grad_()
    y = model(x)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return y.detach(), x.grad, grads


def test_learned_spec_on_a_does_not_change_b():
    b = _model(1)
    apply(b, parse_text(PLAIN, "plain.qspec"))
    calibrate(b, [torch.randn(32, 6) * 0.5])
    b.train()
    x = torch.randn(8, 6) * 3  # well outside the calibrated input range: clipped codes
    before = _forward_backward(b, x)

    import qdsl.qat

    a = _model(2)
    apply(a, parse_text(LEARNED, "learned.qspec"))
    calibrate(a, [torch.randn(32, 6)])
    qdsl.qat.prepare_qat(a)
    a.train()
    a(torch.randn(4, 6)).sum().backward()
    assert all(q.grad_path is not None for q in get_handle(a).container.quantizers.values())

    after = _forward_backward(b, x)
    assert torch.equal(before[0], after[0])
    assert torch.equal(before[1], after[1])
    assert all(torch.equal(before[2][n], after[2][n]) for n in before[2])
    assert all(q.grad_path is None for q in get_handle(b).container.quantizers.values())

    # and the check can tell: on the QAT path B's input gradient is masked where the
    # input was clipped, so it differs from the plain STE's it kept
    from qdsl.quantizers import proxy_grad

    proxy_grad.install(b)
    try:
        qat = _forward_backward(b, x)
    finally:
        proxy_grad.uninstall(b)
    assert torch.equal(qat[0], after[0]) and not torch.equal(qat[1], after[1])


def test_learned_scale_proxy_gets_the_qat_path_without_prepare_qat():
    a = _model(3)
    apply(a, parse_text(LEARNED, "learned.qspec"))
    handle = get_handle(a)
    assert handle.quantizer("0", "weight").grad_path is not None
    assert handle.quantizer("0", "input").grad_path is None

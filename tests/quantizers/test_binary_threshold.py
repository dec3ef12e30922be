"""Signed binary activations with a learned per-channel threshold (threshold = learned)."""

from __future__ import annotations

import torch

from qdsl.resolve.plan import QuantizerRecipe
from qdsl.quantizers.proxy import TensorQuantizer
from qdsl.quantizers.proxy_grad import uninstall
from qdsl.spec.model import Granularity, Kind, ObserverSpec


def _proxy(threshold: str = "learned") -> TensorQuantizer:
    r = QuantizerRecipe(Kind.BINARY, 1, True, False, True, "float", Granularity(), ObserverSpec("mean_abs"),
                        "half_even", False, threshold=threshold)
    return TensorQuantizer(r, "input")


def _calibrated(x: torch.Tensor, threshold: str = "learned") -> TensorQuantizer:
    q = _proxy(threshold)
    q.observing = True
    q(x)
    q.observing = False
    return q


def test_first_batch_sets_the_per_channel_mean():
    x = torch.rand(4, 5, 3, 3)
    q = _calibrated(x)
    assert q.sign_threshold.shape == (5,)
    torch.testing.assert_close(q.sign_threshold.detach(), x.mean(dim=(0, 2, 3)))
    # about half of each channel's codes at each sign (the mean splits a ReLU output)
    codes = q.int_repr(x).float()
    assert set(codes.unique().tolist()) == {-1.0, 1.0}


def test_tie_is_plus_one_and_codes_match_values():
    q = _calibrated(torch.rand(2, 3, 4))
    with torch.no_grad():
        q.sign_threshold.copy_(torch.tensor([0.25, 0.5, -1.0]))
    x = torch.tensor([[[0.25, 0.2, 1.0, float("nan")], [0.5, 0.49, 0.51, 0.0], [-1.0, -1.5, 0.0, 3.0]]])
    codes = q.int_repr(x)
    assert codes.tolist() == [[[1, -1, 1, 1], [1, -1, 1, -1], [1, -1, 1, 1]]]
    alpha = float(q.current_scale() if q.current_scale() is not None else q.qparams(x)[0])
    with torch.no_grad():
        torch.testing.assert_close(q(x), codes.float() * alpha)


def test_gradients_reach_x_clipped_and_the_threshold():
    x = torch.rand(3, 2, 4) * 2
    q = _calibrated(x)
    x = x.clone().requires_grad_()
    y = q(x)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    t = q.sign_threshold.detach().view(1, 2, 1)
    s = q.qparams(x.detach())[0]
    mask = ((x.detach() - t).abs() <= s).float()
    torch.testing.assert_close(x.grad, g * mask)
    torch.testing.assert_close(q.sign_threshold.grad, -(g * mask).sum(dim=(0, 2)))


def test_threshold_trains_without_the_qat_grad_path():
    x = torch.rand(3, 2, 4)
    q = _calibrated(x)
    uninstall(q)  # the plain STE path: a learned threshold still gets its gradient
    q(x.clone().requires_grad_()).sum().backward()
    assert q.sign_threshold.grad is not None and bool(q.sign_threshold.grad.abs().sum() > 0)


def test_optimizer_built_before_the_first_batch_updates_the_threshold():
    q = _proxy()
    opt = torch.optim.SGD(q.parameters(), lr=0.1)
    x = torch.rand(4, 3, 2)
    q.observing = True
    q(x)
    q.observing = False
    before = q.sign_threshold.detach().clone()
    q(x.clone().requires_grad_()).sum().backward()
    opt.step()
    assert not torch.equal(before, q.sign_threshold.detach())


def test_state_dict_round_trip_sizes_the_threshold():
    q = _calibrated(torch.rand(2, 7, 3))
    fresh = _proxy()
    fresh.load_state_dict(q.state_dict())
    torch.testing.assert_close(fresh.sign_threshold, q.sign_threshold)


def test_no_threshold_keeps_sign_at_zero():
    q = _calibrated(torch.rand(2, 3, 3), threshold="none")
    assert q.sign_threshold is None
    assert q.int_repr(torch.tensor([[[0.0, -0.1, 0.1]] * 3])).tolist() == [[[1, -1, 1]] * 3]

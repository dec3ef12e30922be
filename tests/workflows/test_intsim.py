"""The integer-accelerator simulator reproduces the fake-quant model and calls the hook."""

import copy

import pytest
import torch

import qdsl
from qdsl.spec.diagnostics import QdslError
from qdsl.zoo.models import conv1d_net, digits_resnet
from qdsl.workflows.intsim import gaussian_noise, simulate


def _frozen(model, spec, x):
    qdsl.apply(model, spec)
    qdsl.calibrate(model, [x], progress=False)
    qdsl.freeze(model)
    return model


@pytest.mark.parametrize("factory,shape", [(digits_resnet, (32, 1, 8, 8)), (conv1d_net, (16, 1, 64))])
def test_pot_spec_simulation_is_bit_exact(factory, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).abs()
    model = _frozen(factory(), "specs/pot-asic.qspec", x)
    with torch.no_grad():
        ref = model(x)
        with simulate(model) as layers:
            sim = model(x)
    assert len(layers) >= 4
    assert torch.equal(ref, sim)
    # the hooks are gone afterwards
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_float_scale_simulation_matches_within_rounding():
    x = torch.randn(32, 1, 8, 8, generator=torch.Generator().manual_seed(1)).abs()
    model = _frozen(digits_resnet(), "specs/int8-default.qspec", x)
    with torch.no_grad():
        ref = model(x)
        with simulate(model):
            sim = model(x)
    assert (ref.argmax(1) == sim.argmax(1)).float().mean() >= 0.95
    assert torch.allclose(ref, sim, atol=0.05 * float(ref.abs().max()))


def test_hook_sees_int64_accumulators_per_layer():
    x = torch.rand(8, 1, 8, 8)
    model = _frozen(digits_resnet(), "specs/int8-default.qspec", x)
    seen = []

    def hook(acc, layer):
        seen.append((layer.fqn, acc.dtype, acc.shape[1]))
        return acc

    with torch.no_grad(), simulate(model, accumulate=hook) as layers:
        model(x)
    assert {f for f, _, _ in seen} == set(layers)
    assert all(dt == torch.int64 for _, dt, _ in seen)


def test_noise_changes_outputs_and_bad_hook_is_an_error():
    x = torch.rand(8, 1, 8, 8)
    model = _frozen(digits_resnet(), "specs/int8-default.qspec", x)
    with torch.no_grad():
        ref = model(x)
        with simulate(model, accumulate=gaussian_noise(0.2, relative=True)):
            noisy = model(x)
        assert not torch.equal(ref, noisy)
        with pytest.raises(QdslError, match="int64"):
            with simulate(model, accumulate=lambda acc, layer: acc.float()):
                model(x)


def test_requires_frozen_model():
    model = digits_resnet()
    qdsl.apply(model, "specs/int8-default.qspec")
    with pytest.raises(QdslError):
        with simulate(model):
            pass

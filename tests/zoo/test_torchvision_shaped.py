"""The zoo's torchvision-shaped MobileNetV3-small and EfficientNet-B0 match torchvision's
parameter layout (names, counts at full size), the U-Net's shapes work out, every one traces
with torch.fx (lint, apply and export need the trace), and stochastic depth is the identity in eval."""

import pytest
import torch
import torch.fx

from qdsl.zoo.efficientnet import StochasticDepth, efficientnet_b0
from qdsl.zoo.mobilenet_v3 import mobilenet_v3_small
from qdsl.zoo.unet import unet

# torchvision's published parameter counts (mobilenet_v3_small, efficientnet_b0)
FULL = {mobilenet_v3_small: 2_542_856, efficientnet_b0: 5_288_548}
# a few of torchvision's state_dict keys: the SE blocks' and blocks' names
KEYS = {
    mobilenet_v3_small: ["features.0.0.weight", "features.1.block.1.fc1.weight", "features.1.block.1.fc2.bias",
                         "features.4.block.0.1.running_mean", "features.12.0.weight", "classifier.3.weight"],
    efficientnet_b0: ["features.1.0.block.1.fc1.weight", "features.2.0.block.0.0.weight",
                      "features.6.3.block.2.fc2.weight", "features.8.0.weight", "classifier.1.bias"],
}


@pytest.mark.parametrize("factory", list(FULL), ids=lambda f: f.__name__)
def test_full_size_matches_torchvision(factory):
    model = factory(seed=None)
    assert sum(p.numel() for p in model.parameters()) == FULL[factory]
    assert set(KEYS[factory]) <= set(model.state_dict())


@pytest.mark.parametrize("build,size", [(lambda: mobilenet_v3_small(width_mult=0.25, num_classes=10), 32),
                                        (lambda: efficientnet_b0(width_mult=0.25, num_classes=10), 32),
                                        (lambda: unet(width=4, depth=2), 16)])
def test_small_models_run_train_and_trace(build, size):
    model = build()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        y = model(x)
    traced = torch.fx.symbolic_trace(model)
    torch.testing.assert_close(traced(x), y)
    model.train()
    model(x).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_unet_output_is_per_pixel():
    assert unet(width=4, depth=2, num_classes=3)(torch.randn(1, 3, 16, 16)).shape == (1, 3, 16, 16)


def test_stochastic_depth_is_the_identity_in_eval():
    sd = StochasticDepth(0.5)
    x = torch.randn(64, 2, 3, 3)
    assert torch.equal(sd.eval()(x), x)
    torch.manual_seed(0)
    y = sd.train()(x)
    kept = (y != 0).flatten(1).all(1)
    assert 0 < kept.sum() < 64  # whole samples dropped, the rest scaled by 1/(1-p)
    torch.testing.assert_close(y[kept], x[kept] * 2)

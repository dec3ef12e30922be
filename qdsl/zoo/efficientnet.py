"""An EfficientNet-B0 shaped like torchvision's, written in plain torch (no torchvision needed).

Module names and forward structure follow ``torchvision.models.efficientnet_b0``:
``features`` = [stem ``Conv2dNormActivation`` (SiLU), seven stages (``Sequential`` s of
``MBConv``), 1×1 head conv (SiLU)], ``avgpool``, ``torch.flatten``, ``classifier``
(``Dropout``, ``Linear``).  An ``MBConv`` 's ``block`` is [1×1 expand], depthwise,
``SqueezeExcitation`` (SiLU, Sigmoid gate: a product of two activations), 1×1 project (no
activation); with stride 1 and kept channels it adds its input after ``stochastic_depth``
(``result += input``).  Stochastic depth drops whole samples of the residual branch while
training (probability rising linearly to ``stochastic_depth_prob`` over the blocks, as
torchvision) and is the identity in eval.  ``width_mult`` / ``depth_mult`` are
torchvision's scaling knobs; small values and 32×32 inputs keep tests fast.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from qdsl.zoo.mobilenet import Conv2dNormActivation, make_divisible
from qdsl.zoo.mobilenet_v3 import SqueezeExcitation
from qdsl.zoo.resnet import seed_weights

__all__ = ["EfficientNet", "MBConv", "StochasticDepth", "efficientnet_b0"]

# torchvision's B0 stages: expansion, kernel, first stride, input channels, output channels, blocks
_B0 = [(1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
       (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1)]


class StochasticDepth(nn.Module):
    """Row-wise stochastic depth: while training, zero each sample's branch with probability ``p``
    and scale the survivors by ``1/(1-p)``; the identity in eval (and for ``p = 0``)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = (torch.rand_like(x[:, :1, :1, :1]) >= self.p).to(x.dtype) / (1.0 - self.p)
        return x * keep


class MBConv(nn.Module):
    """torchvision's EfficientNet block (see the module doc)."""

    def __init__(self, expand_ratio: int, kernel: int, stride: int, cin: int, cout: int, sd_prob: float):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        expanded = make_divisible(cin * expand_ratio, 8)
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(Conv2dNormActivation(cin, expanded, 1, activation=nn.SiLU))
        layers.append(Conv2dNormActivation(expanded, expanded, kernel, stride, groups=expanded, activation=nn.SiLU))
        layers.append(SqueezeExcitation(expanded, max(1, cin // 4), partial(nn.SiLU, inplace=True), nn.Sigmoid))
        layers.append(Conv2dNormActivation(expanded, cout, 1, activation=None))
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(sd_prob)
        self.out_channels = cout

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        result = self.block(input)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += input
        return result


class EfficientNet(nn.Module):
    """``3×H×W`` images -> ``num_classes`` logits, torchvision's ``efficientnet_b0`` layout."""

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, depth_mult: float = 1.0,
                 dropout: float = 0.2, stochastic_depth_prob: float = 0.2):
        super().__init__()

        def ch(c: int) -> int:
            return make_divisible(c * width_mult, 8)

        stages = [(t, k, s, ch(i), ch(o), int(math.ceil(n * depth_mult))) for t, k, s, i, o, n in _B0]
        total = sum(n for *_, n in stages)
        layers: list[nn.Module] = [Conv2dNormActivation(3, stages[0][3], 3, 2, activation=nn.SiLU)]
        done = 0
        for t, k, s, cin, cout, n in stages:
            stage = []
            for j in range(n):
                stage.append(MBConv(t, k, s if j == 0 else 1, cin if j == 0 else cout, cout,
                                    stochastic_depth_prob * done / total))
                done += 1
            layers.append(nn.Sequential(*stage))
        last_in = stages[-1][4]
        layers.append(Conv2dNormActivation(last_in, 4 * last_in, 1, activation=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout, inplace=True), nn.Linear(4 * last_in, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def efficientnet_b0(*, seed: int | None = 0, num_classes: int = 1000, width_mult: float = 1.0,
                    depth_mult: float = 1.0) -> EfficientNet:
    """A seeded, untrained :class:`EfficientNet` (B0) in eval mode (fan-in scaled normal weights).
    ``width_mult=0.25`` with 32×32 inputs keeps all 16 blocks at test speed."""
    model = EfficientNet(num_classes, width_mult, depth_mult)
    if seed is not None:
        seed_weights(model, seed)
    return model.eval()

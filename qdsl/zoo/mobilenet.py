"""A MobileNetV2 shaped like torchvision's, written in plain torch (no torchvision needed).

Module names and forward structure follow ``torchvision.models.mobilenet_v2``: ``features``
(a stem ``Conv2dNormActivation``, 17 ``InvertedResidual`` blocks, a 1×1 head conv; ReLU6 in
place), then
``adaptive_avg_pool2d``, ``torch.flatten`` and ``classifier`` (``Dropout``, ``Linear``).  Each
``InvertedResidual`` holds ``conv`` = [1×1 expand (ConvBN-ReLU6)], 3×3 depthwise
(ConvBN-ReLU6), 1×1 project conv, BN, and adds its input functionally
(``x + self.conv(x)``) when stride is 1 and the channel count is kept.  ``width_mult``
(torchvision's, default 1.0) shrinks it for fast tests; 32×32 inputs run.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from qdsl.zoo.resnet import seed_weights

__all__ = ["Conv2dNormActivation", "InvertedResidual", "MobileNetV2", "make_divisible", "mobilenet_v2"]

# torchvision's inverted-residual settings: expansion t, channels c, repeats n, first stride s.
_SETTINGS = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2],
             [6, 320, 1, 1]]


def make_divisible(v: float, divisor: int = 8) -> int:
    """Round a channel count to a multiple of ``divisor``, never below 90 % of ``v`` (torchvision's rule)."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class Conv2dNormActivation(nn.Sequential):
    """Conv (no bias, 'same'-style padding) -> BatchNorm -> activation (in place), as torchvision's
    ops block; ``activation=None`` leaves it out (a projection conv).  MobileNetV3 and
    EfficientNet use it too, with their own activation and BatchNorm ``eps``."""

    def __init__(self, cin: int, cout: int, kernel_size: int = 3, stride: int = 1, groups: int = 1,
                 activation: type[nn.Module] | None = nn.ReLU6, eps: float = 1e-5):
        layers = [nn.Conv2d(cin, cout, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout, eps=eps)]
        if activation is not None:
            layers.append(activation(inplace=True))
        super().__init__(*layers)


class InvertedResidual(nn.Module):
    """torchvision's ``InvertedResidual``: expand, depthwise, project; ``x + self.conv(x)`` when shapes allow."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        self.stride = stride
        hidden = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(Conv2dNormActivation(inp, hidden, kernel_size=1))
        layers += [Conv2dNormActivation(hidden, hidden, stride=stride, groups=hidden),
                   nn.Conv2d(hidden, oup, 1, bias=False), nn.BatchNorm2d(oup)]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    """``3×H×W`` images -> ``num_classes`` logits, torchvision's layout."""

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2):
        super().__init__()
        cin = make_divisible(32 * width_mult)
        self.last_channel = make_divisible(1280 * max(1.0, width_mult))
        features: list[nn.Module] = [Conv2dNormActivation(3, cin, stride=2)]
        for t, c, n, s in _SETTINGS:
            cout = make_divisible(c * width_mult)
            for i in range(n):
                features.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        features.append(Conv2dNormActivation(cin, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = F.adaptive_avg_pool2d(x, (1, 1))
        x = torch.flatten(x, 1)
        return self.classifier(x)


def mobilenet_v2(*, seed: int | None = 0, num_classes: int = 1000, width_mult: float = 1.0) -> MobileNetV2:
    """A seeded, untrained :class:`MobileNetV2` in eval mode (fan-in scaled normal weights).
    ``width_mult=0.25`` with 32×32 inputs gives the full graph (52 convs) at test speed."""
    model = MobileNetV2(num_classes, width_mult)
    if seed is not None:
        seed_weights(model, seed)
    return model.eval()

"""A MobileNetV3-small shaped like torchvision's, written in plain torch (no torchvision needed).

Module names and forward structure follow ``torchvision.models.mobilenet_v3_small``:
``features`` (a stem ``Conv2dNormActivation`` with Hardswish, 11 ``InvertedResidual`` blocks,
a 1×1 head conv with Hardswish), ``avgpool`` (``AdaptiveAvgPool2d(1)``), ``torch.flatten``,
``classifier`` (``Linear``, ``Hardswish``, ``Dropout``, ``Linear``).  Each block's ``block`` is
[1×1 expand], depthwise, [``SqueezeExcitation``], 1×1 project (no activation), and the block
adds its input in place (``result += input``) when stride is 1 and the channel count is kept.
Activations are ``ReLU``/``Hardswish(inplace=True)``; BatchNorm has ``eps=0.001``.

:class:`SqueezeExcitation` is torchvision's ops block: ``avgpool`` -> ``fc1`` (1×1 conv) ->
``activation`` -> ``fc2`` -> ``scale_activation`` -> ``scale * input``, a product of two
activations (EfficientNet uses it with SiLU and Sigmoid).  ``width_mult`` (torchvision's
``_width_mult``) shrinks the network for fast tests; 32×32 inputs run.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from qdsl.zoo.mobilenet import Conv2dNormActivation, make_divisible
from qdsl.zoo.resnet import seed_weights

__all__ = ["InvertedResidual", "MobileNetV3", "SqueezeExcitation", "mobilenet_v3_small"]

# torchvision's mobilenet_v3_small blocks: input channels, kernel, expanded channels, output
# channels, squeeze-excitation, activation (RE: ReLU, HS: Hardswish), stride
_SMALL = [
    (16, 3, 16, 16, True, "RE", 2),
    (16, 3, 72, 24, False, "RE", 2),
    (24, 3, 88, 24, False, "RE", 1),
    (24, 5, 96, 40, True, "HS", 2),
    (40, 5, 240, 40, True, "HS", 1),
    (40, 5, 240, 40, True, "HS", 1),
    (40, 5, 120, 48, True, "HS", 1),
    (48, 5, 144, 48, True, "HS", 1),
    (48, 5, 288, 96, True, "HS", 2),
    (96, 5, 576, 96, True, "HS", 1),
    (96, 5, 576, 96, True, "HS", 1),
]
_EPS = 0.001


class SqueezeExcitation(nn.Module):
    """Channel attention: global average -> 1×1 conv -> activation -> 1×1 conv -> gate, times the input."""

    def __init__(self, input_channels: int, squeeze_channels: int,
                 activation: Callable[[], nn.Module] = nn.ReLU, scale_activation: Callable[[], nn.Module] = nn.Sigmoid):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(input_channels, squeeze_channels, 1)
        self.fc2 = nn.Conv2d(squeeze_channels, input_channels, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(input)))))
        return scale * input


class InvertedResidual(nn.Module):
    """torchvision's MobileNetV3 block (see the module doc)."""

    def __init__(self, cin: int, kernel: int, expanded: int, cout: int, use_se: bool, act: str, stride: int):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        activation = nn.Hardswish if act == "HS" else nn.ReLU
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(Conv2dNormActivation(cin, expanded, 1, activation=activation, eps=_EPS))
        layers.append(Conv2dNormActivation(expanded, expanded, kernel, stride, groups=expanded,
                                           activation=activation, eps=_EPS))
        if use_se:
            layers.append(SqueezeExcitation(expanded, make_divisible(expanded // 4, 8), nn.ReLU, nn.Hardsigmoid))
        layers.append(Conv2dNormActivation(expanded, cout, 1, activation=None, eps=_EPS))
        self.block = nn.Sequential(*layers)
        self.out_channels = cout

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        result = self.block(input)
        if self.use_res_connect:
            result += input
        return result


class MobileNetV3(nn.Module):
    """``3×H×W`` images -> ``num_classes`` logits, torchvision's ``mobilenet_v3_small`` layout."""

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2):
        super().__init__()

        def ch(c: int) -> int:
            return make_divisible(c * width_mult, 8)

        blocks = [(ch(i), k, ch(e), ch(o), se, a, s) for i, k, e, o, se, a, s in _SMALL]
        layers: list[nn.Module] = [Conv2dNormActivation(3, blocks[0][0], 3, 2, activation=nn.Hardswish, eps=_EPS)]
        layers += [InvertedResidual(*b) for b in blocks]
        last_in = blocks[-1][3]
        layers.append(Conv2dNormActivation(last_in, 6 * last_in, 1, activation=nn.Hardswish, eps=_EPS))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        last_channel = ch(1024)
        self.classifier = nn.Sequential(nn.Linear(6 * last_in, last_channel), nn.Hardswish(inplace=True),
                                        nn.Dropout(p=dropout, inplace=True), nn.Linear(last_channel, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v3_small(*, seed: int | None = 0, num_classes: int = 1000, width_mult: float = 1.0) -> MobileNetV3:
    """A seeded, untrained :class:`MobileNetV3` (small) in eval mode (fan-in scaled normal weights).
    ``width_mult=0.25`` with 32×32 inputs keeps every block (9 squeeze-excitations) at test speed."""
    model = MobileNetV3(num_classes, width_mult)
    if seed is not None:
        seed_weights(model, seed)
    return model.eval()

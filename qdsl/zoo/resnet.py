"""A ResNet-18 shaped like torchvision's, written in plain torch (no torchvision needed).

Module names, layer shapes and forward structure follow ``torchvision.models.resnet18``
(``conv1``, ``bn1``, ``relu``, ``maxpool``, ``layer1..4`` of ``BasicBlock`` s with
``downsample`` = 1×1 conv + BN, ``avgpool``, ``fc``; ``ReLU(inplace=True)``; the residual
``out += identity`` is a functional in-place add), so a spec written for the torchvision
model matches this one and timings (calibration, range search) are representative of a
real ImageNet-sized network: 11.7M parameters, 3×224×224 input.  Weights are seeded
(fan-in scaled normals), not trained.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ResNet18Block", "ResNet18", "resnet18"]


class ResNet18Block(nn.Module):
    """torchvision's ``BasicBlock``: conv-bn-relu-conv-bn, ``+= identity``, relu."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """``3×224×224`` images -> ``num_classes`` logits, torchvision's layout."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, 1)
        self.layer2 = self._make_layer(128, 2)
        self.layer3 = self._make_layer(256, 2)
        self.layer4 = self._make_layer(512, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)

    def _make_layer(self, planes: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes))
        blocks = [ResNet18Block(self.inplanes, planes, stride, downsample), ResNet18Block(planes, planes)]
        self.inplanes = planes
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(*, seed: int | None = 0, num_classes: int = 1000) -> ResNet18:
    """A seeded, untrained :class:`ResNet18` in eval mode (weights: normal, std sqrt(2/fan_in))."""
    model = ResNet18(num_classes)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=g) * (2.0 / p[0].numel()) ** 0.5)
                elif name.endswith("bias") and "bn" not in name and "downsample" not in name:
                    p.zero_()
    return model.eval()

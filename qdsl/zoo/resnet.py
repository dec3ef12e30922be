"""ResNet-18 and ResNet-50 shaped like torchvision's, written in plain torch (no torchvision needed).

Module names, layer shapes and forward structure follow ``torchvision.models.resnet18``
(``conv1``, ``bn1``, ``relu``, ``maxpool``, ``layer1..4`` of ``BasicBlock`` s with
``downsample`` = 1×1 conv + BN, ``avgpool``, ``fc``; ``ReLU(inplace=True)``; the residual
``out += identity`` is a functional in-place add), so a spec written for the torchvision
model matches this one and timings (calibration, range search) are representative of a
real ImageNet-sized network: 11.7M parameters, 3×224×224 input.  Weights are seeded
(fan-in scaled normals), not trained.  ``resnet50`` is torchvision's ``resnet50`` the same
way (``Bottleneck`` blocks, ``conv1..3``/``bn1..3``).  ``width`` (stem channels, default 64)
shrinks either for fast tests; any input of at least 32×32 runs.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "ResNet18Block", "ResNet18", "resnet18", "resnet50"]


class BasicBlock(nn.Module):
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


# The block's old name; a spec's ``type:BasicBlock`` rule matches it under either name.
ResNet18Block = BasicBlock


class Bottleneck(nn.Module):
    """torchvision's ``Bottleneck`` (ResNet-50/101/152, v1.5: the stride sits on the 3×3 conv):
    1×1 reduce, 3×3, 1×1 expand (×4), ``+= identity``, relu."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """``3×H×W`` images -> ``num_classes`` logits, torchvision's layout.  ``width`` is the stem's
    channel count (torchvision: 64); each stage doubles it."""

    def __init__(self, block: type[nn.Module], layers: list[int], num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0], 1)
        self.layer2 = self._make_layer(block, width * 2, layers[1], 2)
        self.layer3 = self._make_layer(block, width * 4, layers[2], 2)
        self.layer4 = self._make_layer(block, width * 8, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)

    def _make_layer(self, block: type[nn.Module], planes: int, n: int, stride: int) -> nn.Sequential:
        downsample = None
        out = planes * block.expansion
        if stride != 1 or self.inplanes != out:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, out, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(out))
        blocks = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = out
        blocks += [block(out, planes) for _ in range(n - 1)]
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ResNet18(ResNet):
    """torchvision's ``resnet18`` layout (``BasicBlock`` × [2, 2, 2, 2])."""

    def __init__(self, num_classes: int = 1000, width: int = 64):
        super().__init__(BasicBlock, [2, 2, 2, 2], num_classes, width)


def seed_weights(model: nn.Module, seed: int) -> None:
    """Fan-in scaled normal weights (std sqrt(2/fan_in)), zero layer biases, BN left at identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * (2.0 / p[0].numel()) ** 0.5)
            elif name.endswith("bias") and "bn" not in name and "downsample" not in name:
                p.zero_()


def resnet18(*, seed: int | None = 0, num_classes: int = 1000, width: int = 64) -> ResNet18:
    """A seeded, untrained :class:`ResNet18` in eval mode (weights: normal, std sqrt(2/fan_in)).
    A small ``width`` (e.g. 8) gives the same graph at a fraction of the cost, for tests."""
    model = ResNet18(num_classes, width)
    if seed is not None:
        seed_weights(model, seed)
    return model.eval()


def resnet50(*, seed: int | None = 0, num_classes: int = 1000, width: int = 64) -> ResNet:
    """A seeded, untrained torchvision-shaped ResNet-50 (``Bottleneck`` × [3, 4, 6, 3]) in eval mode."""
    model = ResNet(Bottleneck, [3, 4, 6, 3], num_classes, width)
    if seed is not None:
        seed_weights(model, seed)
    return model.eval()

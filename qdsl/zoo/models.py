"""Reference networks written in plain torch (no torchvision), used across qdsl.

* :class:`ConvBnReluNet`  - conv-bn-relu ×3 + global pool + linear (benchmarks, QAT).
* :class:`DigitsResNet`   - a small ResNet-style CNN with residual blocks for 1×8×8 digits.
* :class:`Conv1dNet`      - a Conv1d keyword-spotting-like net with BN (hardware users).
* :class:`MLP`            - linear layers only.
* :class:`TvStyleNet`     - a torchvision-style ReLU CNN (``ReLU(inplace=True)``, a max pool)
  for 1×8×8 digits, as users write them (xnor-binary's learned thresholds are for these).

Every factory takes keyword arguments only and builds deterministic weights when
``seed`` is given, so ``--model qdsl.zoo.models:digits_resnet`` works from the CLI.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

__all__ = [
    "ConvBnReluNet",
    "BasicBlock",
    "DigitsResNet",
    "Conv1dNet",
    "MLP",
    "TvStyleNet",
    "conv_bn_relu_net",
    "digits_binary_cnn",
    "digits_resnet",
    "conv1d_net",
    "mlp",
    "binary_mlp",
    "tv_style_net",
]


_ACTIVATIONS = {"relu": nn.ReLU, "hardtanh": nn.Hardtanh}


class ConvBnReluNet(nn.Module):
    """``in_ch×H×W`` images -> ``num_classes`` logits: (conv3x3-bn-act) ×3, GAP, linear.

    ``activation="hardtanh"`` is the variant for binary networks: a signed binary
    activation is ``sign(x)`` with ``sign(0) = +1``, so after a ReLU every code would be
    +1 and the binary layers would see a constant input.
    """

    def __init__(self, in_ch: int = 3, width: int = 32, num_classes: int = 10, activation: str = "relu"):
        super().__init__()
        act = _ACTIVATIONS[activation]
        self.features = nn.Sequential(
            nn.Conv2d(in_ch, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            act(),
            nn.Conv2d(width, width * 2, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(width * 2),
            act(),
            nn.Conv2d(width * 2, width * 2, 3, padding=1, bias=False),
            nn.BatchNorm2d(width * 2),
            act(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(width * 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


class BasicBlock(nn.Module):
    """ResNet basic block: conv-bn-relu-conv-bn, plus identity (or 1×1 downsample), relu."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + identity)


class DigitsResNet(nn.Module):
    """A ResNet-style CNN for ``1×8×8`` images (sklearn digits): stem, 2 stages, GAP, linear."""

    def __init__(self, width: int = 16, num_classes: int = 10, in_ch: int = 1):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_ch, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, width * 2, stride=2), BasicBlock(width * 2, width * 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class Conv1dNet(nn.Module):
    """``in_ch×T`` sequences -> logits: (conv1d-bn-relu) ×3 with strides, GAP, linear."""

    def __init__(self, in_ch: int = 1, width: int = 16, num_classes: int = 4):
        super().__init__()
        layers = []
        ch = in_ch
        for i, (out, k, s) in enumerate([(width, 5, 2), (width * 2, 3, 2), (width * 2, 3, 1)]):
            layers += [nn.Conv1d(ch, out, k, stride=s, padding=k // 2, bias=False), nn.BatchNorm1d(out), nn.ReLU()]
            ch = out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.classifier = nn.Linear(ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


class MLP(nn.Module):
    """Flatten, then linear-activation layers (``activation="hardtanh"`` for binary nets)."""

    def __init__(self, sizes: tuple[int, ...] = (64, 64, 32, 10), activation: str = "relu"):
        super().__init__()
        act = _ACTIVATIONS[activation]
        layers: list[nn.Module] = [nn.Flatten()]
        for i in range(len(sizes) - 1):
            layers.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i < len(sizes) - 2:
                layers.append(act())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TvStyleNet(nn.Module):
    """conv-BN-ReLU(inplace), max pool, (conv-BN-ReLU(inplace)) ×2, GAP, linear (1×8×8 in)."""

    def __init__(self, width: int = 32, num_classes: int = 10, in_ch: int = 1):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_ch, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(inplace=True),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(self.features(x)), 1))


def _seeded(model: nn.Module, seed: int | None) -> nn.Module:
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                # kernels: scaled normal (fan-in); 1-D (biases; BN is set below): small normal,
                # so the whole model depends on ``seed`` alone, not on torch's global RNG
                fan_in = p[0].numel() if p.dim() > 1 else 1
                std = (0.5 / fan_in) ** 0.5 if p.dim() > 1 else 0.01
                p.copy_(torch.randn(p.shape, generator=g) * std)
            for m in model.modules():
                if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                    m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                    m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                    m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                    m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model


def conv_bn_relu_net(*, seed: int | None = 0, **kw) -> ConvBnReluNet:
    return _seeded(ConvBnReluNet(**kw), seed).eval()


def digits_binary_cnn(*, seed: int | None = 0, width: int = 32) -> ConvBnReluNet:
    """ConvBnReluNet for 1×8×8 digits with Hardtanh activations (binary-friendly)."""
    return _seeded(ConvBnReluNet(in_ch=1, width=width, num_classes=10, activation="hardtanh"), seed).eval()


def digits_resnet(*, seed: int | None = 0, **kw) -> DigitsResNet:
    return _seeded(DigitsResNet(**kw), seed).eval()


def conv1d_net(*, seed: int | None = 0, **kw) -> Conv1dNet:
    return _seeded(Conv1dNet(**kw), seed).eval()


def mlp(*, seed: int | None = 0, **kw) -> MLP:
    return _seeded(MLP(**kw), seed).eval()


def binary_mlp(*, seed: int | None = 0, **kw) -> MLP:
    """MLP with Hardtanh activations: signed binary activations need signed inputs."""
    return _seeded(MLP(activation="hardtanh", **kw), seed).eval()


def tv_style_net(*, seed: int | None = 0, **kw) -> TvStyleNet:
    return _seeded(TvStyleNet(**kw), seed).eval()

"""A small U-Net written in plain torch: the encoder-decoder shape segmentation models share.

``inc`` (a ``DoubleConv``: conv3×3-BN-ReLU twice), ``down1..down{depth}`` (``MaxPool2d(2)`` then a
``DoubleConv``), ``up{depth}..up1`` (``ConvTranspose2d`` k2 s2 halving the channels,
``torch.cat([skip, up], dim=1)`` with the encoder's feature map at that size, a ``DoubleConv``),
and ``outc`` (a 1×1 conv to ``num_classes`` per-pixel logits).  ``ReLU(inplace=True)``.
``width`` is the first stage's channel count (each level doubles it); inputs need sides
divisible by ``2**depth`` (no padding of odd sizes).  It exports with every bundled CNN spec
(ConvTranspose2d lowers to CONV_TRANSPOSE2D, binary ones included).
"""

from __future__ import annotations

import torch
from torch import nn

from qdsl.zoo.resnet import seed_weights

__all__ = ["DoubleConv", "Down", "UNet", "Up", "unet"]


class DoubleConv(nn.Sequential):
    """(conv3×3 -> BN -> ReLU) × 2."""

    def __init__(self, cin: int, cout: int):
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Down(nn.Sequential):
    """Max pool by 2, then a :class:`DoubleConv`."""

    def __init__(self, cin: int, cout: int):
        super().__init__(nn.MaxPool2d(2), DoubleConv(cin, cout))


class Up(nn.Module):
    """Transposed conv ×2 up, concatenate the skip, :class:`DoubleConv`."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
        self.conv = DoubleConv(cin // 2 + cout, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    """``in_channels×H×W`` -> ``num_classes×H×W`` logits."""

    def __init__(self, in_channels: int = 3, num_classes: int = 2, width: int = 64, depth: int = 4):
        super().__init__()
        self.depth = depth
        chans = [width * 2**i for i in range(depth + 1)]
        self.inc = DoubleConv(in_channels, chans[0])
        for i in range(1, depth + 1):
            self.add_module(f"down{i}", Down(chans[i - 1], chans[i]))
        for i in range(depth, 0, -1):
            self.add_module(f"up{i}", Up(chans[i], chans[i - 1]))
        self.outc = nn.Conv2d(chans[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.inc(x)]
        for i in range(1, self.depth + 1):
            skips.append(getattr(self, f"down{i}")(skips[-1]))
        x = skips.pop()
        for i in range(self.depth, 0, -1):
            x = getattr(self, f"up{i}")(x, skips.pop())
        return self.outc(x)


def unet(*, seed: int | None = 0, in_channels: int = 3, num_classes: int = 2, width: int = 64,
         depth: int = 4) -> UNet:
    """A seeded, untrained :class:`UNet` in eval mode; ``width=4, depth=2`` on 16×16 inputs for tests."""
    model = UNet(in_channels, num_classes, width, depth)
    if seed is not None:
        seed_weights(model, seed)
    return model.eval()

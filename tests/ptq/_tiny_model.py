"""A tiny model and data loader that ``qdsl explain --data`` tests load by file path."""

import torch
from torch import nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(2, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 8, 3)).eval()


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 2, 8, generator=g)
    y = torch.randint(0, 3, (128,), generator=g)
    return x, y, x[:16], y[:16]

"""Tiny model and data references for the sensitivity CLI tests (loaded by file path)."""

import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 16, 3)

    def forward(self, x):
        x = torch.relu(self.c1(x))
        x = torch.relu(self.c2(x))
        return self.fc(x.flatten(1))


def tiny():
    torch.manual_seed(0)
    return Tiny().eval()


def tiny_data():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(96, 1, 4, 4, generator=g)
    with torch.no_grad():
        y = tiny()(x).argmax(1)  # the float model is right by construction
    return x[:64], y[:64], x[64:], y[64:]


def not_data():
    return 42

"""Small torchvision-shaped models for the tests (``qdsl lint --model tests/export/tv_models.py:NAME``)."""

from qdsl.zoo.efficientnet import efficientnet_b0
from qdsl.zoo.mobilenet import mobilenet_v2
from qdsl.zoo.mobilenet_v3 import mobilenet_v3_small
from qdsl.zoo.resnet import resnet18, resnet50
from qdsl.zoo.unet import unet

__all__ = ["FACTORIES", "MUL_FACTORIES", "random_images", "random_masks", "small_efficientnet_b0", "small_mobilenet_v2",
           "small_mobilenet_v3_small", "small_resnet18", "small_resnet50", "small_unet",
           "softmax_classifier", "swish_classifier"]


def small_resnet18():
    return resnet18(seed=0, width=8, num_classes=10)


def small_resnet50():
    return resnet50(seed=0, width=8, num_classes=10)


def small_mobilenet_v2():
    return mobilenet_v2(seed=0, width_mult=0.25, num_classes=10)


def small_mobilenet_v3_small():
    return mobilenet_v3_small(seed=0, width_mult=0.25, num_classes=10)


def small_efficientnet_b0():
    return efficientnet_b0(seed=0, width_mult=0.25, num_classes=10)


def small_unet():
    return unet(seed=0, width=4, depth=2)


FACTORIES = {"resnet18": small_resnet18, "resnet50": small_resnet50, "mobilenet_v2": small_mobilenet_v2,
             "unet": small_unet}
"""Models whose every op exports today (the U-Net takes 16×16 inputs, the others 32×32)."""
MUL_FACTORIES = {"mobilenet_v3_small": small_mobilenet_v3_small, "efficientnet_b0": small_efficientnet_b0}
"""Models with squeeze-excitation (a product of two activations): no integer MUL yet (issue 17)."""


def mean_classifier():
    """A small CNN that pools with ``torch.mean``, an op the integer graph has no lowering for."""
    import torch
    from torch import nn

    class MeanClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.relu = nn.ReLU(inplace=True)
            self.fc = nn.Linear(8, 10)

        def forward(self, x):
            return self.fc(torch.mean(self.relu(self.conv(x)), dim=(2, 3)))

    torch.manual_seed(0)
    return MeanClassifier()


def random_images():
    """``(x_train, y_train, x_test, y_test)``: 16 + 8 seeded 3×32×32 images, 10 classes (for ``qdsl sweep``)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (24,), generator=g)
    return x[:16], y[:16], x[16:], y[16:]


def random_masks():
    """``(x_train, y_train, x_test, y_test)`` for :func:`small_unet`: 16 + 8 seeded 3×16×16 images
    with per-pixel labels in {0, 1} (accuracy is per pixel)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 3, 16, 16, generator=g)
    y = (x[:, 0] > 0).long()
    return x[:16], y[:16], x[16:], y[16:]


def swish_classifier():
    """``fc2(y * torch.sigmoid(y))``: the function's result has no module to carry the
    quantizer the product needs, so export refuses it (and lint says so: W321)."""
    import torch
    from torch import nn

    class SwishClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            y = self.fc1(x)
            return self.fc2(y * torch.sigmoid(y))

    return SwishClassifier()

"""GPTQ's im2col view of a layer's input, for the paddings real models use, and clean
errors (QdslError, not ValueError/TypeError) for what it cannot express."""

import pytest
import torch
from torch import nn

import qdsl
from qdsl.ptq.gptq import unfold_inputs
from qdsl.spec.diagnostics import QdslError


@pytest.mark.parametrize("conv", [
    nn.Conv2d(4, 6, 3, padding="same"),
    nn.Conv2d(4, 6, 3, padding="valid"),
    nn.Conv2d(4, 6, (3, 5), padding="same", dilation=2),
    nn.Conv1d(4, 6, 5, padding="same"),
    nn.Conv2d(4, 6, 3, padding=1, groups=2),
])
def test_unfold_reproduces_the_conv(conv):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 7) if isinstance(conv, nn.Conv1d) else torch.randn(2, 4, 7, 9)
    cols = unfold_inputs(conv, x)  # [groups, d, n]
    g = conv.groups
    w = conv.weight.reshape(g, conv.out_channels // g, -1)
    y = torch.cat([w[i] @ cols[i] for i in range(g)])  # [cout, N·L]
    ref = (conv(x) - conv.bias.reshape(1, -1, *([1] * (x.dim() - 2)))).transpose(0, 1).reshape(conv.out_channels, -1)
    assert torch.allclose(y, ref, atol=1e-5)


def test_unsupported_layers_are_qdsl_errors():
    with pytest.raises(QdslError, match="even kernel"):
        unfold_inputs(nn.Conv2d(2, 2, 2, padding="same"), torch.randn(1, 2, 4, 4))
    with pytest.raises(QdslError, match="padding_mode"):
        unfold_inputs(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), torch.randn(1, 2, 4, 4))
    with pytest.raises(QdslError, match="Linear, Conv1d and Conv2d"):
        unfold_inputs(nn.ConvTranspose2d(2, 2, 3), torch.randn(1, 2, 4, 4))


def test_resolve_against_a_non_module_is_a_qdsl_error():
    with pytest.raises(QdslError, match="nn.Module"):
        qdsl.resolve(42, "specs/int8-default.qspec")
    with pytest.raises(QdslError, match="QuantSpec"):
        qdsl.resolve(nn.Linear(2, 2), 3.5)

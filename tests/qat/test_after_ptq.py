"""QAT after a PTQ pass with bias correction / learned rounding starts from clean proxies."""

import torch

import qdsl
import qdsl.qat
from qdsl.spec.model import Role
from qdsl.zoo.models import digits_resnet


def test_prepare_qat_drops_ptq_offsets_and_fixed_codes():
    model = digits_resnet()
    x = torch.rand(32, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    handle = qdsl.apply(model, "specs/low-bit.qspec")  # bias_correction = true
    qdsl.calibrate(model, [x], progress=False)
    quantizers = handle.container.quantizers.values()
    assert any(q.offset.numel() for q in quantizers)  # bias correction left offsets
    w = handle.quantizer("layer1.0.conv1", Role.WEIGHT)
    w.set_codes(w.int_repr(handle.layers["layer1.0.conv1"].float_params()[0]).to(torch.int64))
    qdsl.qat.prepare_qat(model)
    assert not any(q.offset.numel() or q.codes.numel() for q in quantizers)
    # the weight gradient flows again once the fixed codes are gone
    model.train()
    model(x).sum().backward()
    master = handle.layers["layer1.0.conv1"].master("weight")
    assert master.grad is not None and master.grad.abs().sum() > 0

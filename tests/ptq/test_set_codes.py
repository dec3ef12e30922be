"""Learned-rounding codes reach ``module.weight``, the frozen record and export at once.

``TensorQuantizer.set_codes`` used to change only the proxy: ``module.weight`` kept the old
fake-quantized value until the layer's next forward, and after ``qdsl.freeze`` the frozen
record (``qdsl.patch.frozen``, which export reads) was keyed on the scales alone, so codes
set then reached the fake-quant forward but not the graph."""

import numpy as np
import torch

import qdsl
from qdsl.graph import execute
from qdsl.patch.frozen import frozen_layer
from qdsl.spec.model import Role
from qdsl.zoo.models import digits_resnet

LAYER = "layer1.0.conv1"


def _calibrated():
    model = digits_resnet()
    x = torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    handle = qdsl.apply(model, "specs/low-bit.qspec", overrides=["learned_rounding=none", "bias_correction=false"])
    qdsl.calibrate(model, [x], progress=False)
    return model, handle, x


def _moved_codes(wq, w):
    """Nearest codes with every other code moved by one step (staying in range)."""
    q = wq.int_repr(w).to(torch.int64)
    flat = q.flatten().clone()
    flat[::2] = torch.where(flat[::2] < wq.qmax, flat[::2] + 1, flat[::2] - 1)
    return flat.reshape(q.shape)


def _dequantized(wq, codes):
    # low-bit's weights are symmetric (zero point 0), per output channel
    s = wq.scale.reshape(-1, *([1] * (codes.dim() - 1))) if wq.scale.numel() > 1 else wq.scale
    return codes.to(torch.float32) * s


def test_set_codes_shows_in_module_weight_at_once():
    model, handle, _ = _calibrated()
    patch, wq = handle.layers[LAYER], handle.quantizer(LAYER, Role.WEIGHT)
    w, _ = patch.float_params()
    codes = _moved_codes(wq, w)
    wq.set_codes(codes)
    conv = model.get_submodule(LAYER)
    # no forward in between: module.weight is the new codes' value already
    assert torch.equal(conv.weight, wq(w.detach()))
    qdsl.freeze(model)
    assert torch.equal(conv.weight, _dequantized(wq, codes))


def test_codes_set_after_freeze_reach_the_graph():
    model, handle, x = _calibrated()
    qdsl.freeze(model)
    patch, wq = handle.layers[LAYER], handle.quantizer(LAYER, Role.WEIGHT)
    w, _ = patch.float_params()
    assert torch.equal(frozen_layer(patch).weight_codes.to(torch.int64), wq.int_repr(w).to(torch.int64))
    codes = _moved_codes(wq, w)
    wq.set_codes(codes)
    assert torch.equal(frozen_layer(patch).weight_codes.to(torch.int64), codes)
    assert torch.equal(model.get_submodule(LAYER).weight, _dequantized(wq, codes))
    graph = qdsl.export(model, x[:2])
    weights = {t.name: t for t in graph.tensors}[f"{LAYER}.weight"]
    np.testing.assert_array_equal(np.asarray(weights.data).reshape(codes.shape), codes.numpy())
    # and the fake-quant model still agrees with the graph it exports
    seen = []
    h = model.get_submodule("fc").register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(x)
    h.remove()
    fc_in = next(op for op in graph.ops if op.name == "fc").inputs[0]
    got = execute(graph, x.numpy(), keep_values=True).values[fc_in].astype(np.int64)
    fq = handle.quantizer("fc", Role.INPUT).int_repr(seen[0]).numpy().astype(np.int64)
    assert np.abs(got.reshape(fq.shape) - fq).max() <= 1

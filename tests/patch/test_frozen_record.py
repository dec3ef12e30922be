"""The frozen per-layer record (qdsl/patch/frozen.py): freeze produces it, export,
int_tensors and lint read that one record, and an edit after freeze yields a fresh one."""

import numpy as np
import torch
from torch import nn

import qdsl
from qdsl.export import export
from qdsl.lint.calibrated import layer_ints
from qdsl.patch import get_handle
from qdsl.patch.frozen import frozen_layer
from patch_helpers import spec

POT_W = """
version 1
defaults {
  weight = pot(bits=3, per_channel, observer=minmax)
  input = int(bits=8, signed, symmetric, scale=pot, observer=minmax)
}
"""


def _frozen(text=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3)).eval()
    qdsl.apply(model, spec(text) if text else spec())
    qdsl.calibrate(model, [torch.randn(8, 3, 4) for _ in range(2)], progress=False)
    qdsl.freeze(model)
    return model


def test_freeze_produces_one_record_that_every_reader_shares():
    model = _frozen()
    handle = get_handle(model)
    records = {fqn: p.__dict__.get("_frozen_record") for fqn, p in handle.layers.items()}
    assert all(r is not None for r in records.values())  # produced by freeze itself
    for fqn, patch in handle.layers.items():
        rec = frozen_layer(patch)
        assert rec is records[fqn][1]  # read, not recomputed
        ints = qdsl.int_tensors(model)[fqn]
        assert torch.equal(ints.weight, rec.weight_codes)
        assert torch.equal(ints.weight_scale, rec.weight_scale)
        ints.weight.add_(1)  # callers get copies: the record stays as freeze made it
        assert not torch.equal(ints.weight, rec.weight_codes)
    lint = layer_ints(model)
    graph = export(model, torch.randn(1, 3, 4))
    for fqn in ("1", "3"):
        codes, _ = frozen_layer(handle.layers[fqn]).weight_grid()
        assert np.array_equal(lint[fqn].weight, codes)
        assert np.array_equal(graph.tensor(f"{fqn}.weight").data, codes)


def test_an_edit_after_freeze_gives_a_fresh_record():
    model = _frozen()
    patch = get_handle(model).layers["1"]
    before = frozen_layer(patch)
    with torch.no_grad():
        patch.master("weight").mul_(-1)  # in place: bumps the tensor's version
    after = frozen_layer(patch)
    assert after is not before
    assert torch.equal(after.weight_codes, -before.weight_codes)
    graph = export(model, torch.randn(1, 3, 4))
    assert np.array_equal(graph.tensor("1.weight").data, after.weight_codes.numpy())


def test_pot_weights_on_the_smallest_step_grid_for_export_and_lint():
    model = _frozen(POT_W)
    rec = frozen_layer(get_handle(model).layers["1"])
    assert rec.weight_format.name == "pot" and rec.weight_bits == 3
    codes, scale = rec.weight_grid()
    raw = rec.weight_codes.numpy().astype(np.int64)
    assert set(np.unique(raw)) <= {-3, -2, -1, 0, 1, 2, 3}
    assert np.array_equal(codes, np.sign(raw) * np.where(raw != 0, 2 ** np.maximum(np.abs(raw) - 1, 0), 0))
    # same real values: code c at scale s is sign(c)·s·2^(|c|-n), n = 3
    s = rec.weight_scale.double().reshape(-1, 1).numpy()
    assert np.allclose(codes * scale.reshape(-1, 1), np.sign(raw) * s * 2.0 ** (np.abs(raw) - 3.0) * (raw != 0))
    assert np.array_equal(layer_ints(model)["1"].weight, codes)

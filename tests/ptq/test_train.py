"""The float training harness (qdsl.zoo.train): learns, is seeded, and caches."""

import pytest
import torch

from qdsl.zoo.models import mlp
from qdsl.zoo.train import evaluate, train_float, trained_conv1d_net, trained_digits_resnet


def _mlp(sizes):
    torch.manual_seed(0)  # mlp(seed=) seeds the weights; the biases use the global RNG
    return mlp(sizes=sizes)


def _toy(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 1, 8, 8, generator=g)
    y = (x.flatten(1)[:, :4].sum(1) > 0).long() + 2 * (x.flatten(1)[:, 4:8].sum(1) > 0).long()
    return x, y


def test_train_learns_is_deterministic_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("QDSL_TRAIN_CACHE", str(tmp_path))
    x, y = _toy()
    before = evaluate(_mlp((64, 32, 4)), x, y)
    a = train_float(_mlp((64, 32, 4)), x, y, epochs=15, lr=0.01, seed=1, cache=False)
    b = train_float(_mlp((64, 32, 4)), x, y, epochs=15, lr=0.01, seed=1)
    assert evaluate(a, x, y) > max(0.9, before + 0.3)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert len(list(tmp_path.glob("MLP-*.pt"))) == 1
    # a second call loads the cached weights (no training: the optimizer never runs)
    monkeypatch.setattr(torch.optim, "Adam", None)
    c = train_float(_mlp((64, 32, 4)), x, y, epochs=15, lr=0.01, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(b.state_dict().values(), c.state_dict().values()))
    assert not c.training


def test_cache_key_depends_on_hyperparameters(tmp_path, monkeypatch):
    monkeypatch.setenv("QDSL_TRAIN_CACHE", str(tmp_path))
    x, y = _toy()
    train_float(_mlp((64, 4)), x, y, epochs=1, seed=0)
    train_float(_mlp((64, 4)), x, y, epochs=1, seed=1)
    train_float(_mlp((64, 4)), x[:128], y[:128], epochs=1, seed=0)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert len(list(tmp_path.glob("MLP-*.pt"))) == 3


@pytest.mark.slow
def test_reference_models_reach_their_accuracy():
    model, (_, _, xt, yt) = trained_digits_resnet()
    assert evaluate(model, xt, yt) >= 0.985
    model, (_, _, xt, yt) = trained_conv1d_net()
    assert evaluate(model, xt, yt) >= 0.8

"""A small, fast, seeded float training harness for the reference models.

* :func:`train_float` trains a model in place (Adam, one-cycle learning rate, label
  smoothing 0) and returns it in eval mode.  Same inputs + seed -> same weights on one
  machine/torch version.  Results are cached on disk (``$QDSL_TRAIN_CACHE``, default
  ``<tempdir>/qdsl-train-cache``) keyed by everything that determines them: the model
  class, its initial ``state_dict``, the data, the hyper-parameters and the torch
  version; pass ``cache=False`` to always train.
* :func:`evaluate` returns top-1 accuracy as a fraction in [0, 1].
* :func:`trained_digits_resnet` / :func:`trained_conv1d_net` build, train (or load)
  and return ``(model, data)`` for the two PTQ reference tasks, so tests, examples and
  benchmarks share one trained model.

The digits ResNet reaches 100% test accuracy (seed 0, 30 epochs); training took 71 s on
one thread of a 2-core machine shared at load average 6 (``qdsl demo``, README).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from qdsl.qat.loop import train_epochs

__all__ = ["train_float", "evaluate", "predict", "trained_digits_resnet", "trained_conv1d_net"]


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            t = part.detach().contiguous().cpu()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(part, dict):
            for k in sorted(part):
                h.update(k.encode())
                h.update(_digest(part[k]).encode())
        else:
            h.update(repr(part).encode())
    return h.hexdigest()[:24]


def _cache_dir() -> Path:
    return Path(os.environ.get("QDSL_TRAIN_CACHE") or Path(tempfile.gettempdir()) / "qdsl-train-cache")


def train_float(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int = 20,
    lr: float = 0.01,
    seed: int = 0,
    *,
    batch_size: int = 64,
    weight_decay: float = 1e-4,
    cache: bool = True,
    progress: Callable[[int, int, int, float], None] | None = None,
) -> nn.Module:
    """Train ``model`` (classification, cross-entropy) on ``(x, y)``; returns it in eval mode.

    ``progress(epoch, step, steps_per_epoch, loss)`` is called after every optimizer step
    (not at all when the result comes from the cache), e.g.
    :class:`qdsl.workflows.progress.TrainProgress`.
    """
    # repr(model) covers parameter-free modules (ReLU vs Hardtanh) that state_dict misses
    key = _digest(type(model).__qualname__, repr(model), model.state_dict(), x, y, epochs, lr, seed, batch_size,
                  weight_decay, torch.__version__)
    path = _cache_dir() / f"{type(model).__name__}-{key}.pt"
    if cache and path.is_file():
        try:
            model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            return model.eval()
        except Exception:  # a stale or truncated cache file: retrain and overwrite it
            pass
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout-free models, but keep any stochastic layer seeded
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps = epochs * ((len(x) + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(steps, 1))
    train_epochs(model, x, y, opt, sched, epochs=epochs, batch_size=batch_size, generator=g, progress=progress)
    model.eval()
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, path)  # atomic: concurrent test runs never read half a file
    return model


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """Logits of ``model`` on ``x``, in batches."""
    return torch.cat([model(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> float:
    """Top-1 accuracy of ``model`` on ``(x, y)``, a fraction in [0, 1]."""
    was_training = model.training
    model.eval()
    try:
        return float((predict(model, x, batch_size).argmax(1) == y).float().mean())
    finally:
        model.train(was_training)


def trained_digits_resnet(seed: int = 0, epochs: int = 30, cache: bool = True, progress=None):
    """``(model, (x_train, y_train, x_test, y_test))``: DigitsResNet trained on digits
    (``progress``: see :func:`train_float`)."""
    from qdsl.zoo.data import digits
    from qdsl.zoo.models import digits_resnet

    data = digits(seed=seed)
    # the factories seed only the >1-D parameters; biases come from torch's global RNG
    torch.manual_seed(seed)
    model = train_float(digits_resnet(seed=seed), data[0], data[1], epochs=epochs, lr=0.005, seed=seed,
                        batch_size=32, cache=cache, progress=progress)
    return model, data


def trained_conv1d_net(seed: int = 0, epochs: int = 12, cache: bool = True):
    """``(model, (x_train, y_train, x_test, y_test))``: Conv1dNet on synthetic keywords
    (2,000 sequences, the last 500 held out)."""
    from qdsl.zoo.data import synthetic_keywords
    from qdsl.zoo.models import conv1d_net

    x, y = synthetic_keywords(seed=seed)
    data = (x[:1500], y[:1500], x[1500:], y[1500:])
    torch.manual_seed(seed)
    model = train_float(conv1d_net(seed=seed), data[0], data[1], epochs=epochs, lr=0.01, seed=seed, cache=cache)
    return model, data

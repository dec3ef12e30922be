"""Data that ships inside packages or is generated: no downloads.

* :func:`digits` - scikit-learn's bundled 8×8 handwritten digits (1,797 images), as
  ``1×8×8`` float tensors scaled to [0, 1], split deterministically into train/test.
* :func:`synthetic_keywords` - a deterministic 4-class 1-D "keyword" task (chirps, tones,
  noise bursts and silence in noise), ``1×T`` sequences, for Conv1d models.
"""

from __future__ import annotations

import math

import torch

__all__ = ["digits", "synthetic_keywords", "batches"]


def digits(test_fraction: float = 0.25, seed: int = 0):
    """``(x_train, y_train, x_test, y_test)`` from sklearn's bundled digits."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        from qdsl.spec.diagnostics import QdslError

        raise QdslError(
            "the digits data needs scikit-learn: pip install 'qdsl[demo]' (or scikit-learn)"
        ) from exc
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    n_test = int(len(y) * test_fraction)
    te, tr = perm[:n_test], perm[n_test:]
    return x[tr], y[tr], x[te], y[te]


def synthetic_keywords(n: int = 2000, length: int = 256, seed: int = 0):
    """``(x, y)``: ``n`` sequences of shape ``1×length`` in 4 classes, deterministic."""
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0, 1, length)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 1, length, generator=g) * 0.3
    f0 = 4 + 8 * torch.rand(n, generator=g)
    phase = 2 * math.pi * torch.rand(n, generator=g)
    onset = (torch.rand(n, generator=g) * 0.5 * length).long()
    for i in range(n):
        c = int(y[i])
        env = torch.zeros(length)
        env[onset[i] : onset[i] + length // 2] = 1.0
        if c == 0:  # rising chirp
            sig = torch.sin(2 * math.pi * (f0[i] * t + 20 * t * t) + phase[i])
        elif c == 1:  # steady tone
            sig = torch.sin(2 * math.pi * 3 * f0[i] * t + phase[i])
        elif c == 2:  # noise burst
            sig = torch.randn(length, generator=g)
        else:  # silence
            sig = torch.zeros(length)
        x[i, 0] += env * sig
    return x, y


def batches(x: torch.Tensor, batch_size: int = 64, y: torch.Tensor | None = None):
    """Yield ``x`` (or ``(x, y)``) in order, in batches."""
    for i in range(0, len(x), batch_size):
        yield x[i : i + batch_size] if y is None else (x[i : i + batch_size], y[i : i + batch_size])

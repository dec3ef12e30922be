"""Saving and loading the state of an applied model.

``model.state_dict()`` of an applied model already holds everything: the float masters
(``conv.weight_float``), every proxy's scale / zero point / observer statistics / learned
parameters (``_qdsl.quantizers.<fqn>:<role>.*``) and the lifecycle (``_qdsl.lifecycle``).
Loading it into a freshly applied copy of the model (same spec) reproduces outputs bit
for bit; lazily sized buffers resize themselves on load.

``save(model, path)`` / ``load(model, path)`` wrap that with a small header so a file
from another qdsl format version, or a plain float checkpoint, is a clear error.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from qdsl.patch.handle import get_handle
from qdsl.spec.diagnostics import QdslError

__all__ = ["save", "load", "STATE_FORMAT", "STATE_VERSION"]

STATE_FORMAT = "qdsl-state"
STATE_VERSION = 1


def save(model: nn.Module, path: str | os.PathLike) -> None:
    """Write the applied model's ``state_dict()`` (floats, scales, statistics, state)."""
    handle = get_handle(model)
    torch.save({
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "state": handle.state.value,
        "state_dict": model.state_dict(),
    }, os.fspath(path))


def load(model: nn.Module, path: str | os.PathLike, strict: bool = True) -> nn.Module:
    """Load a file written by :func:`save` into an applied model (same spec)."""
    get_handle(model)
    try:
        blob: Any = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise QdslError(f"{os.fspath(path)}: no such file") from None
    except Exception as exc:
        raise QdslError(f"{os.fspath(path)}: not a qdsl state file ({type(exc).__name__}: {exc})") from None
    if not isinstance(blob, dict) or blob.get("format") != STATE_FORMAT:
        raise QdslError(f"{os.fspath(path)}: not a qdsl state file (written by qdsl.save?)")
    if blob.get("version") != STATE_VERSION:
        raise QdslError(
            f"{os.fspath(path)}: qdsl state format version {blob.get('version')}, this qdsl reads {STATE_VERSION}"
        )
    try:
        model.load_state_dict(blob["state_dict"], strict=strict)
    except RuntimeError as exc:
        raise QdslError(
            f"{os.fspath(path)} does not match this model ({str(exc).splitlines()[0]}); "
            "was it saved from a model with the same spec?"
        ) from None
    return model

"""``--data MODULE:LOADER`` references.

A data loader is a zero-argument callable returning ``(x_train, y_train, x_test,
y_test)`` tensors (``qdsl.zoo.trained:digits`` is one).  Calibration uses the first
images of ``x_train``; accuracy is measured on ``(x_test, y_test)``.  Every failure is a
:class:`DataRefError` saying what is wrong, never a traceback.
"""

from __future__ import annotations

from typing import Any

from qdsl.resolve.model_ref import _import
from qdsl.spec.diagnostics import QdslError

__all__ = ["DataRefError", "load_data_ref"]


class DataRefError(QdslError):
    """A ``--data`` reference that does not produce the four tensors."""


def load_data_ref(text: str) -> tuple[Any, Any, Any, Any]:
    where, sep, attr = text.rpartition(":")
    if not sep or not where or not attr:
        raise DataRefError(f"--data: expected MODULE:LOADER, got '{text}' (for example qdsl.zoo.trained:digits)")
    try:
        obj = _import(where)
    except QdslError as exc:
        raise DataRefError(str(exc).replace("--model", "--data")) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise DataRefError(f"--data: '{where}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    if callable(obj):
        try:
            obj = obj()
        except Exception as exc:
            raise DataRefError(f"--data: calling '{text}()' raised {type(exc).__name__}: {exc}") from exc
    import torch

    if (
        not isinstance(obj, (tuple, list))
        or len(obj) != 4
        or not all(isinstance(t, torch.Tensor) for t in obj)
    ):
        raise DataRefError(
            f"--data: '{text}' must return (x_train, y_train, x_test, y_test) tensors, "
            f"got {type(obj).__name__}"
        )
    if len(obj[0]) != len(obj[1]) or len(obj[2]) != len(obj[3]):
        raise DataRefError(f"--data: '{text}': inputs and labels differ in length")
    return tuple(obj)  # type: ignore[return-value]

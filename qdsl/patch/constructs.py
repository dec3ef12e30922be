"""The construct table (:mod:`qdsl.graph.catalog`) resolved to torch objects.

fx graphs hold the objects themselves (``call_function`` targets are functions, modules
are instances), so export and apply's checks match on identity (functions) or on the
class hierarchy (modules: a user subclass of ``nn.Conv2d`` is a Conv2d), not on names as
lint does.  Every path in the table must resolve (``tests/export/test_catalog.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

from qdsl.graph.catalog import CONSTRUCTS, Construct

__all__ = ["resolve", "resolve_path", "functions", "module_classes", "module_construct", "methods"]


def resolve(c: Construct) -> Any:
    """The class or function ``c.path`` names (``AttributeError`` if torch lacks it)."""
    return resolve_path(c.path)


def resolve_path(path: str) -> Any:
    """The object a dotted ``path`` (``torch.nn.MaxPool2d``) names."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _by_object(kind: str) -> dict[Any, Construct]:
    return {resolve(c): c for c in CONSTRUCTS if c.kind == kind}


_FUNCTIONS = _by_object("function")
_CLASSES = _by_object("module")
_METHODS = {c.path: c for c in CONSTRUCTS if c.kind == "method"}


def functions(pred=lambda c: True) -> dict[Any, Construct]:
    """``{function: row}`` of the function rows that satisfy ``pred``."""
    return {f: c for f, c in _FUNCTIONS.items() if pred(c)}


def module_classes(pred=lambda c: True) -> tuple[type, ...]:
    """The module classes of the rows that satisfy ``pred``, in table order."""
    return tuple(cls for cls, c in _CLASSES.items() if pred(c))


def methods(pred=lambda c: True) -> dict[str, Construct]:
    """``{method name: row}`` of the method rows that satisfy ``pred``."""
    return {name: c for name, c in _METHODS.items() if pred(c)}


def module_construct(m: Any) -> Construct | None:
    """The row of the most derived table class ``m`` is an instance of (``nn.ReLU6``
    before its base ``nn.Hardtanh``), or ``None``."""
    for cls in type(m).__mro__:
        c = _CLASSES.get(cls)
        if c is not None:
            return c
    return None

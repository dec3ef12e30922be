"""Packages that are also the public function of the same name.

``qdsl.resolve``, ``qdsl.export`` and ``qdsl.lint`` are each a subpackage *and* a
public function (``qdsl.resolve(model, spec)``, ``qdsl.export(model, x)``,
``qdsl.lint(spec, profile)``).  Python binds ``qdsl.<name>`` to the package as soon as
any submodule is imported (``import qdsl.export.lower``), which would shadow the function.
Making the package module itself callable keeps both spellings working whatever the
import order, without renaming the public API.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any, Callable

__all__ = ["make_callable"]


def make_callable(module_name: str, fn: Callable[..., Any]) -> None:
    """Make ``sys.modules[module_name](...)`` call ``fn`` (signature and doc kept)."""

    class _CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

    _CallableModule.__name__ = f"callable_module[{module_name}]"
    module = sys.modules[module_name]
    module.__class__ = _CallableModule
    module.__signature__ = inspect.signature(fn)  # what help() and inspect show

"""Load a model from a command-line reference: ``MODULE:FACTORY`` or ``path/file.py:FACTORY``.

``load_model_ref("qdsl.zoo.models:digits_resnet")`` imports the module and calls the
factory with no arguments; ``load_model_ref("nets/mine.py:build")`` loads a file by path
(relative to the working directory).  The attribute may also be an ``nn.Module``
instance, which is returned as is.  Every way this can fail - a malformed reference, a
module that does not import, a missing attribute, a factory that raises, something that
is not a module - is a :class:`ModelRefError` with a message that says which, never a
traceback.  Shared by ``qdsl check/explain/lint/sweep``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from qdsl.spec.diagnostics import QdslError

__all__ = ["ModelRefError", "load_model_ref", "import_ref"]


class ModelRefError(QdslError):
    """A ``--model`` reference that does not produce an ``nn.Module``."""


def import_ref(where: str) -> Any:
    """Import the module part of a reference: a dotted module name or a ``.py`` path."""
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise ModelRefError(f"--model: no such file '{where}'")
        name = f"_qdsl_model_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ModelRefError(f"--model: cannot load '{where}' as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses/pickle inside the file look themselves up here
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # the user's file: report, never crash
            sys.modules.pop(name, None)
            raise ModelRefError(f"--model: importing '{where}' failed: {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        raise ModelRefError(f"--model: no module named '{exc.name or where}' (importing '{where}')") from exc
    except Exception as exc:
        raise ModelRefError(f"--model: importing '{where}' failed: {type(exc).__name__}: {exc}") from exc


_import = import_ref  # the name qdsl.workflows.refs imports


def load_model_ref(text: str) -> Any:
    """The ``nn.Module`` that ``text`` (``module:factory`` or ``file.py:factory``) names."""
    where, sep, attr = text.rpartition(":")
    if not sep or not where or not attr:
        raise ModelRefError(
            f"--model: expected MODULE:FACTORY or path/to/file.py:FACTORY, got '{text}' "
            "(for example qdsl.zoo.models:digits_resnet)"
        )
    module = import_ref(where)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            raise ModelRefError(
                f"--model: '{where}' has no attribute '{attr}'; it defines: {', '.join(public[:20])}"
            )
        obj = getattr(obj, part)
    if isinstance(obj, type) or not hasattr(obj, "named_modules"):
        if not callable(obj):
            raise ModelRefError(f"--model: '{text}' is a {type(obj).__name__}, not a factory or a module")
        try:
            obj = obj()
        except Exception as exc:
            raise ModelRefError(f"--model: calling '{text}()' raised {type(exc).__name__}: {exc}") from exc
    import torch  # only now: a model is being loaded, so torch is needed anyway

    if not isinstance(obj, torch.nn.Module):
        raise ModelRefError(f"--model: '{text}' returned a {type(obj).__name__}, not a torch.nn.Module")
    return obj

"""Where torch.fx gave up: the module and the statement of a failed export trace.

fx raises whatever the model's code raises when it meets a proxy (a ``TypeError`` from
slicing a buffer by ``x.shape[1]``, a ``TraceError`` from ``if`` on a tensor, a library's
own ``kwargs[name] = value`` on a proxy), with no module path.  The traceback still
has the frames: the innermost one whose ``self`` is a submodule of the model names the module,
and the innermost frame of all names the statement, so the error says which module and
which line of which file (a Hugging Face decorator, the model's own forward) to change.
"""

from __future__ import annotations

import linecache
import os
import types

from torch import nn

__all__ = ["trace_failure"]


def _frames(tb: types.TracebackType | None):
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _here(path: str) -> bool:
    # frames of torch.fx and of qdsl's tracer are the machinery, not the model's code
    parts = path.replace(os.sep, "/").split("/")
    return ("torch" in parts and "fx" in parts) or ("qdsl" in parts and "patch" in parts and parts[-1] == "trace.py")


def trace_failure(model: nn.Module, exc: BaseException) -> tuple[str, str]:
    """``(module path, "class at file:line: source")`` of the code that failed (``""`` for the
    root or when no frame of the model's modules is on the traceback)."""
    names = {id(m): n for n, m in model.named_modules()}
    where, owner, stmt = "", None, None
    for frame, line in _frames(exc.__traceback__):
        path = frame.f_code.co_filename
        if _here(path):
            continue
        self_ = frame.f_locals.get("self")
        if self_ is None:  # a decorator's wrapper: the module is its first positional argument
            args = frame.f_locals.get("args")
            self_ = args[0] if isinstance(args, tuple) and args else None
        if isinstance(self_, nn.Module) and id(self_) in names:
            where, owner = names[id(self_)], type(self_).__name__
        stmt = (path, line, frame.f_code.co_name)
    if stmt is None:
        return where, ""
    path, line, func = stmt
    src = linecache.getline(path, line).strip()
    short = "/".join(path.replace(os.sep, "/").split("/")[-3:])
    text = f"in {func}() at {short}:{line}: {src}"
    return where, (f"{owner}.forward, " if owner else "") + text

"""The exception the runtime raises: every C++ error status becomes a ``RuntimeError_``.

It subclasses :class:`qdsl.spec.diagnostics.QdslError`, so the CLI prints it without a
traceback.  ``code`` is the C++ ``StatusCode`` name; ``str(err)`` is the C++ message.
"""

from __future__ import annotations

from qdsl.spec.diagnostics import QdslError

__all__ = ["RuntimeError_", "RuntimeUnavailable", "STATUS_NAMES"]

STATUS_NAMES = {1: "invalid_argument", 2: "format_error", 3: "unsupported", 4: "internal"}


class RuntimeError_(QdslError):
    """A C++ runtime call failed (bad arguments, corrupt graph, unsupported op)."""

    def __init__(self, message: str, code: str = "invalid_argument"):
        super().__init__(message)
        self.code = code


class RuntimeUnavailable(RuntimeError_):
    """The compiled library is not available; ``qdsl.runtime.load_error()`` says why."""

    def __init__(self, message: str):
        super().__init__(message, "unavailable")

"""Fix hints written in the syntax of the place they point at.

A finding located in a TOML spec says ``use bits = 8``; in a ``.qspec`` file
``use bits=8`` (or ``per_tensor``, ``unsigned``...); in a ``--set`` override
``use --set weight.bits=8``.  The values are spec values (ints, bools, :class:`Kind`,
scale names, :class:`Granularity`), rendered here so every check states its fix once,
structurally.
"""

from __future__ import annotations

from typing import Any

from qdsl.spec.diagnostics import Span
from qdsl.spec.model import Granularity, GranularityKind, Kind, Role

__all__ = ["syntax_of", "assignment", "use", "bias_fix", "accumulator_fix"]

_DSL_FLAGS = {
    "signed": ("signed", "unsigned"),
    "narrow_range": ("narrow", "narrow_range=false"),
    "symmetric": ("symmetric", "asymmetric"),
    "dynamic": ("dynamic", "dynamic=false"),
}


def syntax_of(span: Span) -> str:
    """``"toml"``, ``"dsl"`` (a ``.qspec`` file) or ``"set"`` (a ``--set`` override)."""
    if span.file.startswith("<--set"):
        return "set"
    if span.file.endswith(".qspec"):
        return "dsl"
    return "toml"


def _plain(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (Kind, GranularityKind)):
        return value.value
    return str(value)


def _toml(field: str, value: Any) -> str:
    if isinstance(value, Granularity):
        if value.kind is GranularityKind.GROUP:
            return f'{{ kind = "group", size = {value.group_size} }}'
        if value.kind is GranularityKind.CHANNEL and value.axis not in (None, 0):
            return f'{{ kind = "channel", axis = {value.axis} }}'
        return f'"{value.kind.value}"'
    if isinstance(value, bool) or isinstance(value, int):
        return _plain(value)
    return f'"{_plain(value)}"'


def _dsl(field: str, value: Any) -> str:
    if field in _DSL_FLAGS and isinstance(value, bool):
        return _DSL_FLAGS[field][0 if value else 1]
    if isinstance(value, Granularity):
        if value.kind is GranularityKind.TENSOR:
            return "per_tensor"
        if value.kind is GranularityKind.CHANNEL and value.axis in (None, 0):
            return "per_channel"
        return f"granularity={value}"
    if field == "kind":
        return f"{_plain(value)}(...)"
    return f"{field}={_plain(value)}"


def assignment(field: str, value: Any, syntax: str, role: Role | None = None) -> str:
    """``bits = 8`` / ``bits=8`` / ``--set weight.bits=8``."""
    if syntax == "dsl":
        return _dsl(field, value)
    if syntax == "set":
        return f"--set {role.value + '.' if role else ''}{field}={_plain(value)}"
    return f"{field} = {_toml(field, value)}"


def use(field: str, value: Any, span: Span, role: Role | None = None) -> str:
    """The hint ``use <assignment>`` in the syntax of ``span``'s file."""
    syntax = syntax_of(span)
    verb = "set" if isinstance(value, bool) and syntax != "dsl" else "use"
    return f"{verb} {assignment(field, value, syntax, role)}"


def bias_fix(span: Span) -> str:
    """How to write an int32 bias at the derived scale input×weight."""
    syntax = syntax_of(span)
    if syntax == "dsl":
        return "use bias = int(bits=32, scale=input*weight)"
    if syntax == "set":
        return "use --set bias=int(bits=32, scale=input*weight)"
    return 'use bias = { kind = "int", bits = 32, scale = "input*weight" }'


def accumulator_fix(bits: int, overflow: str | None, span: Span) -> str:
    syntax = syntax_of(span)
    if syntax == "dsl":
        return f"use accumulator(bits={bits}" + (f", overflow={overflow})" if overflow else ")")
    return f"use accumulator = {{ bits = {bits}" + (f', overflow = "{overflow}" }}' if overflow else " }")

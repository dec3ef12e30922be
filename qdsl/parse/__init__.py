"""Spec front ends (TOML and the ``.qspec`` DSL), composition and formatting.

The public contract other layers code against:

* ``parse_text(text, filename="<input>", fmt=None) -> QuantSpec`` - one file's text, raw
  (includes not merged, no overrides).  ``fmt`` is ``"toml"`` or ``"qspec"``; when None it
  follows the filename (``.toml`` -> TOML, ``.qspec`` -> DSL) and otherwise sniffs.
* ``parse_file(path) -> QuantSpec`` - the same for a file; ``source`` is set.
* ``load_spec(path_or_spec, overrides=None) -> QuantSpec`` - parse + ``compose``.
* ``compose(spec, overrides=None)``, ``parse_overrides(items)``, ``format_spec(spec, to)``,
  ``read_located_toml(text, filename)``.

Every user mistake raises :class:`qdsl.spec.SpecError` carrying located diagnostics;
nothing else escapes for any input text.  This package never imports torch.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
from typing import Any, Mapping, Sequence

import attrs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from qdsl.parse.compose import Override, compose, parse_overrides
from qdsl.parse.format import format_spec
from qdsl.parse.located_toml import LocatedToml, read_located_toml
from qdsl.parse.lower import parse_dsl
from qdsl.parse.toml_loader import parse_toml
from qdsl.spec.diagnostics import Diagnostic, Span, SpecError
from qdsl.spec.model import QuantSpec

__all__ = [
    "parse_text",
    "parse_file",
    "load_spec",
    "compose",
    "parse_overrides",
    "Override",
    "format_spec",
    "read_located_toml",
    "LocatedToml",
    "detect_format",
    "gc_paused",
]



def detect_format(filename: str, text: str | None = None) -> str:
    """``"toml"`` or ``"qspec"`` from the suffix, else by sniffing ``text``."""
    name = str(filename).lower()
    if name.endswith(".toml"):
        return "toml"
    if name.endswith(".qspec"):
        return "qspec"
    if text is None:
        return "qspec"
    try:
        tomllib.loads(text)
        return "toml"
    except (ValueError, RecursionError):
        pass
    first = next((ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")), "")
    return "toml" if first.lstrip().startswith("[") else "qspec"


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while a spec is parsed (and, in
    :mod:`qdsl.resolve.resolver`, while a model is indexed and resolved).

    Parsing allocates a few dozen small objects per rule and frees none, so the
    collector's generation-2 passes (each over every live object) would run again and
    again: on an 80k-rule spec they took half the time and made parsing superlinear.
    Restored on exit (only if it was enabled), so nothing outlives the call.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse_text(text: str, filename: str = "<input>", fmt: str | None = None) -> QuantSpec:
    """Parse one spec text (raw: includes and overrides not applied)."""
    with gc_paused():
        return _parse_text(text, filename, fmt)


def _parse_text(text: str, filename: str, fmt: str | None) -> QuantSpec:
    if not isinstance(text, str):
        raise SpecError(Diagnostic.error("E100", f"spec text must be a string, got {type(text).__name__}",
                                         Span(filename)))
    fmt = fmt or detect_format(filename, text)
    if fmt == "toml":
        return parse_toml(text, filename)
    if fmt in ("qspec", "dsl"):
        return parse_dsl(text, filename)
    raise SpecError(Diagnostic.error("E100", f"unknown spec format '{fmt}'", Span(filename),
                                     "use 'toml' or 'qspec'"))


def parse_file(path: str | os.PathLike) -> QuantSpec:
    """Parse a spec file (raw); an unreadable file is an E100 ``SpecError``."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8-sig") as fh:  # tolerate a BOM from Windows editors
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SpecError(Diagnostic.error("E100", f"cannot read spec file: {reason}", Span(name))) from None
    return attrs.evolve(parse_text(text, name), source=name)


def load_spec(path_or_spec: QuantSpec | str | os.PathLike,
              overrides: Sequence[str] | Mapping[str, Any] | None = None) -> QuantSpec:
    """Parse (unless given a ``QuantSpec``) and compose: includes merged, overrides applied."""
    spec = path_or_spec if isinstance(path_or_spec, QuantSpec) else parse_file(path_or_spec)
    return compose(spec, overrides)

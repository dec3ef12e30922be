"""Group lint findings: one diagnostic per problem *at one place*, listing every layer and use.

A preset used by ten rules, or a default hitting 200 layers, is one mistake written in
one spot; the user fixes it there once.  :class:`Collector` keys findings by (code,
field, location, requested value) and appends the layers and uses it saw as notes, in
first-seen order, so output is deterministic.
"""

from __future__ import annotations

from typing import Any, Hashable

import attrs

from qdsl.lint.capability import Violation
from qdsl.spec.diagnostics import Diagnostic, Severity, Span
from qdsl.spec.model import Role
from qdsl.spec.profile import HardwareProfile, TensorCaps

__all__ = ["Collector", "violation_diagnostic", "sort_key"]

_MAX_LAYERS = 6


@attrs.define
class _Item:
    diag: Diagnostic
    layers: list[str] = attrs.field(factory=list)
    uses: list[str] = attrs.field(factory=list)


class Collector:
    def __init__(self) -> None:
        self._items: dict[Hashable, _Item] = {}

    def add(self, key: Hashable, diag: Diagnostic, *, layer: str | None = None, use: str | None = None) -> None:
        item = self._items.get(key)
        if item is None:
            item = self._items[key] = _Item(diag)
        if layer is not None and layer not in item.layers:
            item.layers.append(layer)
        if use is not None and use not in item.uses:
            item.uses.append(use)

    def diagnostics(self) -> list[Diagnostic]:
        out = []
        for item in self._items.values():
            notes = list(item.diag.notes)
            if item.uses and len(item.uses) > 0:
                notes.insert(0, "used by " + ", ".join(item.uses))
            if item.layers:
                names = [n or "<root>" for n in item.layers]
                shown = ", ".join(names[:_MAX_LAYERS])
                if len(names) > _MAX_LAYERS:
                    shown += f" and {len(names) - _MAX_LAYERS} more"
                notes.insert(0, f"on layer{'s' if len(names) > 1 else ''} {shown}")
            out.append(attrs.evolve(item.diag, notes=tuple(notes)))
        return out


def _caps_note(profile: HardwareProfile, caps: TensorCaps, v: Violation) -> str | None:
    span = caps.span_of(v.caps_field) if v.caps_field != "integer_only" else profile.spans.get("integer_only")
    if span is None or not span.known:
        return None
    return f"{profile.name} sets {v.caps_field} at {span.location()}"


def violation_diagnostic(
    v: Violation, role: Role, span: Span, profile: HardwareProfile, caps: TensorCaps, *, origin: str = "",
    context: str = "",
) -> Diagnostic:
    """The diagnostic for one capability violation, in the house format."""
    what = f"{role.value}.{v.field} = {v.requested}"
    if origin:
        what += f" ({origin})"
    msg = f"{what} is not supported by {profile.name}{context} (allowed: {v.allowed})"
    notes: list[str] = []
    if v.reason:
        notes.append(v.reason)
    note = _caps_note(profile, caps, v)
    if note:
        notes.append(note)
    return Diagnostic(Severity.ERROR, v.code, msg, span, (v.hint(role, span),), tuple(notes))


def sort_key(d: Diagnostic) -> tuple[Any, ...]:
    """Errors and warnings in file order, spanless (model-level) findings after."""
    s = d.span
    return (not s.known, s.file, s.line, s.col, d.code, d.message)

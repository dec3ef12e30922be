"""Named quantizers (presets) and ``extends``: expand a partial quantizer into its fields.

A ``TensorQuant(extends="w4pot", bits=8)`` contributes every field of the expanded
chain ``w4pot -> (what w4pot extends) -> ...`` plus its own; fields written nearer the
use win.  Each resulting field is a :class:`Contribution` that remembers where its value
is written, which presets it travelled through (``via``, outermost first) and which
values further down the chain it replaced (``shadowed``) - what provenance and
``qdsl explain`` show.

Guarantees: each preset is expanded once (memoized); an unknown preset is an ``E207``
at the ``extends`` value that names it, with a "did you mean"; a cycle is one ``E208``
per cycle, showing the whole chain with a note per link.  Errors never stop expansion:
the broken link contributes nothing and the rest is still expanded, so every other
problem is still found in the same pass.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from qdsl.resolve.plan import Origin
from qdsl.spec.diagnostics import Diagnostic, Span, did_you_mean
from qdsl.spec.model import TensorQuant

__all__ = ["Contribution", "PresetTable"]


@attrs.frozen
class Contribution:
    """One field's value as a source states it."""

    value: Any
    span: Span
    """Where the value itself is written (inside the preset when it came through one)."""
    via: tuple[Origin, ...] = ()
    """Presets the value travelled through, outermost (the one named at the use) first."""
    shadowed: tuple[tuple[Origin, Any], ...] = ()
    """Values of the same field further down the preset chain that this one replaced."""


Fields = Mapping[str, Contribution]


class PresetTable:
    """The spec's presets, expanded on demand; collects diagnostics found inside presets.

    ``diagnostics`` holds problems located *in* preset definitions (each reported once);
    problems at a use site (``extends`` naming an unknown preset) are returned by
    :meth:`expand` to the caller, which owns that span.
    """

    def __init__(self, presets: Mapping[str, TensorQuant]):
        self._presets = dict(presets)
        self._memo: dict[str, dict[str, Contribution]] = {}
        self._cycles: set[frozenset[str]] = set()
        self.diagnostics: list[Diagnostic] = []

    def names(self) -> list[str]:
        return sorted(self._presets)

    def expand(self, tq: TensorQuant) -> tuple[dict[str, Contribution], list[Diagnostic]]:
        """The fields ``tq`` contributes (its chain's plus its own), and use-site errors."""
        diags: list[Diagnostic] = []
        base: dict[str, Contribution] = {}
        if tq.extends is not None:
            base = self._lookup(tq.extends, tq.span_of("extends"), (), diags)
        return _overlay(base, tq, via=None), diags

    def expand_preset(self, name: str) -> dict[str, Contribution]:
        """All fields of preset ``name`` (which must exist)."""
        return self._preset(name, ())

    def _lookup(
        self, name: str, span: Span, stack: tuple[str, ...], diags: list[Diagnostic]
    ) -> dict[str, Contribution]:
        if name not in self._presets:
            diags.append(
                Diagnostic.error(
                    "E207", f"unknown quantizer preset '{name}'", span,
                    did_you_mean(name, self._presets, "presets") if self._presets
                    else "this spec defines no named quantizers",
                )
            )
            return {}
        return self._preset(name, stack)

    def _preset(self, name: str, stack: tuple[str, ...]) -> dict[str, Contribution]:
        if name in stack:
            self._report_cycle(stack[stack.index(name):] + (name,))
            return {}
        memo = self._memo.get(name)
        if memo is not None:
            return memo
        tq = self._presets[name]
        base: dict[str, Contribution] = {}
        if tq.extends is not None:
            # errors inside a preset belong to the preset, reported once
            base = self._lookup(tq.extends, tq.span_of("extends"), stack + (name,), self.diagnostics)
        fields = _overlay(base, tq, via=name)
        self._memo[name] = fields
        return fields

    def _report_cycle(self, chain: tuple[str, ...]) -> None:
        members = frozenset(chain)
        if members in self._cycles:
            return
        self._cycles.add(members)
        first = self._presets[chain[0]]
        notes = [
            f"'{a}' extends '{b}' at {self._presets[a].span_of('extends').location()}"
            for a, b in zip(chain, chain[1:])
        ]
        self.diagnostics.append(
            Diagnostic.error(
                "E208",
                "cycle in quantizer presets: " + " -> ".join(chain),
                first.span_of("extends"),
                "remove one 'extends' so the chain ends in a preset that extends nothing",
                notes=notes,
            )
        )


def _overlay(base: Mapping[str, Contribution], tq: TensorQuant, via: str | None) -> dict[str, Contribution]:
    """``base`` (a parent's fields) under ``tq``'s own fields; ``via`` names ``tq`` if it is a preset."""
    out: dict[str, Contribution] = {}
    if via is not None:
        link = Origin(via, tq.span_of("extends") if tq.extends is not None else tq.span)
        for field, c in base.items():
            out[field] = attrs.evolve(c, via=(link,) + c.via)
    else:
        out.update(base)
    for field, value in tq.set_fields().items():
        span = tq.span_of(field)
        own_via = (Origin(via, span),) if via is not None else ()
        shadowed: tuple[tuple[Origin, Any], ...] = ()
        below = base.get(field)
        if below is not None:
            writer = below.via[-1] if below.via else Origin("?", below.span)
            shadowed = ((Origin(writer.label, below.span), below.value),) + below.shadowed
        out[field] = Contribution(value, span, own_via, shadowed)
    return out


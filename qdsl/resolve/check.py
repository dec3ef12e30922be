"""Everything about a spec that can be checked without a model: :func:`check_spec`.

It also produces :class:`Prepared`, the compiled form of a spec that ``resolve`` reuses
(presets expanded once, every rule body turned into per-field
:class:`~qdsl.resolve.presets.Contribution` s, every target compiled once), so checking
and resolving never disagree about what a spec says.

Checked here: presets exist and ``extends`` chains end (E207/E208); part names and
observer parameters against the registries (E204/E205/E206); field combinations inside
each quantizer as written, after expanding its presets (E210-E215); targets compile
(E218); a rule says something (E222) and does not both ``skip`` and set quantizers
(E223).  Combinations that only arise when several sources meet on one layer are
checked by ``resolve``.  Diagnostics are de-duplicated: a bad field inside a preset is
reported once, at the preset, however many rules use it.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import attrs

from qdsl.resolve.presets import Contribution, PresetTable
from qdsl.resolve.targets import CompiledTarget, compile_target
from qdsl.resolve.validate import validate_fields
from qdsl.spec.builtins import builtin_registries
from qdsl.spec.diagnostics import Diagnostic, Span
from qdsl.spec.model import QuantSpec, Role, RuleBody
from qdsl.spec.registry import Registries

__all__ = ["Body", "Prepared", "prepare", "check_spec", "dedupe", "compose_if_needed"]


@attrs.frozen
class Body:
    """A compiled defaults/rule/overrides body: what it says, field by field."""

    label: str
    order: int
    """Position for tie-breaking in file order: defaults -1, rules 0.., overrides last."""
    priority: int
    """Declared rule priority; absent counts as 0."""
    span: Span
    roles: Mapping[Role, Mapping[str, Contribution]]
    role_spans: Mapping[Role, Span]
    skip: Contribution | None = None
    accumulator: Contribution | None = None

    def set_by_span(self, role: Role, c: Contribution) -> Span:
        """Where "set by" points: the field itself, or the preset reference it came through."""
        return self.role_spans.get(role, self.span) if c.via else c.span


@attrs.frozen
class Prepared:
    """A spec compiled for resolving; ``diagnostics`` is what :func:`check_spec` returns."""

    spec: QuantSpec
    registries: Registries = attrs.field(eq=False)
    presets: PresetTable = attrs.field(eq=False)
    defaults: Body
    rules: tuple[Body, ...]
    overrides: Body
    targets: tuple[tuple[CompiledTarget, ...], ...]
    diagnostics: tuple[Diagnostic, ...]


def compose_if_needed(spec: QuantSpec) -> QuantSpec:
    """Merge ``include`` s (``qdsl.parse.compose``) when the spec still has any."""
    if not spec.includes:
        return spec
    from qdsl.parse import compose  # lazy: parse is a separate layer and may be absent

    return compose(spec)


def dedupe(diags: Iterable[Diagnostic]) -> list[Diagnostic]:
    """Drop repeats of the same problem at the same place, keeping first occurrences."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for d in diags:
        s = d.span
        key = (d.code, d.message, s.file, s.line, s.col, s.path)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def _compile_body(
    body: RuleBody,
    label: str,
    order: int,
    table: PresetTable,
    registries: Registries,
    diags: list[Diagnostic],
    priority: int | None = None,
    span: Span | None = None,
) -> Body:
    roles: dict[Role, dict[str, Contribution]] = {}
    role_spans: dict[Role, Span] = {}
    for role, tq in body.roles.items():
        fields, use_diags = table.expand(tq)
        diags += use_diags
        roles[role] = fields
        role_spans[role] = tq.span
        diags += validate_fields(
            {f: c.value for f, c in fields.items()}, role, {f: c.span for f, c in fields.items()}, registries
        )
    # a rule's body may carry no span of its own; the rule's is the next best place
    where = body.span if body.span.known or span is None else span
    skip = Contribution(body.skip, where) if body.skip is not None else None
    acc = None
    if body.accumulator is not None:
        acc = Contribution(body.accumulator, body.accumulator.span)
    return Body(label, order, priority or 0, where, roles, role_spans, skip, acc)


def prepare(spec: QuantSpec, registries: Registries | None = None) -> Prepared:
    """Compile ``spec`` (includes already composed) and collect every model-free problem."""
    regs = registries if registries is not None else builtin_registries()
    table = PresetTable(spec.quantizers)
    diags: list[Diagnostic] = []
    for name, tq in spec.quantizers.items():
        fields = table.expand_preset(name)
        diags += validate_fields(
            {f: c.value for f, c in fields.items()}, None, {f: c.span for f, c in fields.items()}, regs
        )
    defaults = _compile_body(spec.defaults, "defaults", -1, table, regs, diags)
    rules = []
    targets = []
    for i, rule in enumerate(spec.rules):
        rules.append(_compile_body(rule.body, rule.describe(), i, table, regs, diags, rule.priority, rule.span))
        compiled = []
        if not rule.targets:
            diags.append(Diagnostic.error("E218", f"{rule.describe()} has no target", rule.span))
        for t in rule.targets:
            ct = compile_target(t)
            if isinstance(ct, Diagnostic):
                diags.append(ct)
            else:
                compiled.append(ct)
        targets.append(tuple(compiled))
        b = rule.body
        if not b.roles and b.skip is None and b.accumulator is None:
            diags.append(Diagnostic.error(
                "E222", f"{rule.describe()} sets nothing", rule.span,
                "give it a quantizer (weight/input/output/bias), 'skip' or an accumulator, or delete it",
            ))
        if b.skip and b.roles:
            diags.append(Diagnostic.error(
                "E223", f"{rule.describe()} both skips its layers and sets quantizers for them",
                rule.span, "a skipped layer stays entirely in float; drop 'skip' or the quantizers",
            ))
    overrides = _compile_body(spec.overrides, "override", len(spec.rules), table, regs, diags)
    # diagnostics found inside presets come last so use sites read first
    all_diags = dedupe(diags + table.diagnostics)
    return Prepared(spec, regs, table, defaults, tuple(rules), overrides, tuple(targets), tuple(all_diags))


def check_spec(spec: QuantSpec, registries: Registries | None = None) -> list[Diagnostic]:
    """Every problem ``spec`` has on its own (no model): errors and warnings, located."""
    return list(prepare(compose_if_needed(spec), registries).diagnostics)


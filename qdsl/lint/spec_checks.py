"""Spec-only lint: the defaults, rules and overrides as written, against a profile.

Works on the resolver's compiled spec (``qdsl.resolve.check.Prepared``): every body's
roles are already expanded through preset ``extends`` chains, and each field knows the
span where its value is written (inside the preset when it came through one).

What is checked, per body and role:

* the fields the body writes (its own or through its presets), merged over the
  ``defaults`` of the same role for context (a rule that only says ``bits = 4`` is still
  an int rule when the defaults say so);
* built-in default values (``validate.builtin_value``) for fields nobody writes, once:
  at ``defaults`` for the roles it mentions, else at the first rule that mentions the
  role - located at the role's entry, with "built-in default" in the message.

Which op and position apply is not known without a model, so:

* ``defaults`` must suit every weighted op (conv1d, conv2d, linear) in a middle layer;
* a rule whose targets are all ``type:`` must suit each of those ops, at *some*
  position (first/last-layer allowances may be what it is for);
* any other rule is reported only if no op and no position accepts the value.

Pass a model for exact per-layer checks (``plan_checks.py``).
"""

from __future__ import annotations

from typing import Any, Iterable

from qdsl.lint.capability import Violation, check_quantizer
from qdsl.lint.collect import Collector, violation_diagnostic
from qdsl.lint.export_width import export_width_findings
from qdsl.lint.fixes import accumulator_fix
from qdsl.lint.ops import WEIGHTED_OPS, module_op
from qdsl.resolve.check import Body, Prepared
from qdsl.resolve.validate import builtin_value, fill_channel_axis
from qdsl.spec.diagnostics import Diagnostic, Span
from qdsl.spec.model import Kind, Role, Rule, TargetKind, TENSOR_QUANT_FIELDS
from qdsl.spec.profile import HardwareProfile, Position

__all__ = ["check_prepared", "ANY_POSITION"]

ANY_POSITION: tuple[tuple[Position, ...], ...] = ((), (Position.FIRST,), (Position.LAST,), (Position.FIRST, Position.LAST))


def _targets_ops(rule: Rule, profile: HardwareProfile) -> tuple[list[str], bool]:
    """(ops to check, whether *all* of them must accept)."""
    if rule.targets and all(t.kind is TargetKind.TYPE for t in rule.targets):
        ops = [module_op(t.pattern) for t in rule.targets]
        return [o for o in ops if o is not None], True
    return list(dict.fromkeys(list(WEIGHTED_OPS) + list(profile.op_roles))), False


def _known(body: Body, role: Role, defaults: Body) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """(every field's value, the contributions that wrote them, the fields to report)."""
    own = dict(body.roles[role])
    merged = dict(defaults.roles.get(role, {})) if body is not defaults else {}
    merged.update(own)
    kind = merged["kind"].value if "kind" in merged else Kind.INT
    scale = merged["scale"].value if "scale" in merged else None
    known = {}
    for f in TENSOR_QUANT_FIELDS:
        known[f] = merged[f].value if f in merged else builtin_value(f, role, kind, scale)
    known["granularity"] = fill_channel_axis(known["granularity"], role)
    builtin_here = body is defaults or role not in defaults.roles or body.label == "override"
    report = set(own)
    if builtin_here and body.label != "override":
        report |= {f for f in TENSOR_QUANT_FIELDS if f not in merged}
    return known, merged, report


def _per_op(
    known, role, ops, positions, profile, pot_scales
) -> dict[str, list[tuple[str, Violation]]]:
    """field -> [(op, violation)] for ops where every position set rejects the field."""
    out: dict[str, list[tuple[str, Violation]]] = {}
    for op in ops:
        per_pos = []
        for pos in positions:
            caps = profile.caps(role, op, pos)
            per_pos.append({v.field: v for v in check_quantizer(known, caps, role, integer_only=profile.integer_only,
                                                                pot_scales=pot_scales)})
        for field, v in per_pos[0].items():
            if all(field in p for p in per_pos):
                out.setdefault(field, []).append((op, v))
    return out


def check_prepared(prep: Prepared, profile: HardwareProfile, pot_scales: frozenset[str]) -> list[Diagnostic]:
    col = Collector()
    bodies: list[tuple[Body, list[str], bool, Iterable]] = [(prep.defaults, list(WEIGHTED_OPS), True, ((),))]
    for rule, body in zip(prep.spec.rules, prep.rules):
        ops, all_of = _targets_ops(rule, profile)
        bodies.append((body, ops, all_of, ANY_POSITION))
    any_ops = list(dict.fromkeys(list(WEIGHTED_OPS) + list(profile.op_roles)))
    bodies.append((prep.overrides, any_ops, False, ANY_POSITION))
    # defaults never reach an op whose type rule replaces the same field on all its layers
    replaced: set[tuple[str, Role, str]] = set()
    for rule, body in zip(prep.spec.rules, prep.rules):
        ops, all_of = _targets_ops(rule, profile)
        if all_of:
            replaced |= {(op, role, f) for op in ops for role, fields in body.roles.items() for f in fields}
    for body, ops, all_of, positions in bodies:
        positions = tuple(positions)
        _check_skip_and_acc(body, ops, profile, col)
        for role in body.roles:
            known, merged, report = _known(body, role, prep.defaults)
            if not ops:
                continue
            found = _per_op(known, role, ops, positions, profile, pot_scales)
            overridden = prep.overrides.roles.get(role, {}) if body is not prep.overrides else {}
            for field, hits in found.items():
                if field not in report or field in overridden:
                    continue  # not this body's to fix, or replaced everywhere by an override
                if not all_of and len(hits) < len(ops):
                    continue  # some op accepts it; only a model can tell
                if body is prep.defaults:
                    hits = [(op, v) for op, v in hits if (op, role, field) not in replaced]
                for op, v in (hits if all_of else hits[:1]):
                    _add(col, body, role, field, v, merged, op if all_of else None, profile)
    return col.diagnostics() + export_width_findings(prep)


def _where(body: Body, role: Role, field: str, merged) -> tuple[Span, str, str | None]:
    """(span of the value, origin text for the message, the use to note for presets)."""
    c = merged.get(field)
    if c is None:
        return body.role_spans.get(role, body.span), "built-in default", None
    if c.via:
        return c.span, f"from preset '{c.via[-1].label}'", f"{body.label}.{role.value}"
    return c.span, "", None


def _add(col: Collector, body: Body, role: Role, field: str, v: Violation, merged, op, profile) -> None:
    span, origin, use = _where(body, role, field, merged)
    caps = profile.caps(role, op)
    own = profile.op_roles.get(op, {}).get(role) if op is not None else None
    context = f" for {op}" if own is not None and getattr(own, v.caps_field, None) is not None else ""
    d = violation_diagnostic(v, role, span, profile, caps, origin=origin, context=context)
    col.add((v.code, v.field, role, span.location(), span.path, v.requested, v.allowed), d, use=use)


def _check_skip_and_acc(body: Body, ops: list[str], profile: HardwareProfile, col: Collector) -> None:
    if body.skip is not None and body.skip.value and profile.integer_only:
        span = body.skip.span
        d = Diagnostic.error(
            "E312", f"{body.label} skips its layers (they stay in float), but {profile.name} is integer-only",
            span, "quantize these layers instead of skipping them",
            notes=_integer_only_note(profile))
        col.add(("E312", "skip", span.location(), span.path), d)
    if body.accumulator is None:
        return
    acc = body.accumulator.value
    span = body.accumulator.span if body.accumulator.span.known else body.span
    for op in ops or [None]:
        hw = profile.accumulator_for(op)
        if hw.bits is not None and acc.bits > hw.bits:
            d = Diagnostic.error(
                "E315", f"{body.label} assumes a {acc.bits}-bit accumulator; {profile.name} has {hw.bits} bits",
                span, accumulator_fix(hw.bits, None, span) + " (the exported graph must match the hardware)")
            col.add(("E315", "bits", span.location()), d)
        if hw.overflow is not None and acc.overflow is not hw.overflow:
            d = Diagnostic.error(
                "E315", f"{body.label} assumes accumulator overflow = {acc.overflow.value}; "
                f"{profile.name} does {hw.overflow.value}", span,
                accumulator_fix(acc.bits if hw.bits is None else min(acc.bits, hw.bits), hw.overflow.value, span))
            col.add(("E315", "overflow", span.location()), d)


def _integer_only_note(profile: HardwareProfile) -> tuple[str, ...]:
    span = profile.spans.get("integer_only")
    if span is not None and span.known:
        return (f"{profile.name} sets integer_only at {span.location()}",)
    return ()

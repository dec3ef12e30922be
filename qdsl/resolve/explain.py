"""``qdsl explain``: a plan's provenance as a table (DESIGN.md §8) or as JSON records.

One row per resolved field of every quantized role, plus a row for each role left in
float (saying why) and for layer-level fields that a spec source set (``skip``,
``accumulator``)::

    layer          role    field  value  set by
    layer1.0.conv1 weight  bits   4      defaults (m.qspec:10) via w4pot (m.qspec:5)
    layer1.0.conv1 weight  scale  learned_pot  rule type:Conv2d (m.qspec:15), overrides w4pot: pot

"set by" is the source that won, ``via`` the preset chain its value came through, and
``overrides X: old`` the nearest lower source that said something different.  The JSON
form (:func:`to_records`) carries every field of the provenance, including all
overridden sources.  Output order follows the plan (model order) and the canonical field
order, so it is stable for golden tests.
"""

from __future__ import annotations

import enum
from typing import Any, Iterable, Sequence

from qdsl.resolve.plan import FieldProvenance, LayerPlan, Origin, Plan
from qdsl.resolve.positions import positions
from qdsl.resolve.targets import compile_glob
from qdsl.spec.diagnostics import Diagnostic, Span, SpecError
from qdsl.spec.model import Accumulator, Granularity, ObserverSpec, Role, TargetKind, TENSOR_QUANT_FIELDS

__all__ = ["explain", "to_records", "format_value", "positional_targets"]

_HEADER = ("layer", "role", "field", "value", "set by")


def format_value(value: Any) -> str:
    """How a field value is written in explain output and provenance labels."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, Accumulator):
        return f"int{value.bits} ({value.overflow.value}{', constrained' if value.constrain else ''})"
    if isinstance(value, (Granularity, ObserverSpec)):
        return str(value)
    if value is None:
        return "-"
    return str(value)


def _json_value(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Granularity):
        return {"kind": value.kind.value, "axis": value.axis, "group_size": value.group_size}
    if isinstance(value, ObserverSpec):
        return {"name": value.name, "params": dict(value.params)}
    if isinstance(value, Accumulator):
        return {"bits": value.bits, "overflow": value.overflow.value, "constrain": value.constrain}
    return str(value)


def _origin_record(o: Origin) -> dict[str, Any]:
    s = o.span
    return {"label": o.label, "file": s.file if s.known else None, "line": s.line or None, "col": s.col or None}


def _set_by_text(p: FieldProvenance) -> str:
    text = str(p.set_by)
    if p.via:
        text += " via " + " > ".join(str(v) for v in p.via)
    for origin, old in p.overridden:
        # compare as written: a filled-in default (channel -> channel axis 0) is no change
        if format_value(old) != format_value(p.value):
            text += f", overrides {origin.label}: {format_value(old)}"
            break
    return text


def _select(plan: Plan, layers: str | Sequence[str] | None) -> list[LayerPlan]:
    if layers is None:
        return list(plan.layers)
    globs = [layers] if isinstance(layers, str) else list(layers)
    preds = []
    for g in globs:
        try:
            preds.append(compile_glob(g))
        except ValueError as exc:
            raise SpecError(Diagnostic.error("E218", f"invalid layer glob '{g}': {exc}", Span("--layer"))) from None
    return [lp for lp in plan.layers if any(p(lp.fqn) for p in preds)]


def _roles(roles: Iterable[Role | str] | None) -> list[Role] | None:
    return None if roles is None else [Role(r) for r in roles]


def _rows(lp: LayerPlan, roles: list[Role] | None) -> list[tuple[str, str, str, str, str, FieldProvenance | None]]:
    """(layer, role, field, value, set-by, provenance) rows for one layer."""
    rows = []
    prov = lp.provenance
    for field in ("skip", "accumulator"):
        p = prov.get(("layer", field))
        if p is not None and p.set_by.label != "built-in default":
            rows.append((lp.fqn, "layer", field, format_value(p.value), _set_by_text(p), p))
    for role, recipe in lp.roles.items():
        if roles is not None and role not in roles:
            continue
        if recipe is None:
            kind = prov.get((role, "kind"))
            if lp.skip:
                why = "layer skipped"
            elif kind is not None:
                why = _set_by_text(kind)
            elif role in (Role.WEIGHT, Role.BIAS):
                why = "not quantized: no default or rule sets it"
            else:
                continue  # an activation nobody mentions is the normal case; keep tables short
            rows.append((lp.fqn, role.value, "kind", "float", why, kind))
            continue
        for field in TENSOR_QUANT_FIELDS:
            p = prov.get((role, field))
            value = getattr(recipe, field)
            if field == "threshold" and value == "none" and (p is None or not p.set_by.span.known):
                continue  # only signed binary activations take one: keep the tables short
            rows.append((lp.fqn, role.value, field, format_value(value), _set_by_text(p) if p else "", p))
    return rows


def explain(plan: Plan, layers: str | Sequence[str] | None = None, roles: Iterable[Role | str] | None = None) -> str:
    """The provenance table; ``layers`` are globs over layer names, ``roles`` role names."""
    selected = _select(plan, layers)
    role_filter = _roles(roles)
    rows = [r[:5] for lp in selected for r in _rows(lp, role_filter)]
    if not rows:
        return "no layers match" if layers is not None else "the plan has no layers"
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(_HEADER[:4])]
    lines = []
    for r in [_HEADER, *rows]:
        cells = [r[i].ljust(widths[i]) for i in range(4)] + [r[4]]
        lines.append("  ".join(cells).rstrip())
    pos = positional_targets(plan)
    if pos is not None:
        named = ", ".join(f"@{w} = {v['module'] or '(no weighted layer)'}" for w, v in pos["targets"].items())
        lines.append(f"\npositional targets ({pos['order']} order): {named}" + (f"\nnote: {pos['note']}" if pos["note"] else ""))
    return "\n".join(lines)


def positional_targets(plan: Plan) -> dict[str, Any] | None:
    """What the spec's ``@first`` / ``@last`` targets named, and by which order; ``None``
    when the spec has none (or the plan has no model index)."""
    words = sorted({t.pattern for r in plan.spec.rules for t in r.targets if t.kind is TargetKind.POSITION})
    if not words or plan.index is None:
        return None
    pos = positions(plan.index)
    return {
        "order": "forward execution" if pos.traced else "registration",
        "note": pos.note,
        "targets": {w: {"module": pos.of(w)} for w in words},
    }


def to_records(plan: Plan, layers: str | Sequence[str] | None = None, roles: Iterable[Role | str] | None = None) -> list[dict[str, Any]]:
    """The same rows as :func:`explain`, as JSON-ready dicts with full provenance."""
    out = []
    for lp in _select(plan, layers):
        for layer, role, field, _, set_by, p in _rows(lp, _roles(roles)):
            if role == "layer":
                value = p.value
            elif lp.roles.get(Role(role)) is None:
                value = "float"
            else:
                value = getattr(lp.roles[Role(role)], field)
            rec: dict[str, Any] = {
                "layer": layer,
                "type": lp.type_name,
                "role": role,
                "field": field,
                "value": _json_value(value),
                "text": set_by,
            }
            if p is not None:
                rec["set_by"] = _origin_record(p.set_by)
                rec["via"] = [_origin_record(v) for v in p.via]
                rec["overridden"] = [dict(_origin_record(o), value=_json_value(v)) for o, v in p.overridden]
            out.append(rec)
    return out

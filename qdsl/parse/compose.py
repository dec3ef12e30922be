"""Composition: flatten ``include``s and apply overrides (``--set`` / ``overrides=``).

Merging an included spec B into the including spec A (A wins):

* ``version`` is A's; ``fold_bn``/``bias_correction``/``learned_rounding``: A's if set.
* presets (``quantizers``): A's replace B's of the same name, whole.
* ``defaults``: per role; a role value in A that names a preset (``extends``) or is
  ``float`` replaces B's for that role, any other A value edits B's field by field;
  ``skip``/``accumulator``: A's if set.
* rules: B's first, then A's (so provenance lists them in reading order).
* Several includes merge left to right, then the file itself goes on top.

Include paths are relative to the including file's directory (to the current directory
for a spec built in memory, whose ``source`` is None).  A cycle is E111 showing
the chain with the location of every ``include``; a missing/unreadable file is E110 at
the ``include`` that names it.

Overrides (``parse_overrides``): ``ROLE=V`` and ``ROLE.FIELD=V`` go into
``QuantSpec.overrides`` (applied above every rule by the resolver);
``defaults.ROLE[.FIELD]=V`` edits the defaults; ``quantizers.NAME[.FIELD]=V`` edits (or
with the whole value, defines) a preset; ``fold_bn``, ``bias_correction`` and
``learned_rounding`` set the top-level flags.  Values are DSL values (``4``, ``pot``,
``w4pot(bits=8)``, ``histogram(percentile=99.9)``); errors are located in the
``--set`` string (file ``<--set>``, column inside it).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import attrs

from qdsl.parse.dsl_grammar import parse_value
from qdsl.parse.lower import value_node
from qdsl.parse.schema import LEARNED_ROUNDINGS, QUANT_KEYS, SchemaLowerer
from qdsl.parse.tree import Node
from qdsl.spec.diagnostics import Diagnostic, Span, SpecError, UNKNOWN_SPAN, did_you_mean
from qdsl.spec.formats import is_float
from qdsl.spec.model import QuantSpec, Role, RuleBody, TensorQuant

__all__ = ["Override", "parse_overrides", "compose", "merge_specs", "merge_quant", "merge_body"]

_ROLES = tuple(r.value for r in Role)
_TOP = ("fold_bn", "bias_correction", "learned_rounding")
_HEADS = _ROLES + ("defaults", "quantizers") + _TOP
_SET_FILE = "<--set>"


@attrs.frozen
class Override:
    """One validated override: where it goes and the value, already lowered."""

    target: tuple[str, ...]
    """``("overrides", ROLE)``, ``("defaults", ROLE)``, ``("quantizers", NAME)`` or ``(FLAG,)``."""
    value: Any
    """A ``TensorQuant`` for the first three, else a bool/str."""
    text: str
    span: Span = attrs.field(default=UNKNOWN_SPAN, eq=False)


# -- merging -----------------------------------------------------------------------------


def merge_quant(base: TensorQuant, top: TensorQuant) -> TensorQuant:
    """``top``'s set fields over ``base``'s (``extends`` included), spans merged."""
    fields = {f: getattr(top, f) if getattr(top, f) is not None else getattr(base, f)
              for f in QUANT_KEYS}
    spans = {**base.field_spans, **top.field_spans}
    return TensorQuant(**fields, span=top.span, field_spans=spans)


def _replaces(tq: TensorQuant) -> bool:
    return tq.extends is not None or (tq.kind is not None and is_float(tq.kind))


def merge_body(base: RuleBody, top: RuleBody) -> RuleBody:
    roles = dict(base.roles)
    for role, tq in top.roles.items():
        roles[role] = tq if role not in roles or _replaces(tq) else merge_quant(roles[role], tq)
    return RuleBody(
        roles,
        top.skip if top.skip is not None else base.skip,
        top.accumulator if top.accumulator is not None else base.accumulator,
        span=top.span,
    )


def merge_specs(base: QuantSpec, top: QuantSpec) -> QuantSpec:
    """``top`` (the including file) over ``base`` (what it includes)."""
    pick = {f: getattr(top, f) if getattr(top, f) is not None else getattr(base, f) for f in _TOP}
    return QuantSpec(
        version=top.version,
        **pick,
        includes=(),
        quantizers={**base.quantizers, **top.quantizers},
        defaults=merge_body(base.defaults, top.defaults),
        rules=base.rules + top.rules,
        overrides=merge_body(base.overrides, top.overrides),
        source=top.source,
        span=top.span,
    )


# -- includes --------------------------------------------------------------------------


def _flatten(spec: QuantSpec, chain: tuple[tuple[str, str, Span], ...],
             load: Callable[[str], QuantSpec]) -> QuantSpec:
    if not spec.includes:
        return spec
    base_dir = os.path.dirname(spec.source) if spec.source else ""
    spans = list(spec.include_spans) + [UNKNOWN_SPAN] * (len(spec.includes) - len(spec.include_spans))
    merged: QuantSpec | None = None
    diags: list[Diagnostic] = []
    for path, span in zip(spec.includes, spans):
        full = os.path.normpath(os.path.join(base_dir, path))
        real = os.path.realpath(full)
        seen = [c for c in chain if c[1] == real]
        if seen:
            links = list(chain[chain.index(seen[0]):])
            names = [c[0] for c in links] + [full]
            notes = []
            for i, (shown, _, _) in enumerate(links):
                nxt, nxt_span = (links[i + 1][0], links[i + 1][2]) if i + 1 < len(links) else (full, span)
                notes.append(f"{shown} includes {nxt} at {nxt_span.location()}")
            notes = tuple(notes)
            diags.append(Diagnostic.error("E111", "include cycle: " + " -> ".join(names), span,
                                          "remove one of these includes", notes=notes))
            continue
        if not os.path.isfile(full):
            diags.append(Diagnostic.error("E110", f"included file '{path}' not found", span,
                                          "include paths are relative to the including file's directory"))
            continue
        try:
            sub = _flatten(load(full), chain + ((full, real, span),), load)
        except SpecError as err:
            diags.extend(err.diagnostics)
            continue
        merged = sub if merged is None else merge_specs(merged, sub)
    if diags:
        raise SpecError(diags)
    own = attrs.evolve(spec, includes=(), include_spans=())
    return own if merged is None else merge_specs(merged, own)


# -- overrides -------------------------------------------------------------------------


def _parse_one(item: str, value: Any, lowerer: SchemaLowerer) -> Override | None:
    """``item`` is the full ``KEY=VALUE`` text (for carets); ``value`` a Python value or None."""
    key_text = item.split("=", 1)[0]
    parts = key_text.strip().split(".")
    lead = len(key_text) - len(key_text.lstrip())
    key_span = Span(_SET_FILE, 1, lead + 1, 1, lead + len(key_text.strip()) + 1, source=item)

    def bad(msg: str, *hints: str, part: int | None = None) -> None:
        span = key_span
        if part is not None:  # point at the offending dotted component
            start = lead + sum(len(p) + 1 for p in parts[:part])
            span = Span(_SET_FILE, 1, start + 1, 1, start + len(parts[part]) + 1, source=item)
        lowerer.err("E112", msg, span, *hints)

    head = parts[0]
    if head not in _HEADS:
        bad(f"unknown override '{key_text.strip()}'", did_you_mean(head, _HEADS, "override heads"),
            "e.g. weight.bits=4, defaults.input=a8, quantizers.w4.bits=3, fold_bn=true", part=0)
        return None
    if head in ("defaults", "quantizers"):
        if len(parts) not in (2, 3):
            bad(f"'{head}' overrides are {head}.{'ROLE' if head == 'defaults' else 'NAME'}[.FIELD]=VALUE")
            return None
        where, name, field = head, parts[1], (parts[2] if len(parts) == 3 else None)
        if head == "defaults" and name not in _ROLES:
            bad(f"unknown role '{name}'", did_you_mean(name, _ROLES, "roles"), part=1)
            return None
    elif head in _ROLES:
        if len(parts) > 2:
            bad("role overrides are ROLE=VALUE or ROLE.FIELD=VALUE")
            return None
        where, name, field = "overrides", head, (parts[1] if len(parts) == 2 else None)
    else:
        if len(parts) != 1:
            bad(f"'{head}' takes no sub-key")
            return None
        where, name, field = head, head, None
    if field is not None and field not in QUANT_KEYS:
        bad(f"unknown field '{field}'", did_you_mean(field, QUANT_KEYS, "fields"), part=len(parts) - 1)
        return None
    offset = len(key_text) + 1
    context = field if field is not None else (name if where in ("overrides", "defaults") else
                                               ("weight" if where == "quantizers" else None))
    if value is None:
        node = value_node(item[offset:], context, _SET_FILE, offset, item)
    else:
        node = _python_node(value, context, Span(_SET_FILE, 1, offset + 1, 1, len(item) + 1, source=item))
    if where in _TOP:
        if where == "learned_rounding":
            result = lowerer.choice(node, LEARNED_ROUNDINGS, "learned_rounding")
        else:
            result = lowerer.boolean(node, where)
        return None if result is None else Override((where,), result, item, key_span)
    if field is not None:
        node = Node({field: attrs.evolve(node, key_span=key_span)}, node.span)
    role = Role(name) if where in ("overrides", "defaults") else None
    tq = lowerer.quant(node, role, "in --set")
    return None if tq is None else Override((where, name), tq, item, key_span)


def _python_node(value: Any, context: str | None, span: Span) -> Node:
    if isinstance(value, str):
        parsed, diags = parse_value(value)
        if parsed is not None:
            return value_node(value, context, _SET_FILE, span.col - 1, span.source)
        return Node(value, span)
    if isinstance(value, Mapping):
        return Node({str(k): attrs.evolve(_python_node(v, None, span), key_span=span) for k, v in value.items()}, span)
    if isinstance(value, (list, tuple)):
        return Node([_python_node(v, None, span) for v in value], span)
    return Node(value, span)


def parse_overrides(items: Sequence[str] | Mapping[str, Any] | None) -> list[Override]:
    """Validate overrides: ``["weight.bits=4", ...]`` (CLI) or ``{"weight.bits": 4}`` (API)."""
    if not items:
        return []
    lowerer = SchemaLowerer()
    out: list[Override] = []
    if isinstance(items, Mapping):
        pairs = [(f"{k}={v!r}" if not isinstance(v, str) else f"{k}={v}", v) for k, v in items.items()]
    else:
        pairs = [(str(item), None) for item in items]
    for item, value in pairs:
        if "=" not in item:
            lowerer.err("E112", f"override '{item}' has no '='", Span(_SET_FILE, 1, 1, 1, len(item) + 1, source=item),
                        "write KEY=VALUE, e.g. weight.bits=4")
            continue
        try:
            ov = _parse_one(item, value, lowerer)
        except SpecError as err:
            lowerer.diags.extend(err.diagnostics)
            continue
        if ov is not None:
            out.append(ov)
    if lowerer.diags:
        raise SpecError(lowerer.diags)
    return out


def _apply(spec: QuantSpec, overrides: list[Override]) -> QuantSpec:
    diags = []
    for ov in overrides:
        where = ov.target[0]
        if where in _TOP:
            spec = attrs.evolve(spec, **{where: ov.value})
        elif where == "overrides":
            spec = attrs.evolve(spec, overrides=merge_body(spec.overrides, RuleBody({ov.target[1]: ov.value})))
        elif where == "defaults":
            spec = attrs.evolve(spec, defaults=merge_body(spec.defaults, RuleBody({ov.target[1]: ov.value})))
        else:
            name = ov.target[1]
            whole = "." not in ov.text.split("=", 1)[0].strip()[len("quantizers.") :]
            if name not in spec.quantizers and not whole:
                diags.append(Diagnostic.error("E112", f"no quantizer named '{name}' to override", ov.span,
                                              did_you_mean(name, spec.quantizers, "quantizers")))
                continue
            presets = dict(spec.quantizers)
            presets[name] = ov.value if whole else merge_quant(presets[name], ov.value)
            spec = attrs.evolve(spec, quantizers=presets)
    if diags:
        raise SpecError(diags)
    return spec


def _as_overrides(overrides: Any) -> list[Override]:
    if isinstance(overrides, str):  # one "KEY=VALUE" given on its own
        return parse_overrides([overrides])
    if isinstance(overrides, Mapping):
        return parse_overrides(overrides)
    items = list(overrides)
    if items and all(isinstance(o, Override) for o in items):
        return items
    return parse_overrides([str(o) for o in items])


def compose(spec: QuantSpec, overrides: Sequence[str] | Mapping[str, Any] | Sequence[Override] | None = None,
            *, load: Callable[[str], QuantSpec] | None = None) -> QuantSpec:
    """Flatten ``spec``'s includes (recursively) and apply ``overrides``; the result has no includes."""
    if load is None:
        from qdsl.parse import parse_file as load  # the public loader; imported late to avoid a cycle
    root = (spec.source, os.path.realpath(spec.source), UNKNOWN_SPAN) if spec.source else None
    flat = _flatten(spec, (root,) if root else (), load)
    if overrides:
        ovs = _as_overrides(overrides)
        flat = _apply(flat, ovs)
    return flat

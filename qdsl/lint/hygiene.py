"""Spec hygiene against a model: rules that match nothing, rules that never win.

* W330: a rule that applies to no layer of this model and is not ``optional``.  (The
  resolver makes this an error; lint resolves with every rule optional so the rest of
  the spec can still be checked, and reports it here as a finding.)
* W331: a rule that applies to layers but is *fully shadowed*: on every layer it
  matches, every field it sets (quantizer fields through its presets, ``skip``,
  ``accumulator``) was won by a higher-precedence source.  Losing only to API/CLI
  overrides does not count: that is what overrides are for.  A rule "wins" a field
  when the plan's provenance names it (its label, at one of the spans it writes).
"""

from __future__ import annotations

from qdsl.resolve.check import Body, Prepared
from qdsl.resolve.plan import Plan
from qdsl.resolve.targets import unmatched_hint
from qdsl.spec.diagnostics import Diagnostic
from qdsl.spec.model import QuantSpec

__all__ = ["check_hygiene"]


def _setter_spans(body: Body) -> set[tuple]:
    spans = set()
    for role, fields in body.roles.items():
        for c in fields.values():
            s = body.set_by_span(role, c)
            spans.add((s.file, s.line, s.col))
    for c in (body.skip, body.accumulator):
        if c is not None:
            spans.add((c.span.file, c.span.line, c.span.col))
            spans.add((body.span.file, body.span.line, body.span.col))
    return spans


def _winners(layer, cache: dict) -> set[tuple]:
    """(label, location) of every source that won a field on ``layer``, plus the sources
    that lost only to an override.  Layers resolved from the same sources share their
    provenance objects, so the set is computed once per distinct provenance."""
    key = tuple(map(id, layer.provenance.values()))
    got = cache.get(key)
    if got is None:
        got = set()
        for p in layer.provenance.values():
            origins = [p.set_by]
            if p.set_by.label.startswith("override"):
                origins += [o for o, _ in p.overridden]
            for o in origins:
                s = o.span
                label = o.label.split(" via ", 1)[0]
                got.add((label, (s.file, s.line, s.col) if s.known else None))
        cache[key] = got
    return got


def check_hygiene(plan: Plan, prep: Prepared, original: QuantSpec) -> list[Diagnostic]:
    out: list[Diagnostic] = []
    applied = {m.rule_index: m.fqns for m in plan.rule_matches}
    layers = {layer.fqn: layer for layer in plan.layers}
    cache: dict = {}
    winners: dict[str, set] = {}
    for i, (rule, body) in enumerate(zip(original.rules, prep.rules)):
        fqns = applied.get(i, ())
        if not fqns:
            if rule.optional:
                continue
            hints = []
            if plan.index is not None and rule.targets:
                hints.append(unmatched_hint(rule.targets[0], plan.index))
            hints.append("add 'optional' to the rule if matching nothing is expected, or delete it")
            out.append(Diagnostic.warning(
                "W330", f"{rule.describe()} matches no layer of this model it can apply to", rule.span, *hints))
            continue
        spans = _setter_spans(body)
        mine = {(body.label, loc) for loc in spans} | {(body.label, None)}
        won = False
        for f in fqns:
            if f not in winners and f in layers:
                winners[f] = _winners(layers[f], cache)
            if mine & winners.get(f, set()):
                won = True
                break
        beaten_by: dict[str, str] = {}
        if not won:
            # notes show at most four winners; a few dozen layers find them
            for fqn in fqns[:64]:
                if len(beaten_by) >= 4:
                    break
                layer = layers.get(fqn)
                if layer is None:
                    continue
                if layer.skip and ("layer", "skip") in layer.provenance:
                    beaten_by.setdefault("skip", str(layer.provenance[("layer", "skip")].set_by))
                for (role, field), p in layer.provenance.items():
                    if any(o.label == body.label or o.label.startswith(body.label + " via") for o, _ in p.overridden):
                        what = field if role == "layer" else f"{getattr(role, 'value', role)}.{field}"
                        beaten_by.setdefault(what, str(p.set_by))
        if not won:
            notes = tuple(f"{what} is set by {who}" for what, who in list(beaten_by.items())[:4])
            out.append(Diagnostic.warning(
                "W331", f"{rule.describe()} is fully shadowed: on every layer it matches, what it sets is "
                f"overridden by higher-precedence rules", rule.span,
                "delete the rule, or give it a higher 'priority' / a more specific target", notes=notes))
    return out

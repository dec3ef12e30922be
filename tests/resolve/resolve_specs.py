"""Builders for in-memory specs with fake but distinct source locations.

Also ``ref_glob``, an independent component-wise glob matcher used as a reference.
Tests construct ``QuantSpec`` records directly so the resolver is tested on its own;
every node gets a span on its own line of a pretend file ``m.qspec`` so diagnostics and
provenance can be checked for *where* they point.
"""

from __future__ import annotations

import fnmatch

from qdsl.spec.diagnostics import Span
from qdsl.spec.model import Accumulator, QuantSpec, Role, Rule, RuleBody, Target, TensorQuant

FILE = "m.qspec"


def sp(line: int, col: int = 1) -> Span:
    return Span(FILE, line, col, line, col + 1)


def tq(line: int, **fields) -> TensorQuant:
    """A quantizer written on ``line``; field ``i`` (in keyword order) sits at column 10*(i+1)."""
    spans = {name: sp(line, 10 * (i + 1)) for i, name in enumerate(fields)}
    return TensorQuant(**fields, span=sp(line), field_spans=spans)


def body(line: int, skip=None, accumulator: Accumulator | None = None, **roles: TensorQuant) -> RuleBody:
    return RuleBody({Role(k): v for k, v in roles.items()}, skip=skip, accumulator=accumulator, span=sp(line))


def rule(line: int, *targets: str, priority=None, optional=False, name=None, skip=None, accumulator=None,
         **roles: TensorQuant) -> Rule:
    ts = [Target.parse(t, sp(line, 6 + 12 * i)) for i, t in enumerate(targets)]
    return Rule(ts, body(line, skip, accumulator, **roles), optional, priority, name, sp(line))


def spec(presets=None, defaults: RuleBody | None = None, rules=(), overrides: RuleBody | None = None) -> QuantSpec:
    return QuantSpec(
        quantizers=presets or {},
        defaults=defaults or RuleBody(),
        rules=list(rules),
        overrides=overrides or RuleBody(),
        span=sp(1),
    )


def ref_glob(pattern: str, name: str) -> bool:
    """Reference: component-wise; a whole ``**`` component eats zero or more components."""

    def go(ps: list[str], ns: list[str]) -> bool:
        if not ps:
            return not ns
        if ps[0] == "**":
            return any(go(ps[1:], ns[k:]) for k in range(len(ns) + 1))
        return bool(ns) and fnmatch.fnmatchcase(ns[0], ps[0]) and go(ps[1:], ns[1:])

    return go(pattern.split("."), name.split(".") if name else [])

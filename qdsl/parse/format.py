"""Canonical printing of a ``QuantSpec`` as ``.qspec`` text or ``.qspec.toml``.

Guarantee (property-tested): for every spec the front ends can produce,
``parse(format_spec(spec, to=X)) == spec`` for both X.  Output is canonical: fixed
statement and field order, one statement per line, two-space indentation, so
``qdsl fmt`` is idempotent and diffs stay small.  ``QuantSpec.overrides`` is never
printed (overrides come from the API/CLI, not from files); ``includes`` are printed
as written (formatting does not flatten them).
"""

from __future__ import annotations

import re
from typing import Any

from qdsl.parse.dsl_grammar import RULE_OPTIONS
from qdsl.spec.formats import is_float, is_format_name, kind_name
from qdsl.spec.model import (
    DERIVED_BIAS_SCALE,
    TENSOR_QUANT_FIELDS,
    Accumulator,
    Granularity,
    GranularityKind,
    Kind,
    ObserverSpec,
    QuantSpec,
    Role,
    Rule,
    RuleBody,
    Target,
    TargetKind,
    TensorQuant,
)

__all__ = ["format_spec", "quote_string", "format_quant_dsl", "format_value_dsl"]

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BARE_TARGET = re.compile(r"(?:type:|@)?[A-Za-z0-9_.*?\[\]!\-]+")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def quote_string(s: str) -> str:
    """A double-quoted string valid in both TOML and the DSL (same escapes)."""
    out = []
    for ch in s:
        if ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _dsl_string(s: str) -> str:
    # raw single quotes read best (no escapes in regexes) when the text allows them
    if "'" not in s and all(0x20 <= ord(c) != 0x7F for c in s):
        return f"'{s}'"
    return quote_string(s)


def _number(v: int | float) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def format_value_dsl(v: Any) -> str:
    """A parameter value: true/false, a number, a bare name, or a quoted string."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return _number(v)
    if _IDENT.fullmatch(v) and v not in ("true", "false"):
        return v
    return _dsl_string(v)


def _value_toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return _number(v)
    return quote_string(v)


# -- DSL -------------------------------------------------------------------------------


def _granularity_dsl(g: Granularity) -> str:
    if g.kind is GranularityKind.TENSOR:
        return "per_tensor"
    if g.kind is GranularityKind.CHANNEL:
        return "per_channel" if g.axis is None else f"granularity=channel({g.axis})"
    if g.kind is GranularityKind.GATE:
        return "granularity=gate"
    if g.kind is GranularityKind.TOKEN:
        return "per_token"
    return f"granularity=group({g.group_size})"


def _observer_dsl(o: ObserverSpec) -> str:
    if not o.params:
        return o.name
    return f"{o.name}(" + ", ".join(f"{k}={format_value_dsl(v)}" for k, v in o.params) + ")"


_FLAG_WORDS = {
    "signed": ("signed", "unsigned"),
    "narrow_range": ("narrow", "narrow_range=false"),
    "symmetric": ("symmetric", "asymmetric"),
    "dynamic": ("dynamic", "dynamic=false"),
}


def format_quant_dsl(tq: TensorQuant) -> str:
    """``w4pot(bits=8)``, ``int(bits=4, signed, per_channel)``, ``float``, ``(bits=4)``."""
    args: list[str] = []
    head = ""
    if tq.extends is not None:
        head = tq.extends
        if tq.kind is not None:
            args.append(f"kind={kind_name(tq.kind)}")
    elif isinstance(tq.kind, Kind):
        head = tq.kind.value
    elif tq.kind is not None and is_format_name(tq.kind):  # a minifloat reads as a kind head
        head = tq.kind
    elif tq.kind is not None:  # a registered format's name: ``(kind=name, ...)``, not a preset head
        args.append(f"kind={tq.kind}")
    for field in TENSOR_QUANT_FIELDS[1:]:
        v = getattr(tq, field)
        if v is None:
            continue
        if field in _FLAG_WORDS:
            args.append(_FLAG_WORDS[field][0 if v else 1])
        elif field == "granularity":
            args.append(_granularity_dsl(v))
        elif field == "observer":
            args.append(f"observer={_observer_dsl(v)}")
        elif field == "scale" and v == DERIVED_BIAS_SCALE:
            args.append(f"scale={v}")
        else:
            args.append(f"{field}={format_value_dsl(v)}")
    if not args:
        return head or "()"
    return f"{head}(" + ", ".join(args) + ")"


def _target_dsl(t: Target) -> str:
    text = t.text
    if t.kind is TargetKind.REGEX:
        return "re:" + _dsl_string(t.pattern)
    if (_BARE_TARGET.fullmatch(text) and text not in RULE_OPTIONS and not text.startswith("re:")
            and Target.parse(text) == t):
        return text
    return _dsl_string(text)


def _body_dsl(body: RuleBody, indent: str) -> list[str]:
    out = []
    for role in Role:
        if role in body.roles:
            out.append(f"{indent}{role.value} = {format_quant_dsl(body.roles[role])}")
    if body.skip is not None:
        out.append(f"{indent}skip" if body.skip else f"{indent}skip = false")
    if body.accumulator is not None:
        a: Accumulator = body.accumulator
        out.append(f"{indent}accumulator(bits={a.bits}, overflow={a.overflow.value}"
                   f"{', constrain=true' if a.constrain else ''})")
    return out


def _rule_dsl(rule: Rule) -> list[str]:
    head = "rule " + ", ".join(_target_dsl(t) for t in rule.targets)
    if rule.optional:
        head += " optional"
    if rule.priority is not None:
        head += f" priority {rule.priority}"
    if rule.name is not None:
        name = rule.name if _IDENT.fullmatch(rule.name) else _dsl_string(rule.name)
        head += f" as {name}"
    body = _body_dsl(rule.body, "  ")
    if not body:
        return [head + " { }"]
    return [head + " {", *body, "}"]


def _to_dsl(spec: QuantSpec) -> str:
    out = [f"version {spec.version}"]
    for flag in ("fold_bn", "bias_correction"):
        v = getattr(spec, flag)
        if v is not None:
            out.append(flag if v else f"{flag} = false")
    if spec.learned_rounding is not None:
        out.append(f"learned_rounding = {spec.learned_rounding}")
    out += [f"include {_dsl_string(p)}" for p in spec.includes]
    if spec.quantizers:
        out.append("")
        out += [f"quantizer {n} = {format_quant_dsl(q)}" for n, q in spec.quantizers.items()]
    body = _body_dsl(spec.defaults, "  ")
    if body:
        out += ["", "defaults {", *body, "}"]
    for rule in spec.rules:
        out.append("")
        out += _rule_dsl(rule)
    return "\n".join(out) + "\n"


# -- TOML ------------------------------------------------------------------------------


def _quant_items_toml(tq: TensorQuant) -> list[tuple[str, str]]:
    items = []
    if tq.extends is not None:
        items.append(("extends", quote_string(tq.extends)))
    for field in TENSOR_QUANT_FIELDS:
        v = getattr(tq, field)
        if v is None:
            continue
        if isinstance(v, Kind):
            items.append((field, quote_string(v.value)))
        elif isinstance(v, Granularity):
            if v.kind is GranularityKind.GROUP:
                items.append((field, f'{{ kind = "group", size = {v.group_size} }}'))
            elif v.kind is GranularityKind.CHANNEL and v.axis is not None:
                items.append((field, f'{{ kind = "channel", axis = {v.axis} }}'))
            else:
                items.append((field, quote_string(v.kind.value)))
        elif isinstance(v, ObserverSpec):
            if not v.params:
                items.append((field, quote_string(v.name)))
            else:
                params = "".join(f", {_key_toml(k)} = {_value_toml(p)}" for k, p in v.params)
                items.append((field, f"{{ name = {quote_string(v.name)}{params} }}"))
        else:
            items.append((field, _value_toml(v)))
    return items


def _key_toml(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else quote_string(k)


def _role_toml(tq: TensorQuant) -> str:
    if tq.extends is not None and not tq.set_fields():
        return quote_string(tq.extends)
    if tq.extends is None and list(tq.set_fields()) == ["kind"] and is_float(tq.kind):
        return quote_string("float")
    items = _quant_items_toml(tq)
    if not items:
        return "{}"
    return "{ " + ", ".join(f"{k} = {v}" for k, v in items) + " }"


def _body_toml(body: RuleBody) -> list[str]:
    out = [f"{r.value} = {_role_toml(body.roles[r])}" for r in Role if r in body.roles]
    if body.skip is not None:
        out.append(f"skip = {_value_toml(body.skip)}")
    if body.accumulator is not None:
        a = body.accumulator
        out.append(f'accumulator = {{ bits = {a.bits}, overflow = "{a.overflow.value}"'
                   f'{", constrain = true" if a.constrain else ""} }}')
    return out


def _to_toml(spec: QuantSpec) -> str:
    out = [f"version = {spec.version}"]
    for flag in ("fold_bn", "bias_correction"):
        v = getattr(spec, flag)
        if v is not None:
            out.append(f"{flag} = {_value_toml(v)}")
    if spec.learned_rounding is not None:
        out.append(f"learned_rounding = {quote_string(spec.learned_rounding)}")
    if spec.includes:
        out.append("include = [" + ", ".join(quote_string(p) for p in spec.includes) + "]")
    for name, tq in spec.quantizers.items():
        out += ["", f"[quantizers.{name}]"]
        out += [f"{k} = {v}" for k, v in _quant_items_toml(tq)]
    body = _body_toml(spec.defaults)
    if body:
        out += ["", "[defaults]", *body]
    for rule in spec.rules:
        out += ["", "[[rules]]"]
        if len(rule.targets) == 1:
            out.append(f"target = {quote_string(rule.targets[0].text)}")
        else:
            out.append("target = [" + ", ".join(quote_string(t.text) for t in rule.targets) + "]")
        if rule.name is not None:
            out.append(f"name = {quote_string(rule.name)}")
        if rule.optional:
            out.append("optional = true")
        if rule.priority is not None:
            out.append(f"priority = {rule.priority}")
        out += _body_toml(rule.body)
    return "\n".join(out) + "\n"


def format_spec(spec: QuantSpec, to: str = "qspec") -> str:
    """The canonical text of ``spec`` in the DSL (``to="qspec"``) or TOML (``to="toml"``)."""
    if to in ("qspec", "dsl"):
        return _to_dsl(spec)
    if to == "toml":
        return _to_toml(spec)
    raise ValueError(f"unknown format {to!r}; use 'qspec' or 'toml'")

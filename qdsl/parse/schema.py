"""One schema for both syntaxes: a located value tree (:class:`Node`) -> :class:`QuantSpec`.

Checks made here, each a located E1xx diagnostic (all of a file's problems are
collected, then raised together as one ``SpecError``):

* E101 unknown key/field (with did-you-mean), E102 wrong type, E103 missing key,
  E104 value out of range, E105 unknown enum value, E106 duplicate, E107 bad name,
  E108 bad target, E109 unsupported version.
* Ranges: ``bits`` 1..16 on weight/input/output, 1..32 on bias and in presets (a preset
  may serve the bias role); accumulator bits 2..64 (the integer graph's range); observer
  params finite.

Not checked here (the resolver does, after ``extends`` and the cascade): whether a
preset exists, whether a field combination is valid (binary + zero point ...), and
whether a registry knows a scale/observer/rounding name (users register their own).
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, Callable

import attrs

from qdsl.parse.located_toml import toml_type_name
from qdsl.parse.tree import Node
from qdsl.spec.diagnostics import Diagnostic, Span, SpecError, did_you_mean
from qdsl.spec.formats import NumberFormat, format_of, is_float, looks_like_minifloat, threshold_misuse
from qdsl.spec.model import (
    DERIVED_BIAS_SCALE,
    SPEC_VERSION,
    Accumulator,
    Granularity,
    GranularityKind,
    Kind,
    ObserverSpec,
    Overflow,
    QuantSpec,
    Role,
    Rule,
    RuleBody,
    Target,
    TargetKind,
    TARGET_POSITIONS,
    TensorQuant,
    THRESHOLDS,
)

__all__ = [
    "lower_tree",
    "SchemaLowerer",
    "QUANT_KEYS",
    "BODY_KEYS",
    "RULE_KEYS",
    "TOP_KEYS",
    "LEARNED_ROUNDINGS",
    "RESERVED_PRESET_NAMES",
    "PRESET_NAME_RE",
    "PART_NAME_RE",
]

PRESET_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PART_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")  # registry names are snake_case
RESERVED_PRESET_NAMES = frozenset([k.value for k in Kind] + ["true", "false"])
LEARNED_ROUNDINGS = ("none", "adaround", "gptq")
_NON_FINITE_NAMES = ("inf", "infinity", "nan")
ROLE_NAMES = tuple(r.value for r in Role)
QUANT_KEYS = ("kind", "bits", "signed", "narrow_range", "symmetric", "scale", "granularity",
              "observer", "rounding", "dynamic", "threshold", "extends")
BODY_KEYS = ROLE_NAMES + ("skip", "accumulator")
RULE_KEYS = ("target", "name", "optional", "priority") + BODY_KEYS
TOP_KEYS = ("version", "fold_bn", "bias_correction", "learned_rounding", "include",
            "quantizers", "defaults", "rules")
_NO_FORMAT = NumberFormat()  # a kind only the resolver's registries know (checked there)
_BOOL_FIELDS = ("signed", "narrow_range", "symmetric", "dynamic")
_AXIS_RANGE = (-8, 7)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class SchemaLowerer:
    """Collects diagnostics while lowering; reusable for single pieces (``--set`` values)."""

    def __init__(self) -> None:
        self.diags: list[Diagnostic] = []
        self._bad_names: dict[str, int] = {}
        """Invalid preset names already reported -> index of their diagnostic: a bad name
        is one error (at its first occurrence, noting the others), not one per use."""

    def err(self, code: str, message: str, span: Span, *hints: str, notes: tuple[str, ...] = ()) -> None:
        self.diags.append(Diagnostic.error(code, message, span, *hints, notes=notes))

    # -- helpers -----------------------------------------------------------------
    def _table(self, node: Node, allowed: tuple[str, ...], where: str, what: str = "key") -> dict[str, Node]:
        """Entries of a table node whose keys are allowed; E101 for the others."""
        out = {}
        for key, child in node.items():
            if key in allowed:
                out[key] = child
            else:
                self.err("E101", f"unknown {what} '{key}' {where}", child.where,
                         did_you_mean(key, allowed, what + "s"))
        return out

    def _want(self, node: Node, ok: Callable[[Any], bool], want: str | Callable[[], str], name: str) -> bool:
        if ok(node.value):
            return True
        want = want() if callable(want) else want  # built only for the message
        self.err("E102", f"{name} must be {want}, got {self._shown(node)}", node.span)
        return False

    @staticmethod
    def _shown(node: Node) -> str:
        if node.form == "call":
            return "a call"
        if node.form == "name":
            return f"the name '{node.value}'"
        return toml_type_name(node.value)

    def boolean(self, node: Node, name: str) -> bool | None:
        return node.value if self._want(node, lambda v: isinstance(v, bool), "true or false", name) else None

    def integer(self, node: Node, name: str, lo: int, hi: int, hint: str = "") -> int | None:
        if not self._want(node, _is_int, "an integer", name):
            return None
        if not lo <= node.value <= hi:
            self.err("E104", f"{name} = {node.value} is out of range", node.span,
                     hint or f"{name} must be in {lo}..{hi}")
            return None
        return node.value

    def choice(self, node: Node, choices: tuple[str, ...], name: str) -> str | None:
        if not self._want(node, lambda v: isinstance(v, str), lambda: "one of " + ", ".join(choices), name):
            return None
        if node.value not in choices:
            self.err("E105", f"unknown {name} '{node.value}'", node.span, did_you_mean(node.value, choices))
            return None
        return node.value

    def _part_name(self, node: Node, what: str) -> str | None:
        if not self._want(node, lambda v: isinstance(v, str), f"a {what} name", what):
            return None
        if not PART_NAME_RE.match(node.value):
            self.err("E107", f"'{node.value}' is not a valid {what} name", node.span,
                     "part names are snake_case: lowercase letters, digits and '_'")
            return None
        return node.value

    def preset_name(self, name: str, span: Span) -> bool:
        if not PRESET_NAME_RE.match(name):
            first = self._bad_names.get(name)
            if first is not None:
                d = self.diags[first]
                self.diags[first] = attrs.evolve(d, notes=d.notes + (f"also written at {span.line}:{span.col}",))
                return False
            self._bad_names[name] = len(self.diags)
            self.err("E107", f"'{name}' is not a valid quantizer name", span,
                     "names are ASCII letters, digits and '_', not starting with a digit")
            return False
        if looks_like_minifloat(name):  # the DSL reads such a name as the kind
            self.err("E107", f"'{name}' is a minifloat format's name and cannot name a quantizer", span,
                     "pick another name (e.g. w_" + name + ")")
            return False
        if name in RESERVED_PRESET_NAMES:
            self.err("E107", f"'{name}' is reserved and cannot name a quantizer", span,
                     "reserved: " + ", ".join(sorted(RESERVED_PRESET_NAMES)))
            return False
        return True

    # -- tensor quantizers ---------------------------------------------------------
    def quant(self, node: Node, role: Role | None, where: str) -> TensorQuant | None:
        """A role value or preset: a preset name, ``"float"``, or a table of fields."""
        label = role.value if role else "quantizer"
        if isinstance(node.value, str):
            if is_float(node.value):
                return TensorQuant(kind=Kind.FLOAT, span=node.span, field_spans={"kind": node.span})
            if not self.preset_name(node.value, node.span):
                return None
            return TensorQuant(extends=node.value, span=node.span, field_spans={"extends": node.span})
        if not node.is_table:
            self.err("E102", f"{label} must be a quantizer name, \"float\" or a table of fields, "
                     f"got {self._shown(node)}", node.span)
            return None
        fields: dict[str, Any] = {}
        spans: dict[str, Span] = {}
        context = where if role is None else f"in {role.value} {where}".rstrip()
        for key, child in self._table(node, QUANT_KEYS, context, "field").items():
            value = self._field(key, child, role)
            if value is not None:
                fields[key] = value
                spans[key] = child.span
        if fields.get("threshold") == "learned":
            kind = fields.get("kind")
            fmt = None if kind is None else format_of(kind, default=_NO_FORMAT)
            bad = threshold_misuse(None if fmt is _NO_FORMAT else fmt, fields.get("signed"), role)
            if bad is not None:  # what this node writes (E220); the resolver checks the cascade again
                self.err("E220", bad[1], spans["threshold"], bad[2])
                return None
        return TensorQuant(**fields, span=node.span, field_spans=spans)

    def _field(self, key: str, node: Node, role: Role | None) -> Any:
        if key == "kind":
            builtin = tuple(k.value for k in Kind)
            if isinstance(node.value, str) and looks_like_minifloat(node.value):
                return node.value  # a minifloat: resolve checks the name's fields (E224)
            if (isinstance(node.value, str) and node.value not in builtin and PART_NAME_RE.match(node.value)
                    and not difflib.get_close_matches(node.value, builtin, n=1, cutoff=0.6)):
                # a registered number format's name (qdsl.spec.formats): resolve checks it
                # against Registries.formats (E204); a near-miss of a built-in stays E105
                return node.value
            kind = self.choice(node, builtin, "kind")
            return Kind(kind) if kind else None
        if key == "bits":
            hi = 32 if role in (None, Role.BIAS) else 16
            hint = f"bits must be in 1..{hi}" + (" (bias may use up to 32)" if hi == 16 else "")
            return self.integer(node, "bits", 1, hi, hint)
        if key in _BOOL_FIELDS:
            return self.boolean(node, key)
        if key == "scale":
            if node.value == DERIVED_BIAS_SCALE:
                if role not in (None, Role.BIAS):
                    self.err("E105", f"scale '{DERIVED_BIAS_SCALE}' is only for the bias role", node.span,
                             "use a scale rule such as float, pot or learned")
                    return None
                return DERIVED_BIAS_SCALE
            return self._part_name(node, "scale")
        if key in ("rounding",):
            return self._part_name(node, "rounding")
        if key == "threshold":
            return self.choice(node, THRESHOLDS, "threshold")
        if key == "extends":
            ok = self._want(node, lambda v: isinstance(v, str), "a quantizer name", "extends")
            return node.value if ok and self.preset_name(node.value, node.span) else None
        if key == "granularity":
            return self.granularity(node)
        if key == "observer":
            return self.observer(node)
        raise AssertionError(key)  # pragma: no cover - QUANT_KEYS is closed

    def granularity(self, node: Node) -> Granularity | None:
        kinds = tuple(g.value for g in GranularityKind)
        if isinstance(node.value, str):
            if node.value == GranularityKind.GROUP.value:
                self.err("E103", "group granularity needs a size", node.span,
                         'write { kind = "group", size = 64 } (TOML) or group(64) (qspec)')
                return None
            kind = self.choice(node, kinds, "granularity")
            return Granularity(GranularityKind(kind), span=node.span) if kind else None
        if not node.is_table:
            self.err("E102", f"granularity must be tensor, channel or a table, got {self._shown(node)}", node.span)
            return None
        entries = self._table(node, ("kind", "axis", "size"), "in granularity")
        if "kind" not in entries:
            if not any(k not in ("kind", "axis", "size") for k, _ in node.items()):
                self.err("E103", "granularity table needs a kind", node.span, 'e.g. { kind = "channel", axis = 1 }')
            return None
        kind = self.choice(entries["kind"], kinds, "granularity")
        if kind is None:
            return None
        gk = GranularityKind(kind)
        axis = size = None
        if "axis" in entries:
            if gk is not GranularityKind.CHANNEL:
                self.err("E101", f"axis only applies to channel granularity, not {kind}", entries["axis"].where)
                return None
            axis = self.integer(entries["axis"], "axis", *_AXIS_RANGE)
            if axis is None:
                return None
        if "size" in entries:
            if gk is not GranularityKind.GROUP:
                self.err("E101", f"size only applies to group granularity, not {kind}", entries["size"].where)
                return None
            size = self.integer(entries["size"], "group size", 1, 1 << 20)
            if size is None:
                return None
        elif gk is GranularityKind.GROUP:
            self.err("E103", "group granularity needs a size", node.span, "e.g. group(64)")
            return None
        return Granularity(gk, axis=axis, group_size=size, span=node.span)

    def observer(self, node: Node) -> ObserverSpec | None:
        if isinstance(node.value, str):
            name = self._part_name(node, "observer")
            return ObserverSpec(name, span=node.span) if name else None
        if not node.is_table:
            self.err("E102", f"observer must be a name or a table, got {self._shown(node)}", node.span)
            return None
        entries = dict(node.items())
        if "name" not in entries:
            self.err("E103", "observer table needs a name", node.span, 'e.g. { name = "histogram", percentile = 99.9 }')
            return None
        name = self._part_name(entries.pop("name"), "observer")
        params = {}
        for key, child in entries.items():
            v = child.value
            if isinstance(v, float) and not math.isfinite(v) or (
                    child.form == "name" and isinstance(v, str) and v.lower() in _NON_FINITE_NAMES):
                # the DSL has no inf/nan literals: `percentile=inf` is the name "inf", meant as a number
                self.err("E104", f"observer parameter {key} must be finite", child.span,
                         "give a finite number, e.g. percentile = 99.99")
            elif isinstance(v, (bool, int, float, str)):
                params[key] = v
            else:
                self.err("E102", f"observer parameter {key} must be a number, boolean or string, "
                         f"got {self._shown(child)}", child.span)
        return ObserverSpec(name, params, span=node.span) if name else None

    # -- bodies, rules, spec ------------------------------------------------------------
    def body(self, node: Node, allowed: tuple[str, ...], where: str) -> RuleBody:
        roles: dict[Role, TensorQuant] = {}
        skip = accumulator = None
        for key, child in self._table(node, allowed, where).items():
            if key in ROLE_NAMES:
                tq = self.quant(child, Role(key), where)
                if tq is not None:
                    roles[Role(key)] = tq
            elif key == "skip":
                skip = self.boolean(child, "skip")
            elif key == "accumulator":
                accumulator = self.accumulator(child)
        return RuleBody(roles, skip, accumulator, span=node.span)

    def accumulator(self, node: Node) -> Accumulator | None:
        if not node.is_table:
            self.err("E102", f"accumulator must be a table, got {self._shown(node)}", node.span,
                     'e.g. { bits = 24, overflow = "saturate" }')
            return None
        entries = self._table(node, ("bits", "overflow", "constrain"), "in accumulator")
        bits = self.integer(entries["bits"], "accumulator bits", 2, 64) if "bits" in entries else 32
        overflow = (self.choice(entries["overflow"], tuple(o.value for o in Overflow), "overflow")
                    if "overflow" in entries else Overflow.WRAP.value)
        constrain = self.boolean(entries["constrain"], "accumulator constrain") if "constrain" in entries else False
        if bits is None or overflow is None or constrain is None:
            return None
        return Accumulator(bits, Overflow(overflow), constrain, span=node.span)

    def target(self, node: Node) -> Target | None:
        if not self._want(node, lambda v: isinstance(v, str), "a string", "target"):
            return None
        t = Target.parse(node.value, node.span)
        if not t.pattern:
            self.err("E108", f"empty target '{node.value}'", node.span,
                     "targets are a module name, a glob, re:<regex>, type:<ClassName>, @first or @last")
            return None
        if t.kind is TargetKind.REGEX:
            try:
                re.compile(t.pattern)
            except (re.error, RecursionError, OverflowError) as exc:
                self.err("E108", f"invalid regular expression in target: {exc}", node.span)
                return None
        if t.kind is TargetKind.POSITION and t.pattern not in TARGET_POSITIONS:
            close = difflib.get_close_matches(t.pattern, TARGET_POSITIONS, n=1, cutoff=0.6)
            known = "positional targets are @first and @last (the first / last weighted layer)"
            self.err("E108", f"unknown positional target '{node.value}'", node.span,
                     f"did you mean '@{close[0]}'? {known}" if close else known)
            return None
        if t.kind is TargetKind.TYPE and not PRESET_NAME_RE.match(t.pattern):
            self.err("E108", f"'{t.pattern}' is not a class name", node.span, "e.g. type:Conv2d")
            return None
        return t

    def rule(self, node: Node, index: int) -> Rule | None:
        where = f"in rule {index + 1}"
        if not node.is_table:
            self.err("E102", f"each rule must be a table, got {self._shown(node)}", node.span)
            return None
        entries = dict(node.items())
        targets: list[Target] = []
        if "target" not in entries:
            self.err("E103", f"rule {index + 1} has no target", node.span,
                     'add target = "type:Conv2d" (or a name, glob, or re:<regex>)')
        else:
            tnode = entries["target"]
            items = tnode.value if tnode.is_array else [tnode]
            if tnode.is_array and not items:
                self.err("E108", "a rule needs at least one target", tnode.span)
            targets = [t for t in (self.target(n) for n in items) if t is not None]
        optional = self.boolean(entries["optional"], "optional") if "optional" in entries else False
        priority = (self.integer(entries["priority"], "priority", -(2**31), 2**31 - 1)
                    if "priority" in entries else None)
        name = None
        if "name" in entries and self._want(entries["name"], lambda v: isinstance(v, str) and v != "",
                                            "a non-empty string", "name"):
            name = entries["name"].value
        body = self.body(node, RULE_KEYS, where)
        return Rule(targets, body, bool(optional), priority, name, span=node.span)

    def spec(self, root: Node) -> QuantSpec:
        top = self._table(root, TOP_KEYS, "at the top level")
        kw: dict[str, Any] = {}
        if "version" in top:
            v = top["version"]
            if self._want(v, _is_int, "an integer", "version") and v.value != SPEC_VERSION:
                self.err("E109", f"unsupported spec version {v.value}", v.span,
                         f"this qdsl reads version {SPEC_VERSION}")
        for flag in ("fold_bn", "bias_correction"):
            if flag in top:
                kw[flag] = self.boolean(top[flag], flag)
        if "learned_rounding" in top:
            kw["learned_rounding"] = self.choice(top["learned_rounding"], LEARNED_ROUNDINGS, "learned_rounding")
        includes: list[tuple[str, Span]] = []
        if "include" in top:
            inode = top["include"]
            for item in inode.value if inode.is_array else [inode]:
                if self._want(item, lambda v: isinstance(v, str) and v != "", "a file path string", "include"):
                    includes.append((item.value, item.span))
        quantizers: dict[str, TensorQuant] = {}
        if "quantizers" in top:
            qnode = top["quantizers"]
            if self._want(qnode, lambda v: isinstance(v, dict), "a table of named quantizers", "quantizers"):
                for name, child in qnode.items():
                    if self.preset_name(name, child.where):
                        tq = self.quant(child, None, f"in quantizer {name}")
                        if tq is not None:
                            quantizers[name] = tq
        defaults = RuleBody()
        if "defaults" in top and self._want(top["defaults"], lambda v: isinstance(v, dict), "a table", "defaults"):
            defaults = self.body(top["defaults"], BODY_KEYS, "in defaults")
        rules: list[Rule] = []
        if "rules" in top:
            rnode = top["rules"]
            if self._want(rnode, lambda v: isinstance(v, list), "an array of tables ([[rules]])", "rules"):
                rules = [r for r in (self.rule(n, i) for i, n in enumerate(rnode.value)) if r is not None]
        return QuantSpec(
            **kw,
            includes=[p for p, _ in includes],
            include_spans=[s for _, s in includes],
            quantizers=quantizers,
            defaults=defaults,
            rules=rules,
            span=root.span,
        )


def _sort_key(d: Diagnostic) -> tuple:
    return (d.span.file, d.span.line, d.span.col)


def lower_tree(root: Node, earlier: list[Diagnostic] | None = None) -> QuantSpec:
    """Lower a whole-file tree; raises ``SpecError`` with ``earlier`` + every schema problem."""
    lowerer = SchemaLowerer()
    spec = lowerer.spec(root)
    diags = list(earlier or []) + lowerer.diags
    if diags:
        raise SpecError(sorted(diags, key=_sort_key))
    return spec



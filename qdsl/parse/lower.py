"""DSL AST -> located value tree -> ``QuantSpec`` (the schema is shared with TOML).

Desugaring rules (normative summary; ``docs/spec-language.md`` has the full table):

* ``NAME`` as a role value or preset: ``float`` -> ``kind = float``; a kind name
  (``int``, ``binary``..., a minifloat such as ``fp8_e4m3`` or ``fp6_e3m2_b2``) ->
  ``{kind}``; anything else -> ``extends = NAME``.
* ``HEAD(args)``: HEAD a kind -> ``{kind = HEAD, args}``, else ``{extends = HEAD, args}``;
  ``(args)`` alone sets only the given fields.
* Flags: ``signed``/``unsigned``, ``narrow``, ``symmetric``/``asymmetric``, ``dynamic``,
  ``per_tensor``/``per_channel``/``per_token``; every other argument is ``field=value``.
* ``granularity=channel(1)`` -> ``{kind = "channel", axis = 1}``, ``group(64)`` ->
  ``{kind = "group", size = 64}``; ``observer=histogram(percentile=99.9)`` ->
  ``{name = "histogram", percentile = 99.9}``; ``input*weight`` -> the string.
* Body: ``ROLE = value``, ``skip`` (= true), ``skip = false``, ``accumulator(bits=24,
  overflow=saturate)``.  Rule header: ``optional``, ``priority N``, ``as NAME``.

Duplicates (two ``defaults`` blocks, a field given twice) are E106 with both places.
"""

from __future__ import annotations

import bisect
from typing import Any

import attrs

from qdsl.parse import dsl_ast as ast
from qdsl.parse.dsl_grammar import parse_statements, parse_value
from qdsl.parse.located_toml import LineIndex
from qdsl.parse.schema import QUANT_KEYS, lower_tree
from qdsl.parse.tree import Node
from qdsl.spec.diagnostics import Diagnostic, Span, SpecError, did_you_mean
from qdsl.spec.formats import is_float, is_format_name
from qdsl.spec.model import Kind, QuantSpec, Role

__all__ = ["parse_dsl", "Desugarer", "FLAGS", "value_node"]

FLAGS: dict[str, tuple[str, Any]] = {
    "signed": ("signed", True),
    "unsigned": ("signed", False),
    "narrow": ("narrow_range", True),
    "symmetric": ("symmetric", True),
    "asymmetric": ("symmetric", False),
    "dynamic": ("dynamic", True),
    "per_tensor": ("granularity", "tensor"),
    "per_channel": ("granularity", "channel"),
    "per_token": ("granularity", "token"),
}
_ROLES = tuple(r.value for r in Role)
_BODY_WORDS = _ROLES + ("skip", "accumulator")


class Desugarer:
    """Turns AST nodes into :class:`Node` trees, collecting E0xx/E1xx diagnostics."""

    def __init__(self, text: str, filename: str):
        self.lines = LineIndex(text)
        self.filename = filename
        self.diags: list[Diagnostic] = []
        self._starts = self.lines.starts + [len(text) + 1]
        self._text, self._n = text, len(text)
        self._spans: dict[tuple[int, int], Span] = {}
        """Spans are immutable: one per (start, end), shared by the nodes written there."""

    def span(self, item: Any) -> Span:
        start, end = item.start, item.end
        key = (start, end)
        s = self._spans.get(key)
        if s is None:
            # LineIndex.span inlined: one bisect for the start; an end on the same line (the
            # usual case) needs none.  Called for every node, so it sets the parse speed.
            starts = self._starts  # with a sentinel past the end
            if not 0 <= start < end <= self._n:  # clamp as LineIndex.span(start, max(end, start + 1))
                end = min(max(start + 1, end, 0), self._n)
                start = min(max(start, 0), self._n)
            i = bisect.bisect_right(starts, start) - 1
            j = i if end < starts[i + 1] else bisect.bisect_right(starts, end) - 1
            s = self._spans[key] = Span(self.filename, i + 1, start - starts[i] + 1, j + 1, end - starts[j] + 1,
                                        None, self._text)
        return s

    def err(self, code: str, message: str, item: Any, *hints: str, notes: tuple[str, ...] = ()) -> None:
        self.diags.append(Diagnostic.error(code, message, self.span(item), *hints, notes=notes))

    def _put(self, table: dict[str, Node], key: str, node: Node, what: str) -> None:
        if key in table:
            first = table[key].where
            self.diags.append(Diagnostic.error(
                "E106", f"{what} '{key}' given twice", node.where, "keep only one",
                notes=(f"first given at {first.line}:{first.col}",)))
        else:
            table[key] = node

    # -- values ------------------------------------------------------------------------
    def scalar(self, v: ast.Value) -> Node:
        """A plain value: numbers, strings, true/false, names (as strings), input*weight."""
        if isinstance(v, ast.Name):
            if v.text in ("true", "false"):
                return Node(v.text == "true", self.span(v))
            return Node(v.text, self.span(v), form="name")
        if isinstance(v, (ast.Num, ast.Str)):
            return Node(v.value, self.span(v))
        if isinstance(v, ast.Product):
            return Node(f"{v.left.text}*{v.right.text}", self.span(v))
        table: dict[str, Node] = {}
        for a in v.args:
            if a.key is not None:
                self._put(table, a.key.text, self._keyed(self.scalar(a.value), a.key), "argument")
        return Node(table, self.span(v), form="call")

    def _keyed(self, node: Node, key: ast.Name) -> Node:
        node.key_span = self.span(key)
        return node

    def quant(self, v: ast.Value) -> Node:
        """A role value or preset definition, as a TOML-shaped quantizer value."""
        if isinstance(v, ast.Name) and is_format_name(v.text) and not is_float(v.text):
            return Node({"kind": Node(v.text, self.span(v), self.span(v))}, self.span(v))
        if not isinstance(v, ast.Call):
            return self.scalar(v)
        table: dict[str, Node] = {}
        if v.head is not None:
            key = "kind" if is_format_name(v.head.text) else "extends"
            table[key] = Node(v.head.text, self.span(v.head), self.span(v.head))
        for a in v.args:
            if a.key is not None:
                node = self._keyed(self.field_value(a.key.text, a.value), a.key)
                self._put(table, a.key.text, node, "field")
            elif isinstance(a.value, ast.Name) and a.value.text in FLAGS:
                field, val = FLAGS[a.value.text]
                self._put(table, field, Node(val, self.span(a.value), self.span(a.value)), "field")
            elif isinstance(a.value, ast.Num):
                self.err("E005", f"positional argument {a.value.value}: quantizer arguments are named", a.value,
                         f"write bits={a.value.value}" if isinstance(a.value.value, int) else "write field=value")
            elif isinstance(a.value, ast.Name):
                self.err("E101", f"unknown flag '{a.value.text}'", a.value,
                         did_you_mean(a.value.text, list(FLAGS) + list(QUANT_KEYS), "flags and fields"))
            else:
                self.err("E005", "positional argument: quantizer arguments are flags or field=value", a.value,
                         "e.g. int(bits=4, signed, per_channel)")
        return Node(table, self.span(v))

    def field_value(self, key: str, v: ast.Value) -> Node:
        if isinstance(v, ast.Call) and v.head is not None and key in ("granularity", "observer"):
            head = Node(v.head.text, self.span(v.head), self.span(v.head))
            table = {"kind" if key == "granularity" else "name": head}
            positional = {"channel": "axis", "group": "size"}.get(v.head.text) if key == "granularity" else None
            for a in v.args:
                if a.key is not None:
                    self._put(table, a.key.text, self._keyed(self.scalar(a.value), a.key), "argument")
                elif positional and not any(k in table for k in ("axis", "size")):
                    table[positional] = self.scalar(a.value)
                else:
                    self.err("E005", f"positional argument in {v.head.text}(...)", a,
                             "write name=value" if key == "observer" else "e.g. channel(1) or group(64)")
            return Node(table, self.span(v))
        return self.scalar(v)

    # -- statements ------------------------------------------------------------------------
    def body(self, body: ast.Body, table: dict[str, Node]) -> None:
        for st in body.stmts:
            word = st.name.text
            if word in _ROLES:
                if st.value is None:
                    fix = f"write {word} = (...)" if st.call else f"write {word} = PRESET or {word} = int(bits=8)"
                    self.err("E005", f"'{word}' needs '=' and a value", st.name, fix)
                    continue
                node = self.quant(st.value)
            elif word == "skip":
                node = Node(True, self.span(st.name)) if st.value is None and st.call is None else \
                    self.scalar(st.value if st.value is not None else st.call)
            elif word == "accumulator":
                call = st.call or (st.value if isinstance(st.value, ast.Call) else None)
                if call is None:
                    self.err("E005", "accumulator takes arguments", st.name,
                             "write accumulator(bits=24, overflow=saturate)")
                    continue
                for a in call.args:
                    if a.key is None:
                        self.err("E005", "accumulator arguments are named", a, "e.g. accumulator(bits=24)")
                node = self.scalar(call)
                node.form = ""
            else:
                self.err("E101", f"unknown setting '{word}'", st.name,
                         did_you_mean(word, _BODY_WORDS, "settings"))
                continue
            self._put(table, word, self._keyed(node, st.name), "setting")

    def spec(self, stmts: list[ast.Statement], root_span: Span) -> Node:
        top: dict[str, Node] = {}
        includes: list[Node] = []
        quantizers: dict[str, Node] = {}
        rules: list[Node] = []
        for st in stmts:
            if isinstance(st, ast.VersionStmt):
                self._put(top, "version", Node(st.value.value, self.span(st.value), self.span(st)), "setting")
            elif isinstance(st, ast.SettingStmt):
                word = st.name.text
                if st.value is None:
                    if word == "learned_rounding":
                        self.err("E005", "learned_rounding needs a value", st.name, "e.g. learned_rounding = adaround")
                        continue
                    node = Node(True, self.span(st.name))
                else:
                    node = self.scalar(st.value)
                self._put(top, word, self._keyed(node, st.name), "setting")
            elif isinstance(st, ast.IncludeStmt):
                includes.append(Node(st.path.value, self.span(st.path), self.span(st)))
            elif isinstance(st, ast.QuantizerStmt):
                node = self._keyed(self.quant(st.value), st.name)
                self._put(quantizers, st.name.text, node, "quantizer")
            elif isinstance(st, ast.DefaultsStmt):
                table: dict[str, Node] = {}
                self.body(st.body, table)
                kw = ast.Name("defaults", st.start, st.start + 8)
                self._put(top, "defaults", Node(table, self.span(kw), self.span(kw)), "block")
            elif isinstance(st, ast.RuleStmt):
                rules.append(self.rule(st))
        if includes:
            top["include"] = Node(includes, includes[0].span)
        if quantizers:
            top["quantizers"] = Node(quantizers, root_span)
        if rules:
            top["rules"] = Node(rules, rules[0].span)
        return Node(top, root_span)

    def rule(self, st: ast.RuleStmt) -> Node:
        kw = self.span(ast.Name("rule", st.start, st.start + 4))
        targets = [Node(t.text, self.span(t)) for t in st.targets]
        table: dict[str, Node] = {"target": Node(targets, targets[0].span if targets else kw, kw)}
        for opt in st.options:
            word = opt.word.text
            if word == "optional":
                node = Node(True, self.span(opt.word))
            elif word == "priority":
                node = self.scalar(opt.value)
            else:
                node = Node(opt.value.value if isinstance(opt.value, ast.Str) else opt.value.text,
                            self.span(opt.value))
            key = "name" if word == "as" else word
            self._put(table, key, self._keyed(node, opt.word), "rule option")
        self.body(st.body, table)
        return Node(table, kw, kw)


def parse_dsl(text: str, filename: str = "<input>") -> QuantSpec:
    """Parse a ``.qspec`` text; raises ``SpecError`` with every diagnostic found."""
    stmts, diags = parse_statements(text, filename)
    d = Desugarer(text, filename)
    root = d.spec(stmts, Span(filename, 1, 1, 1, 2, source=text))
    return lower_tree(root, diags + d.diags)


def value_node(text: str, field: str | None, filename: str = "<--set>", offset: int = 0,
               source: str | None = None) -> Node:
    """Parse one DSL value (an override's right-hand side) into a located node.

    ``field`` says how to read it: a role (``weight``) reads a quantizer value, a field
    name reads that field's value, ``None`` reads a plain value.  ``offset`` shifts
    columns so carets point into the full ``--set`` string ``source``.
    """
    padded = " " * offset + text
    full = source if source is not None else padded
    value, diags = parse_value(padded, filename)
    if value is None:
        # spans were computed on the padded text; render them against the real --set string
        raise SpecError([attrs.evolve(x, span=attrs.evolve(x.span, source=full)) for x in diags])
    d = Desugarer(full, filename)
    if field in _ROLES:
        node = d.quant(value)
    elif field is None:
        node = d.scalar(value)
    else:
        node = d.field_value(field, value)
    if d.diags:
        raise SpecError(d.diags)
    return node

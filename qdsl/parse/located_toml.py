"""TOML with source locations: parse with tomllib, then map every key path to file:line:col.

tomllib gives no positions, so after it has accepted a text, a small scanner walks the
same text and records, for every key path, where the key is written and where its value
is written (start and end).  Paths use TOML's own structure::

    ("quantizers", "w4pot", "bits")      [quantizers.w4pot] / bits = 4, or a dotted key
    ("rules", 2, "target", 1)            the 2nd element of target in the 3rd [[rules]]
    ("defaults", "bias", "scale")        a key inside an inline table

Guarantees:

* ``read_located_toml`` raises nothing but :class:`SpecError`; a syntax error becomes one
  ``E001`` diagnostic at tomllib's line:col with the source line, a caret and a hint.
* ``LocatedToml.span(path)`` always returns a span: the exact one when the path is
  written in the file, else the nearest written ancestor (with the cattrs-style
  ``$.a.b[2]`` path attached).  The scanner only runs on text tomllib accepted; if it
  ever fails on an exotic construct, spans degrade to ancestors instead of raising.
* ``check_keys``/``check_choice``/``check_range`` turn schema problems into E1xx
  diagnostics (unknown key with did-you-mean, wrong type, missing key, value not
  allowed, out of range).  They are generic: spec files and hardware profiles use them.

This module never imports torch.
"""

from __future__ import annotations

import bisect
import itertools
import re
import sys
from typing import Any, Iterable, Mapping, Sequence

import attrs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from qdsl.spec.diagnostics import Diagnostic, Span, SpecError, did_you_mean

__all__ = [
    "TomlPath",
    "LocatedToml",
    "read_located_toml",
    "KeySpec",
    "check_keys",
    "check_choice",
    "check_range",
    "toml_type_name",
    "format_path",
    "LineIndex",
]

TomlPath = tuple[Any, ...]
"""A key path: strings are table keys, ints are array (or array-of-tables) indices."""


class LineIndex:
    """Offsets <-> 1-based (line, col); lines end at ``\\n`` as in tomllib's own messages."""

    def __init__(self, text: str):
        self.text = text
        # cumulative line lengths: C-speed on multi-MB specs (a per-character loop was not)
        self.starts = list(itertools.accumulate((len(line) + 1 for line in text.split("\n")), initial=0))[:-1]

    def pos(self, offset: int) -> tuple[int, int]:
        offset = max(0, min(offset, len(self.text)))
        i = bisect.bisect_right(self.starts, offset) - 1
        return i + 1, offset - self.starts[i] + 1

    def offset(self, line: int, col: int) -> int:
        line = max(1, min(line, len(self.starts)))
        return min(len(self.text), self.starts[line - 1] + max(0, col - 1))

    def span(self, filename: str, start: int, end: int, path: str | None = None) -> Span:
        n = len(self.text)
        if not 0 <= start <= end <= n:
            end = min(max(start, end, 0), n)
            start = min(max(start, 0), n)
        starts = self.starts
        i = bisect.bisect_right(starts, start) - 1
        # an end on the start's line (the usual case) needs no second search
        j = i if i + 1 == len(starts) or end < starts[i + 1] else bisect.bisect_right(starts, end) - 1
        return Span(filename, i + 1, start - starts[i] + 1, j + 1, end - starts[j] + 1, path, self.text)


def format_path(path: Sequence[Any]) -> str:
    """``("rules", 2, "weight")`` -> ``$.rules[2].weight`` (the cattrs-style fallback path)."""
    out = "$"
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def toml_type_name(value: Any) -> str:
    """The TOML name of a parsed value's type, for messages."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return "a date/time"


@attrs.frozen
class LocatedToml:
    """Parsed TOML (``data``) plus where every key and value is written."""

    data: dict[str, Any]
    filename: str
    text: str
    _keys: Mapping[TomlPath, tuple[int, int]] = attrs.field(repr=False)
    _values: Mapping[TomlPath, tuple[int, int]] = attrs.field(repr=False)
    _lines: LineIndex = attrs.field(repr=False)

    def has(self, path: TomlPath) -> bool:
        """Whether ``path`` exists in ``data``."""
        node: Any = self.data
        for part in path:
            try:
                node = node[part]
            except (KeyError, IndexError, TypeError):
                return False
        return True

    def get(self, path: TomlPath, default: Any = None) -> Any:
        node: Any = self.data
        for part in path:
            try:
                node = node[part]
            except (KeyError, IndexError, TypeError):
                return default
        return node

    def span(self, path: TomlPath, value: bool = True) -> Span:
        """Where ``path``'s value (or key, ``value=False``) is written.

        Falls back to the key, then to the nearest written ancestor, then to line 1.
        """
        path = tuple(path)
        tables = (self._values, self._keys) if value else (self._keys, self._values)
        for cut in range(len(path), 0, -1):
            prefix = path[:cut]
            for table in tables:
                if prefix in table:
                    start, end = table[prefix]
                    return self._lines.span(self.filename, start, end, format_path(path))
        return Span(self.filename, 1, 1, path=format_path(path), source=self.text)

    def exact_span(self, path: TomlPath, value: bool = True) -> Span | None:
        """The span recorded for exactly ``path`` (no fallback), or None."""
        table = self._values if value else self._keys
        found = table.get(tuple(path))
        if found is None:
            return None
        return self._lines.span(self.filename, found[0], found[1], format_path(path))

    def key_span(self, path: TomlPath) -> Span:
        return self.span(path, value=False)


_ERR_RE = re.compile(r"^(?P<msg>.*?)\s*\(at line (?P<line>\d+), column (?P<col>\d+)\)\s*$", re.S)
_END_RE = re.compile(r"^(?P<msg>.*?)\s*\(at end of document\)\s*$", re.S)

# tomllib's messages are terse; these hints say how to fix the usual mistakes.
_HINTS = (
    ("Invalid value", 'strings need quotes ("w4pot"); booleans are true/false; numbers are plain'),
    ("Expected '=' after a key", "each line is `key = value`; keys with spaces or dots need quotes"),
    ("Cannot overwrite a value", "each key may be given only once per table"),
    ("Cannot declare", "each table may be declared only once"),
    ("Unclosed array", "close the array with ']' (elements are separated by ',')"),
    ("Unclosed inline table", "inline tables stay on one line: { key = value, other = 1 }"),
    ("Expected ']' at the end of a table declaration", "a table header is [name] on its own line"),
    ("Invalid statement", "each line is `key = value`, a [table] header, or a # comment"),
    ("Unescaped", "control characters in strings must be escaped (\\n, \\t, \\u0000)"),
    ("Unterminated string", 'close the string with a matching quote (")'),
)


def _syntax_error(exc: Exception, text: str, filename: str, lines: LineIndex) -> SpecError:
    raw = str(exc)
    m = _ERR_RE.match(raw)
    if m:
        msg, line, col = m["msg"], int(m["line"]), int(m["col"])
    else:
        m = _END_RE.match(raw)
        msg = m["msg"] if m else raw
        line, col = lines.pos(len(text))
    msg = msg.strip() or "invalid TOML"
    msg = msg[0].lower() + msg[1:]
    hint = next((h for key, h in _HINTS if raw.startswith(key)), "see the TOML 1.0 syntax at https://toml.io")
    start = lines.offset(line, col)
    if raw.startswith(("Cannot overwrite", "Cannot declare")):
        # tomllib points past the offending key/value; the key at the line start is clearer
        line_start = lines.offset(line, 1)
        line_text = text[line_start:].split("\n", 1)[0]
        start = line_start + len(line_text) - len(line_text.lstrip(" \t"))
    span = lines.span(filename, start, start + 1)
    return SpecError(Diagnostic.error("E001", f"invalid TOML: {msg}", span, hint))


def read_located_toml(text: str, filename: str = "<input>") -> LocatedToml:
    """Parse ``text`` as TOML and locate every key and value; raises only ``SpecError``."""
    lines = LineIndex(text)
    try:
        data = tomllib.loads(text)
    except RecursionError:
        span = lines.span(filename, 0, 1)
        raise SpecError(Diagnostic.error("E001", "invalid TOML: nesting too deep", span)) from None
    except (ValueError, TypeError) as exc:  # TOMLDecodeError is a ValueError
        raise _syntax_error(exc, text, filename, lines) from None
    scanner = _Scanner(text)
    try:
        scanner.run()
    except (IndexError, ValueError, KeyError, TypeError, RecursionError):
        # Only reachable on a construct the scanner does not know; tomllib accepted the
        # text, so degrade to ancestor spans rather than refusing a valid file.
        pass
    return LocatedToml(data, filename, text, scanner.keys, scanner.values, lines)


_BARE = re.compile(r"[A-Za-z0-9_-]+")


class _Scanner:
    """Walks text tomllib accepted and records key/value offsets per path."""

    def __init__(self, text: str):
        self.t = text
        self.n = len(text)
        self.i = 0
        self.keys: dict[TomlPath, tuple[int, int]] = {}
        self.values: dict[TomlPath, tuple[int, int]] = {}
        self.aot: dict[TomlPath, int] = {}

    # -- whitespace -------------------------------------------------------------
    def _ws(self, newlines: bool) -> None:
        t, n = self.t, self.n
        while self.i < n:
            c = t[self.i]
            if c in " \t" or (newlines and c in "\r\n"):
                self.i += 1
            elif c == "#":
                while self.i < n and t[self.i] != "\n":
                    self.i += 1
            else:
                return

    # -- structure --------------------------------------------------------------
    def run(self) -> None:
        table: TomlPath = ()
        while True:
            self._ws(newlines=True)
            if self.i >= self.n:
                return
            if self.t[self.i] == "[":
                table = self._header()
            else:
                self._keyval(table)

    def _resolve(self, comps: list[tuple[str, int, int]]) -> TomlPath:
        path: list[Any] = []
        for j, (name, start, end) in enumerate(comps):
            path.append(name)
            prefix = tuple(path)
            self.keys.setdefault(prefix, (start, end))
            if j < len(comps) - 1 and prefix in self.aot:
                path.append(self.aot[prefix])
        return tuple(path)

    def _header(self) -> TomlPath:
        start = self.i
        aot = self.t.startswith("[[", self.i)
        self.i += 2 if aot else 1
        comps = self._key()
        self._ws(newlines=False)
        self.i += 2 if aot else 1
        end = self.i
        path = self._resolve(comps)
        name_span = comps[-1][1:]
        if aot:
            idx = self.aot.get(path, -1) + 1
            self.aot[path] = idx
            path = path + (idx,)
            self.keys[path] = name_span
        else:
            self.keys[path] = name_span
        self.values[path] = (start, end)
        return path

    def _keyval(self, base: TomlPath) -> None:
        comps = self._key()
        path = base
        for name, start, end in comps:
            path = path + (name,)
            self.keys.setdefault(path, (start, end))
        self.keys[path] = (comps[-1][1], comps[-1][2])
        self._ws(newlines=False)
        self.i += 1  # '='
        self._ws(newlines=False)
        self._value(path)

    def _key(self) -> list[tuple[str, int, int]]:
        comps = []
        while True:
            self._ws(newlines=False)
            start = self.i
            c = self.t[self.i]
            if c == '"' or c == "'":
                self._string()
                name = tomllib.loads("k = " + self.t[start : self.i])["k"]
            else:
                m = _BARE.match(self.t, self.i)
                if not m:
                    raise ValueError("bad key")
                name = m.group()
                self.i = m.end()
            comps.append((name, start, self.i))
            self._ws(newlines=False)
            if self.i < self.n and self.t[self.i] == ".":
                self.i += 1
                continue
            return comps

    def _value(self, path: TomlPath) -> None:
        start = self.i
        c = self.t[self.i]
        if c in "\"'":
            self._string()
        elif c == "[":
            self.i += 1
            idx = 0
            while True:
                self._ws(newlines=True)
                if self.t[self.i] == "]":
                    self.i += 1
                    break
                self._value(path + (idx,))
                idx += 1
                self._ws(newlines=True)
                if self.t[self.i] == ",":
                    self.i += 1
        elif c == "{":
            self.i += 1
            while True:
                self._ws(newlines=True)
                if self.t[self.i] == "}":
                    self.i += 1
                    break
                self._keyval(path)
                self._ws(newlines=True)
                if self.t[self.i] == ",":
                    self.i += 1
        else:
            while self.i < self.n and self.t[self.i] not in ",]}#\r\n":
                self.i += 1
            end = self.i
            while end > start and self.t[end - 1] in " \t":
                end -= 1
            self.values[path] = (start, end)
            return
        self.values[path] = (start, self.i)

    def _string(self) -> None:
        t = self.t
        q = t[self.i]
        if t.startswith(q * 3, self.i):
            j = self.i + 3
            while True:
                if q == '"' and t[j] == "\\":
                    j += 2
                    continue
                if t.startswith(q * 3, j):
                    end = j + 3
                    # up to two quotes may directly precede the closing delimiter
                    while end < self.n and t[end] == q and end - j < 5:
                        end += 1
                    self.i = end
                    return
                j += 1
        j = self.i + 1
        while t[j] != q:
            j += 2 if (q == '"' and t[j] == "\\") else 1
        self.i = j + 1


# -- schema checks ---------------------------------------------------------------------


@attrs.frozen
class KeySpec:
    """What a key accepts: Python types from tomllib (bool is not an int; int is a float)."""

    types: tuple[type, ...]
    required: bool = False
    doc: str = ""
    """Human description for 'wrong type' messages, e.g. ``"an integer 1..16"``."""


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def _describe_types(types: tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "a table"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _where(path: TomlPath) -> str:
    return f" in {format_path(path)}" if path else " at the top level"


def check_keys(
    lt: LocatedToml,
    path: TomlPath,
    allowed: Mapping[str, KeySpec],
    diags: list[Diagnostic],
    *,
    what: str = "key",
) -> dict[str, Any]:
    """Check the table at ``path`` against ``allowed``; return only the entries that passed.

    Appends E101 (unknown key, with did-you-mean), E102 (wrong type) and E103 (missing
    required key) to ``diags``.  A non-table at ``path`` is one E102.
    """
    table = lt.get(path)
    if not isinstance(table, dict):
        diags.append(Diagnostic.error(
            "E102", f"{format_path(path)} must be a table, got {toml_type_name(table)}", lt.span(path)))
        return {}
    ok: dict[str, Any] = {}
    for key, value in table.items():
        spec = allowed.get(key)
        if spec is None:
            diags.append(Diagnostic.error(
                "E101", f"unknown {what} '{key}'{_where(path)}", lt.key_span(path + (key,)),
                did_you_mean(key, allowed, what + "s")))
        elif not _type_ok(value, spec.types):
            want = spec.doc or _describe_types(spec.types)
            diags.append(Diagnostic.error(
                "E102", f"'{key}' must be {want}, got {toml_type_name(value)}", lt.span(path + (key,))))
        else:
            ok[key] = value
    for key, spec in allowed.items():
        if spec.required and key not in table:
            diags.append(Diagnostic.error(
                "E103", f"missing required {what} '{key}'{_where(path)}", lt.key_span(path) if path
                else lt.span(()), f"add `{key} = ...`"))
    return ok


def check_choice(
    lt: LocatedToml, path: TomlPath, choices: Iterable[str], diags: list[Diagnostic], *, what: str = "value"
) -> str | None:
    """The string at ``path`` if it is one of ``choices``; else E105 with did-you-mean."""
    value = lt.get(path)
    choices = list(choices)
    if isinstance(value, str) and value in choices:
        return value
    shown = value if isinstance(value, str) else toml_type_name(value)
    diags.append(Diagnostic.error(
        "E105", f"unknown {what} '{shown}'", lt.span(path), did_you_mean(str(value), choices, what + "s")))
    return None


def check_range(
    lt: LocatedToml, path: TomlPath, lo: float, hi: float, diags: list[Diagnostic], *, what: str = "value"
) -> int | float | None:
    """The number at ``path`` if ``lo <= value <= hi``; else E104 (or E102 for a non-number)."""
    value = lt.get(path)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        diags.append(Diagnostic.error(
            "E102", f"{what} must be a number, got {toml_type_name(value)}", lt.span(path)))
        return None
    if not lo <= value <= hi:
        diags.append(Diagnostic.error(
            "E104", f"{what} {value} is out of range", lt.span(path), f"allowed: {lo}..{hi}"))
        return None
    return value

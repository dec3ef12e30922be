"""A fast path for the ``.qspec`` grammar: one hand-written scan per statement.

pyparsing (``dsl_grammar``) is the normative implementation and owns every error
message, but it costs ~1.5 ms per rule statement (tens of KB/s): a generated 80k-rule
spec took minutes.  :func:`parse_statement_fast` recognises the statements of a correct
file with plain regex matches and builds the *same* AST nodes, offsets included, or
raises :class:`Fallback` at the first thing it does not handle, and the caller re-parses
that one statement with pyparsing (which then either parses it or reports the error).

So the fast path only has to be sound, not complete: whatever it accepts, pyparsing
accepts with an equal AST (``tests/parse/test_fast_path.py`` checks this on the grammar
corpus, every spec in ``specs/`` and the fuzz corpus).  It mirrors the grammar rules:

* tokens are separated by `` \\t\\r\\n`` only (what pyparsing skips; comments were blanked);
* a node's ``start`` is its first token's first character and ``end`` its last token's end
  (the ``_located`` action trims the same way);
* keywords need a non-identifier character on both sides (pyparsing ``Keyword``); a body
  setting may not be a top-level keyword, a bare target not a rule option.
"""

from __future__ import annotations

import re

from qdsl.parse import dsl_ast as ast

__all__ = ["Fallback", "parse_statement_fast", "unescape", "TOP_KEYWORDS", "RULE_OPTIONS", "TARGET_CHARS"]


class Fallback(Exception):
    """The fast path does not handle this statement: re-parse it with pyparsing."""


_WS = re.compile(r"[ \t\r\n]*")
_ws = _WS.match  # bound once: the scanner calls it between every two tokens
_IDENT = re.compile(r"[^\W\d]\w*")
_NUMBER = re.compile(r"[+-]?\d+(\.\d+)?([eE][+-]?\d+)?")
_INT = re.compile(r"[+-]?\d+")
_DQ = re.compile(r'"(?:[^"\\\x00-\x1f\x7f]|\\[^\x00-\x1f\x7f])*"')
_SQ = re.compile(r"'[^'\x00-\x08\x0a-\x1f\x7f]*'")
_RE_BARE = re.compile(r"re:[^\s,{}\"'#]+")
# the grammar's vocabulary, defined here once (dsl_grammar imports it)
TOP_KEYWORDS = ("version", "fold_bn", "bias_correction", "learned_rounding", "include",
                "quantizer", "defaults", "rule")
RULE_OPTIONS = ("optional", "priority", "as")
TARGET_CHARS = "A-Za-z0-9_.*?\\[\\]!\\-"
_BARE = re.compile(rf"(?:type:|@)?[{TARGET_CHARS}]+")
_OPTION_WORD = re.compile(r"(?:" + "|".join(RULE_OPTIONS) + r")(?![" + TARGET_CHARS + ":])")
_TOP_WORD = re.compile(r"(?:" + "|".join(TOP_KEYWORDS) + r")(?![A-Za-z0-9_])")
_KEYWORD = re.compile("(" + "|".join(TOP_KEYWORDS) + ")")
_KW_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_$")  # pyparsing Keyword
_OPT_CHARS = (_KW_CHARS - {"$"}) | frozenset(".*?[]!-:")  # the grammar's ``tchars``
_SETTINGS = ("fold_bn", "bias_correction", "learned_rounding")


_ESCAPES = {'"': '"', "\\": "\\", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_ESC_RE = re.compile(r"\\(u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.)")


def unescape(raw: str) -> str:
    """Decode the escapes of a double-quoted string body (TOML basic-string escapes).

    Raises ``ValueError`` naming the first escape that is not one of those.
    """

    def sub(m: re.Match) -> str:
        e = m.group(1)
        if e[0] in "uU" and len(e) > 1:
            code = int(e[1:], 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise ValueError(f"\\{e} is not a valid character")
            return chr(code)
        if e not in _ESCAPES:
            raise ValueError(f"\\{e}")
        return _ESCAPES[e]

    return _ESC_RE.sub(sub, raw)



class _Scanner:
    __slots__ = ("s", "n")

    def __init__(self, text: str):
        self.s = text
        self.n = len(text)

    # -- tokens -------------------------------------------------------------------
    def string(self, i: int) -> tuple[str, int]:
        s = self.s
        if i < self.n and s[i] == '"':
            m = _DQ.match(s, i)
            if m is None:
                raise Fallback
            try:
                return unescape(m.group()[1:-1]), m.end()
            except (ValueError, KeyError):
                raise Fallback from None
        if i < self.n and s[i] == "'":
            m = _SQ.match(s, i)
            if m is None:
                raise Fallback
            return m.group()[1:-1], m.end()
        raise Fallback

    def name(self, i: int) -> ast.Name:
        m = _IDENT.match(self.s, i)
        if m is None:
            raise Fallback
        return ast.Name(m.group(), i, m.end())

    def value(self, i: int) -> ast.Value:
        s = self.s
        c = s[i] if i < self.n else ""
        if c == '"' or c == "'":
            v, end = self.string(i)
            return ast.Str(v, i, end)
        m = _NUMBER.match(s, i)
        if m is not None:
            text = m.group()
            return ast.Num(int(text) if _INT.fullmatch(text) else float(text), i, m.end())
        if c == "(":
            args, end = self.args(i)
            return ast.Call(None, args, i, end)
        head = self.name(i)
        j = _ws(s, head.end).end()
        if j < self.n and s[j] == "*":
            k = _ws(s, j + 1).end()
            m = _IDENT.match(s, k)
            if m is None:
                raise Fallback
            return ast.Product(head, ast.Name(m.group(), k, m.end()), i, m.end())
        if j < self.n and s[j] == "(":
            args, end = self.args(j)
            return ast.Call(head, args, i, end)
        return head

    def args(self, i: int) -> tuple[tuple[ast.Arg, ...], int]:
        """``( arg, ... [,] )`` starting at the ``(``; returns the args and the end after ``)``."""
        s = self.s
        out: list[ast.Arg] = []
        j = _ws(s, i + 1).end()
        while True:
            if j < self.n and s[j] == ")":
                return tuple(out), j + 1
            m = _IDENT.match(s, j)
            key = None
            if m is not None:
                k = _ws(s, m.end()).end()
                if k < self.n and s[k] == "=":
                    key = ast.Name(m.group(), j, m.end())
                    val = self.value(_ws(s, k + 1).end())
                    out.append(ast.Arg(key, val, j, val.end))
            if key is None:
                val = self.value(j)
                out.append(ast.Arg(None, val, j, val.end))
            j = _ws(s, out[-1].end).end()
            if j < self.n and s[j] == ",":
                j = _ws(s, j + 1).end()
            elif not (j < self.n and s[j] == ")"):
                raise Fallback

    def body(self, i: int) -> ast.Body:
        s = self.s
        if not (i < self.n and s[i] == "{"):
            raise Fallback
        stmts: list[ast.BodyStmt] = []
        j = _ws(s, i + 1).end()
        while True:
            if j < self.n and s[j] == "}":
                return ast.Body(tuple(stmts), i, j + 1)
            if _TOP_WORD.match(s, j):
                raise Fallback
            name = self.name(j)
            k = _ws(s, name.end).end()
            if k < self.n and s[k] == "=":
                val = self.value(_ws(s, k + 1).end())
                stmt = ast.BodyStmt(name, val, None, j, val.end)
            elif k < self.n and s[k] == "(":
                args, end = self.args(k)
                stmt = ast.BodyStmt(name, None, ast.Call(None, args, k, end), j, end)
            else:
                stmt = ast.BodyStmt(name, None, None, j, name.end)
            stmts.append(stmt)
            j = _ws(s, stmt.end).end()
            if j < self.n and s[j] in ";,":
                j = _ws(s, j + 1).end()

    def target(self, i: int) -> ast.TargetText:
        s = self.s
        if s.startswith("re:", i):
            k = _ws(s, i + 3).end()
            if k < self.n and s[k] in "\"'":
                v, end = self.string(k)
                return ast.TargetText("re:" + v, i, end)
            m = _RE_BARE.match(s, i)
            if m is None:
                raise Fallback
            return ast.TargetText(m.group(), i, m.end())
        if i < self.n and s[i] in "\"'":
            v, end = self.string(i)
            return ast.TargetText(v, i, end)
        if _OPTION_WORD.match(s, i):
            raise Fallback
        m = _BARE.match(s, i)
        if m is None:
            raise Fallback
        return ast.TargetText(m.group(), i, m.end())

    def option(self, i: int) -> ast.RuleOption | None:
        """A rule option at ``i``, or None when none starts there."""
        s = self.s
        for word in RULE_OPTIONS:
            if s.startswith(word, i):
                end = i + len(word)
                if (end < self.n and s[end] in _OPT_CHARS) or (i > 0 and s[i - 1] in _OPT_CHARS):
                    return None
                w = ast.Name(word, i, end)
                if word == "optional":
                    return ast.RuleOption(w, None, i, end)
                k = _ws(s, end).end()
                if word == "priority":
                    m = _NUMBER.match(s, k)
                    if m is None:
                        raise Fallback
                    text = m.group()
                    num = ast.Num(int(text) if _INT.fullmatch(text) else float(text), k, m.end())
                    return ast.RuleOption(w, num, i, num.end)
                if k < self.n and s[k] in "\"'":
                    v, vend = self.string(k)
                    return ast.RuleOption(w, ast.Str(v, k, vend), i, vend)
                nm = self.name(k)
                return ast.RuleOption(w, nm, i, nm.end)
        return None

    # -- statements -------------------------------------------------------------------
    def statement(self, i: int) -> tuple[ast.Statement, int]:
        s = self.s
        m = _KEYWORD.match(s, i)
        if m is None:
            raise Fallback
        kw, end = m.group(1), m.end()
        # pyparsing Keyword: no identifier character on either side; anything unusual
        # after the word (a non-ASCII letter...) goes to pyparsing
        if (i > 0 and s[i - 1] in _KW_CHARS) or (end < self.n and (s[end] in _KW_CHARS or s[end].isalnum())):
            raise Fallback
        j = _ws(s, end).end()
        if kw == "version":
            if j < self.n and s[j] == "=":
                j = _ws(s, j + 1).end()
            m = _NUMBER.match(s, j)
            if m is None:
                raise Fallback
            text = m.group()
            num = ast.Num(int(text) if _INT.fullmatch(text) else float(text), j, m.end())
            return ast.VersionStmt(num, i, num.end), num.end
        if kw in _SETTINGS:
            name = ast.Name(kw, i, end)
            if j < self.n and s[j] == "=":
                val = self.value(_ws(s, j + 1).end())
                return ast.SettingStmt(name, val, i, val.end), val.end
            return ast.SettingStmt(name, None, i, end), end
        if kw == "include":
            v, vend = self.string(j)
            return ast.IncludeStmt(ast.Str(v, j, vend), i, vend), vend
        if kw == "quantizer":
            name = self.name(j)
            k = _ws(s, name.end).end()
            if not (k < self.n and s[k] == "="):
                raise Fallback
            val = self.value(_ws(s, k + 1).end())
            return ast.QuantizerStmt(name, val, i, val.end), val.end
        if kw == "defaults":
            body = self.body(j)
            return ast.DefaultsStmt(body, i, body.end), body.end
        # rule
        targets = [self.target(j)]
        j = _ws(s, targets[-1].end).end()
        while j < self.n and s[j] == ",":
            targets.append(self.target(_ws(s, j + 1).end()))
            j = _ws(s, targets[-1].end).end()
        options = []
        while True:
            opt = self.option(j)
            if opt is None:
                break
            options.append(opt)
            j = _ws(s, opt.end).end()
        body = self.body(j)
        return ast.RuleStmt(tuple(targets), tuple(options), body, i, body.end), body.end


def parse_statement_fast(text: str, pos: int) -> tuple[ast.Statement, int]:
    """The statement starting at ``pos`` of the comment-blanked ``text`` and its end offset,
    or :class:`Fallback` when this path does not handle it."""
    try:
        return _Scanner(text).statement(pos)
    except (IndexError, RecursionError, ValueError):  # ValueError: int() of a too-long number
        raise Fallback from None

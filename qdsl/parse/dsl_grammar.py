"""The ``.qspec`` grammar in pyparsing (normative form: ``grammar/qspec.ebnf``).

``parse_statements(text, filename)`` returns the statements it could parse and an E0xx
diagnostic for each one it could not.  Recovery is per statement: after an error the
parser re-synchronises at the next line that starts with a top-level keyword, so one
run reports every broken statement of a file.  Every grammar element has a name
(``set_name``) and committing keywords use ``-`` (ErrorStop), so a message says what
was expected at the real spot; known mistakes get friendlier messages (unknown
statement or rule option with did-you-mean, unclosed ``{`` naming where the block
started, unterminated strings).  Nothing but diagnostics leaves this module: any input
text yields (statements, diagnostics).
"""

from __future__ import annotations

import re
import sys

import pyparsing as pp

from qdsl.parse import dsl_ast as ast
from qdsl.parse.dsl_fast import RULE_OPTIONS, TARGET_CHARS, TOP_KEYWORDS, Fallback, parse_statement_fast, unescape
from qdsl.parse.located_toml import LineIndex
from qdsl.spec.diagnostics import Diagnostic, did_you_mean
from qdsl.spec.model import Role

__all__ = ["parse_statements", "parse_value", "TOP_KEYWORDS", "RULE_OPTIONS", "unescape"]

_BLOCKS = ("defaults", "rule")
_TARGET_CHARS = TARGET_CHARS

_BAD_ESCAPE = "invalid escape in string: "
_BAD_NUMBER = "number too long"


def _located(expr: pp.ParserElement, build, name: str) -> pp.ParserElement:
    def action(s, loc, toks):
        # Located may report the position before skipped whitespace/comments, and an
        # optional tail that did not match may have skipped trailing blanks: trim both.
        start = _SKIP.match(s, toks.locn_start).end()
        end = toks.locn_end
        while end > start and s[end - 1] in " \t\r\n":
            end -= 1
        return build(start, max(start, end), list(toks.value))

    return pp.Located(expr).set_parse_action(action).set_name(name)


def _string_action(s, loc, toks):
    raw = toks[0]
    if raw[0] == "'":
        return raw[1:-1]
    try:
        return unescape(raw[1:-1])
    except (ValueError, KeyError) as exc:
        # fatal: no other alternative can make sense of a bad escape, report it here
        bad = exc.args[0] if isinstance(exc, KeyError) else str(exc)
        raise pp.ParseFatalException(s, loc, f"{_BAD_ESCAPE}{bad}") from None


class _StmtCall:
    """Marks ``name(args)`` in a body (``accumulator(bits=24)``), as opposed to ``name = (args)``."""

    def __init__(self, call: ast.Call):
        self.call = call


def _build_grammar() -> tuple[pp.ParserElement, pp.ParserElement]:
    S = pp.Suppress
    lpar, rpar = S("(").set_name("'('"), S(")").set_name("')'")
    lbrace, rbrace = S("{").set_name("'{'"), S("}").set_name("'}'")
    eq = S("=").set_name("'='")

    # any Unicode word (not only ASCII) so a name like 'wé8' parses as one name and the
    # schema reports it once, located (E107); cut at 'é' it would derail the statement
    ident = pp.Regex(r"[^\W\d]\w*").set_name("a name")
    name = _located(ident, lambda a, b, t: ast.Name(t[0], a, b), "a name")
    number_re = pp.Regex(r"[+-]?\d+(\.\d+)?([eE][+-]?\d+)?").set_name("a number")

    def check_num(s, loc, toks):
        # int() refuses more than sys.get_int_max_str_digits() digits with a ValueError
        try:
            int(toks[0]) if re.fullmatch(r"[+-]?\d+", toks[0]) else float(toks[0])
        except ValueError:
            raise pp.ParseFatalException(s, loc, _BAD_NUMBER) from None

    number_re.set_parse_action(check_num)

    def build_num(a, b, t):
        text = t[0]
        return ast.Num(int(text) if re.fullmatch(r"[+-]?\d+", text) else float(text), a, b)

    number = _located(number_re, build_num, "a number")
    dq = pp.Regex(r'"(?:[^"\\\x00-\x1f\x7f]|\\[^\x00-\x1f\x7f])*"')
    sq = pp.Regex(r"'[^'\x00-\x08\x0a-\x1f\x7f]*'")
    string_tok = (dq | sq).set_name("a quoted string").set_parse_action(_string_action)
    string = _located(string_tok, lambda a, b, t: ast.Str(t[0], a, b), "a quoted string")

    value = pp.Forward().set_name("a value")
    arg_keyed = _located(name + eq - value, lambda a, b, t: ast.Arg(t[0], t[1], a, b), "an argument")
    arg_plain = _located(value, lambda a, b, t: ast.Arg(None, t[0], a, b), "an argument")
    arg = (arg_keyed | arg_plain).set_name("an argument (name=value)")
    arglist = pp.Group(pp.Opt(pp.DelimitedList(arg, allow_trailing_delim=True))).set_name("arguments")
    call_args = lpar - arglist + rpar
    anon = _located(call_args, lambda a, b, t: ast.Call(None, tuple(t[0]), a, b), "(fields)")

    def build_named(a, b, t):
        # one pass over the leading name: NAME, NAME(args) or NAME*NAME (no backtracking)
        if len(t) == 1:
            return t[0]
        if isinstance(t[1], ast.Name):
            return ast.Product(t[0], t[1], a, b)
        return ast.Call(t[0], tuple(t[1]), a, b)

    named = _located(name + pp.Opt(S("*") + name | call_args), build_named, "a name or call")
    value <<= (string | number | anon | named).set_name("a value")

    def build_stmt(a, b, t):
        rest = t[1] if len(t) > 1 else None
        if isinstance(rest, _StmtCall):
            return ast.BodyStmt(t[0], None, rest.call, a, b)
        return ast.BodyStmt(t[0], rest, None, a, b)

    stmt_call = _located(call_args, lambda a, b, t: _StmtCall(ast.Call(None, tuple(t[0]), a, b)), "'('")
    not_top = pp.NotAny(pp.Regex(r"(?:" + "|".join(TOP_KEYWORDS) + r")(?![A-Za-z0-9_])"))
    body_stmt = _located(not_top + name + pp.Opt(eq - value | stmt_call), build_stmt,
                         "a setting (weight = ..., skip, accumulator(...))")
    # settings are separated by whitespace; a ';' or ',' between them is accepted too
    # (writing `{ weight = w8, input = a8 }` is natural after the comma-separated args)
    sep = pp.Opt(S(";") | S(",")).set_name("';' or ','")
    body = _located(lbrace - pp.Group(pp.ZeroOrMore(body_stmt + sep)) + rbrace,
                    lambda a, b, t: ast.Body(tuple(t[0]), a, b), "'{'")

    def kw(word: str, ident_chars: str | None = None) -> pp.ParserElement:
        return pp.Keyword(word, ident_chars=ident_chars).set_name(f"'{word}'")

    # rule options end where a target character would continue them ("optional.x" is a target)
    tchars = pp.alphanums + "_.*?[]!-:"
    not_option = pp.NotAny(pp.Regex(r"(?:" + "|".join(RULE_OPTIONS) + rf")(?![{_TARGET_CHARS}:])"))
    re_quoted = _located(S("re:") + string_tok, lambda a, b, t: ast.TargetText("re:" + t[0], a, b), "re:<regex>")
    re_bare = _located(pp.Regex(r"re:[^\s,{}\"'#]+"), lambda a, b, t: ast.TargetText(t[0], a, b), "re:<regex>")
    quoted_target = _located(string_tok, lambda a, b, t: ast.TargetText(t[0], a, b), "a quoted target")
    bare = _located(not_option + pp.Regex(rf"(?:type:|@)?[{_TARGET_CHARS}]+"),
                    lambda a, b, t: ast.TargetText(t[0], a, b), "a target")
    target = (re_quoted | re_bare | quoted_target | bare).set_name("a target (name, glob, re:..., type:..., @first, @last)")
    option = _located(
        (kw("optional", tchars) + pp.Empty()) | (kw("priority", tchars) - number) | (kw("as", tchars) - (name | string)),
        lambda a, b, t: ast.RuleOption(ast.Name(t[0], a, a + len(t[0])), t[1] if len(t) > 1 else None, a, b),
        "a rule option (optional, priority N, as NAME)")

    version = _located(kw("version") - pp.Opt(eq) + number, lambda a, b, t: ast.VersionStmt(t[1], a, b), "version")
    setting = _located((kw("fold_bn") | kw("bias_correction") | kw("learned_rounding")) - pp.Opt(eq - value),
                       lambda a, b, t: ast.SettingStmt(ast.Name(t[0], a, a + len(t[0])), t[1] if len(t) > 1 else None, a, b),
                       "a setting")
    include = _located(kw("include") - string, lambda a, b, t: ast.IncludeStmt(t[1], a, b), "include")
    quantizer = _located(kw("quantizer") - name + eq + value,
                         lambda a, b, t: ast.QuantizerStmt(t[1], t[2], a, b), "quantizer")
    defaults = _located(kw("defaults") - body, lambda a, b, t: ast.DefaultsStmt(t[1], a, b), "defaults")
    rule = _located(
        kw("rule") - pp.Group(pp.DelimitedList(target)) + pp.Group(pp.ZeroOrMore(option)) + body,
        lambda a, b, t: ast.RuleStmt(tuple(t[1]), tuple(t[2]), t[3], a, b), "rule")
    statement = (version | setting | include | quantizer | defaults | rule).set_name("a statement")
    end = pp.Empty().set_parse_action(lambda s, loc, t: [loc])
    top = statement + end
    standalone = value + pp.StringEnd().set_name("end of value")
    top.parse_with_tabs().streamline()
    return top, standalone.parse_with_tabs()


_TOP, _VALUE = _build_grammar()
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SYNC_KW = re.compile(r"[ \t]*(" + "|".join(TOP_KEYWORDS) + r")\b")
_SKIP = re.compile(r"(?:\s+|#[^\n]*)*")


def _parse_statement_at(text: str, pos: int) -> tuple[ast.Statement, int]:
    """Parse one statement starting at offset ``pos``; return it and where the next begins.

    ``_parse(instring, loc)`` is the entry every pyparsing element uses to run a
    sub-element at a position; calling it directly keeps a file of N statements O(size)
    instead of re-scanning a blanked prefix per statement (which is O(N * size)).
    """
    parse_at = getattr(_TOP, "_parse", None)
    if parse_at is None:  # pragma: no cover - a pyparsing without _parse: blank the prefix
        toks = _TOP.parse_string(" " * pos + text[pos:])
    else:
        toks = parse_at(text, pos)[1]
    return toks[0], toks[1]


_STRING_OR_COMMENT = re.compile(r"(\"(?:[^\"\\\n]|\\.)*\"|'[^'\n]*')|#[^\n]*")


def _blank_comments(text: str) -> str:
    """Comments become spaces (offsets unchanged); a '#' inside a string is kept.

    Cheaper than pyparsing's ``ignore``, which re-tries the comment before every element.
    """
    return _STRING_OR_COMMENT.sub(lambda m: m.group(0) if m.group(1) else " " * len(m.group(0)), text)


def _unclosed(text: str, start: int, end: int, open_ch: str, close_ch: str) -> int | None:
    """Offset of the innermost ``open_ch`` still open at ``end`` (strings skipped)."""
    stack: list[int] = []
    i = start
    while i < end:
        c = text[i]
        if c in "\"'":
            close = text.find(c, i + 1, end)
            i = close + 1 if close >= 0 else end
            continue
        if c == open_ch:
            stack.append(i)
        elif c == close_ch and stack:
            stack.pop()
        i += 1
    return stack[-1] if stack else None


def _found(text: str, loc: int) -> str:
    if not text[loc:].strip():
        return "end of file"
    m = _WORD.match(text, loc)
    if m:
        return f"'{m.group()}'"
    ch = text[loc]
    return "end of line" if ch == "\n" else f"'{ch}'"


class _Recovering:
    def __init__(self, text: str, filename: str):
        self.text = text
        self.filename = filename
        self.lines = LineIndex(text)
        self.diags: list[Diagnostic] = []

    def span(self, start: int, end: int | None = None):
        return self.lines.span(self.filename, start, end if end is not None else start + 1)

    def error(self, code: str, message: str, loc: int, end: int | None = None, *hints: str, notes=()) -> None:
        self.diags.append(Diagnostic.error(code, message, self.span(loc, end), *hints, notes=notes))

    def diagnose(self, exc: pp.ParseBaseException, start: int) -> None:
        text = self.text
        # an error at the end of the file is shown just after the last token, on a real line
        loc = min(exc.loc, len(text.rstrip()))
        word = _WORD.match(text, loc)
        word_end = word.end() if word else loc + 1
        first = _WORD.match(text, start)
        kind = first.group() if first else ""
        line, col = self.lines.pos(start)
        notes = ()
        if kind in TOP_KEYWORDS and self.lines.pos(loc)[0] > line:
            notes = (f"inside {kind} started at {line}:{col}",)
        if exc.msg == _BAD_NUMBER:
            end = re.match(r"[+-]?[\w.]*", text[loc:]).end() + loc
            self.error("E002", "number too long", loc, max(end, loc + 1),
                       f"numbers have at most {sys.get_int_max_str_digits() or 'unlimited'} digits", notes=notes)
            return
        if exc.msg.startswith(_BAD_ESCAPE):
            self.error("E006", f"invalid escape '{exc.msg[len(_BAD_ESCAPE):]}' in a double-quoted string", loc,
                       loc + 1, "escapes are \\\\ \\\" \\n \\t \\uXXXX; write regexes in single quotes: "
                       "re:'layer\\d+'", notes=notes)
            return
        expected = exc.msg[len("Expected "):] if exc.msg.startswith("Expected ") else exc.msg
        if loc == start and kind not in TOP_KEYWORDS:
            if text[loc] == "}":
                self.error("E004", "unmatched '}'", loc, loc + 1, "there is no open block here")
            elif word:
                hint = did_you_mean(kind, TOP_KEYWORDS, "statements")
                if kind in (*(r.value for r in Role), "skip", "accumulator"):
                    hint = f"'{kind}' goes inside defaults {{ ... }} or rule TARGET {{ ... }}"
                self.error("E003", f"unknown statement '{kind}'", loc, word_end, hint)
            else:
                self.error("E002", f"expected a statement, found {_found(text, loc)}", loc, loc + 1,
                           "statements start with: " + ", ".join(TOP_KEYWORDS))
            return
        opened = text.find("{", start, loc)
        if kind in _BLOCKS and opened >= 0 and "'}'" in expected or (
                kind in _BLOCKS and opened >= 0 and (loc >= len(text) or (word and word.group() in TOP_KEYWORDS))):
            bl, bc = self.lines.pos(opened)
            self.error("E004", f"unclosed '{{' of {kind} started at {line}:{col}", loc, word_end,
                       f"add '}}' to close the block opened at {bl}:{bc}")
            return
        if kind == "rule" and opened < 0 and word and "'{'" in expected:
            self.error("E003", f"unknown rule option '{word.group()}'", loc, word_end,
                       did_you_mean(word.group(), RULE_OPTIONS, "options"), notes=notes)
            return
        if loc < len(text) and text[loc] in "\"'":
            self.error("E006", "unterminated or invalid string", loc, loc + 1,
                       "strings close on the same line; escapes are \\\\ \\\" \\n \\t \\uXXXX", notes=notes)
            return
        at_end = not text[loc:].strip()
        if expected == "')'" and (at_end or (word and word.group() in TOP_KEYWORDS)):
            opened = _unclosed(text, start, loc, "(", ")")
            if opened is not None:
                ol, oc = self.lines.pos(opened)
                self.error("E004", f"unclosed '(' opened at {ol}:{oc}", loc, word_end,
                           f"add ')' to close the argument list opened at {ol}:{oc}", notes=notes)
                return
        hints = ()
        if expected == "')'" and word:
            hints = ("separate arguments with ','",)
        elif expected == "')'" and text.startswith(",", loc):
            hints = ("an argument is missing between the commas",)
        self.error("E002", f"expected {expected}, found {_found(text, loc)}", loc, word_end, *hints, notes=notes)

    def resync(self, start: int, loc: int) -> int:
        """Where to resume after a failed statement that began at ``start``.

        The first of: just after the ``}`` that closes the statement's block (brace
        depth back to 0, strings and comments skipped), a line starting with a
        top-level keyword on or after the error's line, or an unindented word outside
        any block on a later line.
        """
        text, n = self.text, len(self.text)
        err_line = self.lines.pos(loc)[0]
        depth, i = 0, start
        while i < n:
            c = text[i]
            if i > start and text[i - 1] == "\n":
                line = self.lines.pos(i)[0]
                m = _SYNC_KW.match(text, i)
                if m and line >= err_line:
                    return m.start(1)
                if depth == 0 and line > err_line and _WORD.match(text, i):
                    return i
            if c in "\"'":
                end = text.find("\n", i)
                close = text.find(c, i + 1, end if end >= 0 else n)
                i = close + 1 if close >= 0 else (end if end >= 0 else n)
                continue
            if c == "#":
                end = text.find("\n", i)
                i = end if end >= 0 else n
                continue
            if c == "{":
                depth += 1
            elif c == "}" and depth > 0:
                depth -= 1
                if depth == 0 and i >= loc:
                    return i + 1
            i += 1
        return n

    def run(self) -> list[ast.Statement]:
        out: list[ast.Statement] = []
        text = _blank_comments(self.text)
        pos = _SKIP.match(text, 0).end()
        while pos < len(text):
            try:
                try:
                    stmt, nxt = parse_statement_fast(text, pos)
                except Fallback:  # anything unusual, and every error: pyparsing decides
                    stmt, nxt = _parse_statement_at(text, pos)
            except pp.ParseBaseException as exc:
                self.diagnose(exc, pos)
                pos = self.resync(pos, exc.loc)
            except RecursionError:
                self.error("E002", "nesting too deep", pos, pos + 1)
                break
            else:
                out.append(stmt)
                pos = max(nxt, pos + 1)
            pos = _SKIP.match(text, pos).end()
        return out


def parse_statements(text: str, filename: str = "<input>") -> tuple[list[ast.Statement], list[Diagnostic]]:
    """Every statement that parses, and an E0xx diagnostic per one that does not."""
    rec = _Recovering(text, filename)
    stmts = rec.run()
    return stmts, rec.diags


def parse_value(text: str, filename: str = "<--set>") -> tuple[ast.Value | None, list[Diagnostic]]:
    """One DSL value on its own (``--set weight.bits=4`` uses this for the right-hand side)."""
    rec = _Recovering(text, filename)
    try:
        return _VALUE.parse_string(_blank_comments(text))[0], []
    except pp.ParseBaseException as exc:
        loc = min(exc.loc, len(text))
        rec.error("E002", f"expected a value, found {_found(text, loc)}", loc, loc + 1,
                  "values are numbers, names, true/false, \"strings\" or calls like histogram(percentile=99.9)")
    except RecursionError:
        rec.error("E002", "nesting too deep", 0, 1)
    return None, rec.diags

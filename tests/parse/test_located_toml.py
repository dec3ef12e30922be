"""located_toml: spans for every kind of TOML construct, syntax errors, schema checks, fuzz."""

import pytest
from hypothesis import given, strategies as st

from qdsl.parse.located_toml import KeySpec, check_choice, check_keys, check_range, read_located_toml
from qdsl.spec.diagnostics import SpecError

DOC = '''version = 1
# comment
[quantizers.w4pot]
kind = "int"
bits = 4
observer = { name = "mse", p = [1, 2,
  3] }
"quoted key".x = 'lit'
s = """multi
line"""

[[rules]]
target = ["a", "b"]
weight.bits = 8
[[rules]]
target = "type:Conv"
[rules.weight]
bits = 3
'''


def _where(span):
    return (span.line, span.col, span.end_line, span.end_col)


@pytest.mark.parametrize(
    "path,value,expected",
    [
        (("version",), True, (1, 11, 1, 12)),
        (("version",), False, (1, 1, 1, 8)),
        (("quantizers", "w4pot", "bits"), True, (5, 8, 5, 9)),
        (("quantizers", "w4pot", "observer", "name"), True, (6, 21, 6, 26)),
        (("quantizers", "w4pot", "observer", "p", 2), True, (7, 3, 7, 4)),
        (("quantizers", "w4pot", "observer", "p"), True, (6, 32, 7, 5)),
        (("quantizers", "w4pot", "quoted key", "x"), False, (8, 14, 8, 15)),
        (("quantizers", "w4pot", "quoted key"), False, (8, 1, 8, 13)),
        (("quantizers", "w4pot", "s"), True, (9, 5, 10, 8)),
        (("rules", 0, "target", 1), True, (13, 16, 13, 19)),
        (("rules", 0, "weight", "bits"), False, (14, 8, 14, 12)),
        (("rules", 1, "target"), True, (16, 10, 16, 21)),
        (("rules", 1, "weight", "bits"), True, (18, 8, 18, 9)),
        (("rules", 1, "weight"), False, (17, 8, 17, 14)),
        (("rules", 1), False, (15, 3, 15, 8)),
    ],
)
def test_spans(path, value, expected):
    lt = read_located_toml(DOC, "f.toml")
    assert lt.has(path)
    span = lt.span(path, value=value)
    assert span.file == "f.toml"
    assert _where(span) == expected


def test_missing_path_falls_back_to_nearest_ancestor():
    lt = read_located_toml(DOC, "f.toml")
    span = lt.span(("rules", 1, "weight", "nope"))
    assert (span.line, span.col) == (17, 1)
    assert span.path == "$.rules[1].weight.nope"


@pytest.mark.parametrize(
    "text,line,col,fragment",
    [
        ("a = \n", 1, 5, "invalid value"),
        ("a = 1\na = 2\n", 2, 1, "cannot overwrite"),
        ("[x\n", 1, 3, "expected ']'"),
        ("a = [1,2", 1, 9, "unclosed array"),
        ('x = "abc', 1, 9, "unterminated string"),
        ("ok = 1\nbad key = 2\n", 2, 5, "expected '='"),
    ],
)
def test_syntax_errors_are_located(text, line, col, fragment):
    with pytest.raises(SpecError) as info:
        read_located_toml(text, "b.toml")
    (diag,) = info.value.diagnostics
    assert diag.code == "E001"
    assert (diag.span.line, diag.span.col) == (line, col)
    assert fragment in diag.message
    assert diag.hints
    assert "^" in diag.render()


def test_check_keys_reports_everything():
    lt = read_located_toml('[hw]\nbitz = 4\nsigned = "yes"\n', "p.toml")
    diags = []
    ok = check_keys(lt, ("hw",), {"bits": KeySpec((int,), required=True), "signed": KeySpec((bool,))}, diags)
    assert ok == {}
    assert [d.code for d in diags] == ["E101", "E102", "E103"]
    assert "did you mean 'bits'" in diags[0].hints[0]
    assert (diags[0].span.line, diags[0].span.col) == (2, 1)
    assert (diags[1].span.line, diags[1].span.col) == (3, 10)


def test_check_choice_and_range():
    lt = read_located_toml('scale = "pott"\nbits = 40\n', "p.toml")
    diags = []
    assert check_choice(lt, ("scale",), ["pot", "float"], diags, what="scale") is None
    assert check_range(lt, ("bits",), 1, 16, diags, what="bits") is None
    assert [d.code for d in diags] == ["E105", "E104"]
    assert "did you mean 'pot'" in diags[0].hints[0]


_toml_alphabet = st.sampled_from(list('abc=[]{}"\'.,#\n \t123-_:xyz\\') + ['"""', "'''", "[[", "]]", "true"])


@given(st.text(max_size=80))
def test_fuzz_arbitrary_text_only_spec_error(text):
    try:
        read_located_toml(text, "f.toml")
    except SpecError:
        pass


@given(st.lists(_toml_alphabet, max_size=40).map("".join))
def test_fuzz_toml_ish_text_only_spec_error(text):
    try:
        lt = read_located_toml(text, "f.toml")
    except SpecError:
        return
    # every written top-level key is located on a real line
    for key in lt.data:
        assert lt.span((key,), value=False).line >= 1


def test_deep_nesting_is_a_spec_error():
    with pytest.raises(SpecError):
        read_located_toml("a = " + "[" * 5000 + "]" * 5000, "f.toml")


# -- property: every value of a generated document is located exactly ------------------

import math
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from qdsl.parse.format import quote_string

_keys = st.one_of(st.from_regex(r"[A-Za-z0-9_-]{1,6}", fullmatch=True),
                  st.text(st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=5))
_scalars = st.one_of(st.booleans(), st.integers(-(2**40), 2**40),
                     st.floats(allow_nan=False, allow_infinity=False),
                     st.text(st.characters(blacklist_categories=("Cs",)), max_size=8))
_tables = st.recursive(st.dictionaries(_keys, _scalars | st.lists(_scalars, max_size=3), max_size=3),
                       lambda inner: st.dictionaries(_keys, inner | st.lists(inner, min_size=1, max_size=2),
                                                     max_size=3), max_leaves=12)


def _key(k, style):
    if k and all(c.isascii() and (c.isalnum() or c in "_-") for c in k) and style % 2:
        return k
    if style % 3 == 0 and "'" not in k and all(0x20 <= ord(c) != 0x7F for c in k):
        return f"'{k}'"
    return quote_string(k)


def _scalar(v, style):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if style % 4 == 0 and "'''" not in v and not v.endswith("'") and all(
            0x20 <= ord(c) != 0x7F or c in "\t\n" for c in v):
        return f"'''{v}'''"
    return quote_string(v)


def _inline(v, style):
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k, style)} = {_inline(x, style + 1)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        sep = ",\n  # comment\n  " if style % 2 else ", "
        return "[" + sep.join(_inline(x, style + 1) for x in v) + "]"
    return _scalar(v, style)


def _write(data, styles, prefix=()):
    """Plain keys first, then sub-tables as [headers] / [[arrays]] or inline, by ``styles``."""
    lines, later = [], []
    for i, (k, v) in enumerate(data.items()):
        style = styles[(len(prefix) + i) % len(styles)]
        path = prefix + (_key(k, style),)
        if isinstance(v, dict) and v and style % 3 == 1:
            later.append(["", "[" + ".".join(path) + "]  # table"] + _write(v, styles, path))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v) and style % 3 == 2:
            for item in v:
                later.append(["", "[[" + ".".join(path) + "]]"] + _write(item, styles, path))
        else:
            lines.append(f"{_key(k, style)} = {_inline(v, style)}")
    return lines + [line for block in later for line in block]


def _leaves(value, path=()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, path + (i,))
    else:
        yield path, value


@given(_tables, st.lists(st.integers(0, 11), min_size=1, max_size=5))
def test_every_value_is_located_exactly(data, styles):
    text = "\n".join(_write(data, styles)) + "\n"
    try:
        expected = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return  # the writer above is deliberately loose (e.g. a dotted key clash); skip those
    lt = read_located_toml(text, "gen.toml")
    assert lt.data == expected
    for path, value in _leaves(lt.data):
        span = lt.exact_span(path)
        assert span is not None, (path, text)
        written = "\n".join(text.split("\n")[span.line - 1:span.end_line])
        start = span.col - 1
        end_cut = len(written) - (len(text.split("\n")[span.end_line - 1]) - (span.end_col - 1))
        reread = tomllib.loads("x = " + written[start:end_cut])["x"]
        assert reread == value or (isinstance(value, float) and math.isclose(reread, value))

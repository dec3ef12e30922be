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

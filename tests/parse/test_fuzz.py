"""Fuzz: no input text makes the front ends raise anything but SpecError."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from qdsl.parse import parse_overrides, parse_text
from qdsl.spec.diagnostics import SpecError

SPECS = Path(__file__).resolve().parents[2] / "specs"
VALID = [p.read_text() for p in sorted(SPECS.glob("*.qspec*"))]

DSL_TOKENS = ["version", "fold_bn", "include", "quantizer", "defaults", "rule", "optional", "priority", "as",
              "weight", "input", "bias", "output", "skip", "accumulator", "int", "binary", "float", "w4",
              "bits", "signed", "per_channel", "observer", "histogram", "channel", "group", "scale",
              "input*weight", "re:", "type:", "layer1.*", "{", "}", "(", ")", "=", ",", ";", "\n", " ",
              "'", '"', "4", "-1", "99.9", "1e5", "#", "\\", "true", "false", "**", ":"]
TOML_TOKENS = ["[", "]", "[[", "]]", "{", "}", "=", ",", ".", '"', "'", '"""', "\n", " ", "#", "rules",
               "quantizers", "defaults", "target", "weight", "bits", "kind", "int", "granularity",
               "observer", "name", "1", "3.5", "true", "inf", "version", "\\u", "accumulator", "extends"]


def _only_spec_errors(text, filename, fmt=None):
    try:
        parse_text(text, filename, fmt)
    except SpecError as err:
        assert err.diagnostics
        for d in err.diagnostics:
            d.render()  # rendering must not fail either


@given(st.text(max_size=120))
def test_arbitrary_text_dsl(text):
    _only_spec_errors(text, "fuzz.qspec")


@given(st.text(max_size=120))
def test_arbitrary_text_toml(text):
    _only_spec_errors(text, "fuzz.qspec.toml")


@given(st.lists(st.sampled_from(DSL_TOKENS), max_size=40).map("".join))
def test_dsl_ish_text(text):
    _only_spec_errors(text, "fuzz.qspec")
    _only_spec_errors(text, "fuzz", None)  # sniffing path


@given(st.lists(st.sampled_from(TOML_TOKENS), max_size=40).map("".join))
def test_toml_ish_text(text):
    _only_spec_errors(text, "fuzz.qspec.toml")


@st.composite
def mutated(draw):
    index = draw(st.integers(0, len(VALID) - 1))
    text = VALID[index]
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["delete", "insert", "replace"]))
        chunk = draw(st.sampled_from(DSL_TOKENS + TOML_TOKENS) | st.text(max_size=3))
        if op == "delete":
            text = text[:pos] + text[pos + draw(st.integers(1, 20)):]
        elif op == "insert":
            text = text[:pos] + chunk + text[pos:]
        else:
            text = text[:pos] + chunk + text[pos + len(chunk):]
    return index, text


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_valid_files(case):
    index, text = case
    name = sorted(SPECS.glob("*.qspec*"))[index].name
    _only_spec_errors(text, name)


@given(st.lists(st.text(max_size=30), max_size=3))
def test_overrides_only_spec_errors(items):
    try:
        parse_overrides(items)
    except SpecError:
        pass


@given(st.lists(st.sampled_from(["weight", "input", ".", "bits", "=", "4", "defaults", "quantizers", "w8",
                                 "fold_bn", "true", "(", ")", "observer", "histogram", "x"]), max_size=12).map("".join))
def test_override_ish_items(item):
    try:
        parse_overrides([item])
    except SpecError:
        pass


@pytest.mark.parametrize("text", ["(" * 3000, "quantizer a = " + "(" * 3000, "a = " + "[" * 3000])
def test_deep_nesting(text):
    _only_spec_errors(text, "deep.qspec")
    _only_spec_errors(text, "deep.qspec.toml")

"""Any profile text gives a profile or a located SpecError - never another exception."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from qdsl.lint import parse_profile
from qdsl.spec.diagnostics import SpecError

KEYS = ["kinds", "bits", "signedness", "scales", "granularities", "channel_axes", "group_sizes", "zero_point",
        "narrow_range", "dynamic", "bitz", "pair_bits", "overflow", "scale", "zero_point"]
TABLES = ["roles.weight", "roles.bias", "op.conv2d.weight", "op.conv3d.input", "first_layer.input",
          "accumulator", "op.linear.accumulator", "fixed_output.softmax", "roles", "last_layer", "fixed_output.relu"]
VALUES = st.one_of(
    st.integers(-5, 70).map(str),
    st.sampled_from(['"int"', '"binary"', '"pot"', '"wrap"', '"required"', '"tensor"', '"input*weight"', "true",
                     "1.5", '"nope"', "[]", "[8, 4]", '["int", "float"]', '["channel"]', '["signed", 3]',
                     "[[1]]", "{ a = 1 }", '"conv2d+relu"']),
)
TOP = st.sampled_from(['version = 1', 'version = 2', 'version = "1"', 'integer_only = true', 'ops = ["conv2d"]',
                       'ops = ["conv9d"]', 'fusions = ["conv2d+relu"]', 'fusions = ["relu"]', 'name = 3',
                       'extends = "tflite-int8"', 'extends = "missing"', 'description = "x"'])


@settings(max_examples=80, deadline=None)
@given(top=st.lists(TOP, max_size=4, unique=True),
       tables=st.lists(st.tuples(st.sampled_from(TABLES), st.lists(st.tuples(st.sampled_from(KEYS), VALUES),
                                                                    max_size=4)), max_size=4))
def test_profile_text_never_crashes(top, tables):
    lines = list(top)
    for name, entries in tables:
        lines.append(f"[{name}]")
        seen = set()
        for k, v in entries:
            if k not in seen:
                seen.add(k)
                lines.append(f"{k} = {v}")
    text = "\n".join(lines) + "\n"
    try:
        profile = parse_profile(text, "fuzz.toml")
    except SpecError as err:
        assert err.diagnostics
        for d in err.diagnostics:
            assert d.code.startswith("E") and d.span.file in ("fuzz.toml", "qdsl/data/hw/tflite-int8.toml", "missing")
            assert d.span.known or d.span.path or d.code == "E191", d.render()
    else:
        assert profile.version == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(list('[]{}="., \n#abk01') + ["bits", "roles", "version = 1\n"]), max_size=40)
       .map("".join))
def test_arbitrary_text_is_a_located_error(text):
    try:
        parse_profile(text, "fuzz.toml")
    except SpecError as err:
        assert all(d.span.file == "fuzz.toml" for d in err.diagnostics)

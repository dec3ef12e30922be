"""Target matching: glob semantics (against an independent reference), regex, type, exact."""

import pytest
from hypothesis import given, strategies as st

from qdsl.resolve.plan import ModelIndex, ModuleEntry
from qdsl.resolve.targets import Level, compile_glob, compile_target, match_targets
from qdsl.spec.diagnostics import Diagnostic
from qdsl.spec.model import Target
from resolve_specs import ref_glob


components = st.text(alphabet="ab01", min_size=1, max_size=3)
names = st.lists(components, min_size=1, max_size=5).map(".".join)
pattern_parts = st.one_of(
    st.just("**"),
    st.text(alphabet="ab01*?", min_size=1, max_size=3).filter(lambda s: "**" not in s),
)
patterns = st.lists(pattern_parts, min_size=1, max_size=5).map(".".join)


@given(patterns, names)
def test_glob_agrees_with_reference(pattern, name):
    assert bool(compile_glob(pattern)(name)) == ref_glob(pattern, name)


@pytest.mark.parametrize("pattern,name,expected", [
    ("layer1.*.conv1", "layer1.0.conv1", True),
    ("layer1.*.conv1", "layer1.0.0.conv1", False),  # * stays inside one component
    ("layer1.**.conv1", "layer1.0.0.conv1", True),
    ("layer1.**.conv1", "layer1.conv1", True),  # ** may be zero components
    ("layer2.0.**", "layer2.0", True),  # ...so a subtree glob includes its root
    ("layer2.0.**", "layer2.0.downsample.0", True),
    ("layer2.0.**", "layer2.00", False),
    ("**.fc", "fc", True),
    ("**.fc", "head.fc", True),
    ("**.fc", "headfc", False),
    ("layer**", "layer1.0.conv1", True),  # ** inside a component crosses dots
    ("conv?", "conv1", True),
    ("conv?", "conv10", False),
    ("layer[12].0", "layer2.0", True),
    ("layer[!1].0", "layer2.0", True),
    ("layer[!1].0", "layer1.0", False),
    ("a[!x]b", "a.b", False),  # a negated set never matches the separator
    ("**", "", True),
])
def test_glob_examples(pattern, name, expected):
    assert bool(compile_glob(pattern)(name)) is expected


INDEX = ModelIndex([
    ModuleEntry("", "Net", {}),
    ModuleEntry("features", "Sequential", {}, leaf=False),
    ModuleEntry("features.0", "Conv2d", {"weight": (8, 3, 3, 3)}),
    ModuleEntry("features.1", "MyConv2d", {"weight": (8, 8, 3, 3)}),
    ModuleEntry("features.10", "Conv2d", {"weight": (8, 8, 3, 3)}),
    ModuleEntry("head", "Linear", {"weight": (10, 8)}),
])


def hits(text):
    ct = compile_target(Target.parse(text))
    assert not isinstance(ct, Diagnostic)
    return match_targets([ct], INDEX)[0]


def test_regex_is_a_full_match():
    assert hits(r"re:features\.1") == ("features.1",)  # not features.10
    assert hits(r"re:features\.1.*") == ("features.1", "features.10")
    assert hits("re:.*") == tuple(e.fqn for e in INDEX)  # the root ("") included


def test_type_matches_the_exact_class_name_only():
    assert hits("type:Conv2d") == ("features.0", "features.10")  # MyConv2d is not Conv2d
    assert hits("type:MyConv2d") == ("features.1",)


def test_exact_and_levels():
    assert hits("features.1") == ("features.1",)
    assert hits("features.2") == ()
    levels = {t: compile_target(Target.parse(t)).level for t in ("type:X", "a.*", "re:a", "a.b")}
    assert levels == {"type:X": Level.TYPE, "a.*": Level.GLOB, "re:a": Level.GLOB, "a.b": Level.EXACT}


@pytest.mark.parametrize("text,fragment", [
    ("re:(", "invalid target"),
    ("a[bc", "unterminated"),
    ("type:", "empty target"),
    ("re:", "empty target"),
])
def test_malformed_targets_are_diagnostics(text, fragment):
    d = compile_target(Target.parse(text))
    assert isinstance(d, Diagnostic) and d.code == "E218" and fragment in d.message

"""Property tests: spec -> text -> spec and spec -> TOML -> spec are identities.

Specs are generated over the records themselves (presets, extends, every target kind,
priorities, optional, skip, accumulators, observers with parameters, granularities),
restricted to what a file can say: names that are valid names, finite numbers, targets
that classify back to themselves (``Target.parse(t.text) == t``).
"""

import re

import pytest
from hypothesis import given, settings, strategies as st

from qdsl.parse import format_spec, parse_text
from qdsl.parse.schema import LEARNED_ROUNDINGS, RESERVED_PRESET_NAMES
from qdsl.spec.model import (
    DERIVED_BIAS_SCALE,
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
    TensorQuant,
)

texts = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
part_names = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
preset_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True).filter(
    lambda n: n not in RESERVED_PRESET_NAMES)
param_values = st.one_of(
    st.booleans(),
    st.integers(-(10**9), 10**9),
    st.floats(allow_nan=False, allow_infinity=False),
    texts,
)
observers = st.builds(
    ObserverSpec,
    part_names,
    st.dictionaries(part_names.filter(lambda k: k != "name"), param_values, max_size=3),
)
granularities = st.one_of(
    st.just(Granularity(GranularityKind.TENSOR)),
    st.builds(Granularity, st.just(GranularityKind.CHANNEL), axis=st.none() | st.integers(-8, 7)),
    st.builds(Granularity, st.just(GranularityKind.GROUP), group_size=st.integers(1, 4096)),
)


def quants(role):
    wide = role in (None, Role.BIAS)
    scale = part_names | (st.just(DERIVED_BIAS_SCALE) if wide else st.nothing())
    opt = lambda s: st.none() | s  # noqa: E731
    return st.builds(
        TensorQuant,
        kind=opt(st.sampled_from(Kind)),
        bits=opt(st.integers(1, 32 if wide else 16)),
        signed=opt(st.booleans()),
        narrow_range=opt(st.booleans()),
        symmetric=opt(st.booleans()),
        scale=opt(scale),
        granularity=opt(granularities),
        observer=opt(observers),
        rounding=opt(part_names),
        dynamic=opt(st.booleans()),
        extends=opt(preset_names),
    )


@st.composite
def bodies(draw):
    roles = {}
    for role in draw(st.lists(st.sampled_from(Role), unique=True, max_size=4)):
        roles[role] = draw(quants(role))
    acc = draw(st.none() | st.builds(Accumulator, st.integers(2, 64), st.sampled_from(Overflow)))
    return RuleBody(roles, draw(st.none() | st.booleans()), acc)


exact_names = texts.filter(lambda s: not re.search(r"[*?\[]", s) and not s.startswith(("type:", "re:", "@")))
glob_names = st.from_regex(r"[a-z0-9_]{1,4}(\.(\*\*|\*|[a-z0-9_]{1,3}\?|\[!?ab\]))+", fullmatch=True)


def _compiles(p):
    try:
        re.compile(p)
        return True
    except (re.error, RecursionError, OverflowError):
        return False


regexes = st.one_of(st.sampled_from([r".*downsample.*", r"layer\d+\.conv[12]", "a|b", "x'y\"z"]),
                    texts.filter(_compiles)).map(lambda p: "re:" + p)
type_names = preset_names.map(lambda n: "type:" + n)
positional = st.sampled_from(["@first", "@last"])
targets = st.one_of(exact_names, glob_names, regexes, type_names, positional).map(Target.parse)

rules = st.builds(
    Rule,
    st.lists(targets, min_size=1, max_size=3),
    bodies(),
    st.booleans(),
    st.none() | st.integers(-(2**31), 2**31 - 1),
    st.none() | texts,
)

specs = st.builds(
    QuantSpec,
    fold_bn=st.none() | st.booleans(),
    bias_correction=st.none() | st.booleans(),
    learned_rounding=st.none() | st.sampled_from(LEARNED_ROUNDINGS),
    includes=st.lists(texts, max_size=2),
    quantizers=st.dictionaries(preset_names, quants(None), max_size=3),
    defaults=bodies(),
    rules=st.lists(rules, max_size=3),
)


def _check_round_trips(spec):
    dsl = format_spec(spec, to="qspec")
    again = parse_text(dsl, "gen.qspec")
    assert again == spec, dsl
    assert format_spec(again, to="qspec") == dsl

    toml = format_spec(spec, to="toml")
    again = parse_text(toml, "gen.qspec.toml")
    assert again == spec, toml
    assert format_spec(again, to="toml") == toml

    # conversion both ways: DSL -> TOML -> DSL
    assert parse_text(format_spec(parse_text(dsl, "a.qspec"), to="toml"), "a.qspec.toml") == spec


# Generating these specs costs more than checking them, so one generated spec is checked
# in every direction; the default run is kept short and a slow run goes deep.
@settings(max_examples=20)
@given(specs)
def test_round_trips(spec):
    _check_round_trips(spec)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None)
@given(specs)
def test_round_trips_deep(spec):
    _check_round_trips(spec)

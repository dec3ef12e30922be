"""Property: on random rule sets the resolver agrees with a brute-force reference cascade.

The reference re-derives, per layer, every rule's specificity from scratch (regex via
``re``, globs via the component-wise reference matcher ``ref_glob``) and picks the winner
by (level, priority, file order) without memoization; a tie at the top between
different values must be an E209 error instead.
"""

import re

import pytest
from hypothesis import given, settings, strategies as st

from qdsl.resolve import resolve
from qdsl.resolve.plan import ModelIndex
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.model import Granularity, GranularityKind, Kind, ObserverSpec, Role, TargetKind
from qdsl.zoo.models import digits_resnet
from resolve_specs import body, ref_glob, rule, spec, tq

INDEX = ModelIndex.from_module(digits_resnet())
TARGETS = [
    # no type:BatchNorm2d: a type rule setting a weight on a class without a weight
    # kernel is an E203 error (test_cascade.py), not a rule the cascade ignores
    "type:Conv2d", "type:Linear",
    "layer1.*.conv1", "layer*.*.conv?", "**.conv2", "layer2.**", "stem.*",
    r"re:layer1\..*", r"re:.*\.conv1", r"re:.*downsample.*",
    "stem.0", "fc", "layer1.0.conv1", "layer2.1.conv2",
]
LEVEL = {TargetKind.TYPE: 2, TargetKind.GLOB: 3, TargetKind.REGEX: 3, TargetKind.EXACT: 4}

rules_st = st.lists(
    st.tuples(
        st.lists(st.sampled_from(TARGETS), min_size=1, max_size=3, unique=True),
        st.one_of(st.none(), st.integers(-2, 2)),
        st.integers(2, 8),
    ),
    max_size=6,
)


def ref_level(target, entry):
    kind = target.kind
    if kind is TargetKind.TYPE:
        hit = entry.type_name == target.pattern
    elif kind is TargetKind.REGEX:
        hit = re.fullmatch(target.pattern, entry.fqn) is not None
    elif kind is TargetKind.GLOB:
        hit = ref_glob(target.pattern, entry.fqn)
    else:
        hit = entry.fqn == target.pattern
    return LEVEL[kind] if hit else 0


def reference(s):
    """fqn -> expected weight bits, or None when some layer has an unresolvable tie."""
    expected = {}
    for entry in INDEX:
        if len(entry.param_shapes.get("weight", ())) < 2:
            continue  # only weight kernels take the weight role (not BN's 1-D scale)
        cands = []
        if entry.type_name in ("Conv2d", "Linear"):
            cands.append((1, 0, -1, 8))
        for order, r in enumerate(s.rules):
            level = max(ref_level(t, entry) for t in r.targets)
            if level:
                cands.append((level, r.priority or 0, order, r.body.roles[Role.WEIGHT].bits))
        if not cands:
            continue
        top = max(cands)
        if any(c[:2] == top[:2] and c[3] != top[3] for c in cands):
            return None
        expected[entry.fqn] = top[3]
    return expected


@settings(max_examples=80, deadline=None)
@given(rules_st)
def test_resolver_matches_reference_cascade(raw):
    s = spec(
        defaults=body(2, weight=tq(2, bits=8)),
        rules=[rule(10 + i, *ts, priority=p, optional=True, weight=tq(10 + i, bits=b))
               for i, (ts, p, b) in enumerate(raw)],
    )
    expected = reference(s)
    if expected is None:
        with pytest.raises(SpecError) as exc:
            resolve(INDEX, s)
        assert set(exc.value.codes) == {"E209"}
        return
    plan = resolve(INDEX, s)
    got = {lp.fqn: lp.recipe("weight").bits for lp in plan.layers if lp.recipe("weight") is not None}
    assert got == expected


quant_st = st.builds(
    dict,
    kind=st.one_of(st.none(), st.sampled_from(list(Kind))),
    bits=st.one_of(st.none(), st.integers(-1, 40)),
    symmetric=st.one_of(st.none(), st.booleans()),
    scale=st.one_of(st.none(), st.sampled_from(["float", "pot", "learned", "learned_pot", "input*weight", "bogus"])),
    granularity=st.one_of(
        st.none(),
        st.builds(Granularity, st.just(GranularityKind.CHANNEL), st.one_of(st.none(), st.integers(-5, 5))),
        st.builds(Granularity, st.just(GranularityKind.GROUP), st.none(), st.integers(-2, 64)),
    ),
    observer=st.one_of(st.none(), st.sampled_from([
        ObserverSpec("minmax"), ObserverSpec("mean_abs"), ObserverSpec("ema", {"momentum": -1.0}),
        ObserverSpec("histogram", {"bins": 16}), ObserverSpec("nope"),
    ])),
    dynamic=st.one_of(st.none(), st.booleans()),
).map(lambda d: {k: v for k, v in d.items() if v is not None})


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.sampled_from(list(Role)), quant_st, max_size=4),
       st.lists(st.tuples(st.sampled_from(TARGETS), st.sampled_from(list(Role)), quant_st), max_size=4))
def test_any_field_combination_gives_a_plan_or_located_spec_errors(defaults, raw_rules):
    s = spec(
        defaults=body(2, **{r.value: tq(2, **q) for r, q in defaults.items()}),
        rules=[rule(10 + i, t, optional=True, **{r.value: tq(10 + i, **q)}) for i, (t, r, q) in enumerate(raw_rules)],
    )
    try:
        plan = resolve(INDEX, s)
    except SpecError as exc:
        assert all(d.code.startswith("E2") for d in exc.diagnostics)
        assert all(d.span.known for d in exc.diagnostics)
        return
    for lp in plan.layers:
        for recipe in lp.roles.values():
            if recipe is not None:
                assert 1 <= recipe.bits <= 32 and recipe.observer_params is not None


def test_broad_rules_never_quantize_batchnorm_weights():
    from qdsl.resolve import resolve
    from qdsl.spec.model import QuantSpec, Rule, RuleBody, Target, TensorQuant
    from qdsl.zoo.models import digits_resnet

    spec = QuantSpec(rules=[Rule([Target.parse("layer1.**")], RuleBody({"weight": TensorQuant(bits=4)}))])
    plan = resolve(digits_resnet(), spec)
    quantized = {l.fqn for l in plan.layers if l.recipe("weight") is not None}
    assert "layer1.0.conv1" in quantized
    assert not any(".bn" in f for f in quantized)

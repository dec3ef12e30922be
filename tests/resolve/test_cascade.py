"""The cascade on real torch models: precedence, conflicts, priority, skip, float, overrides."""

import pytest

from qdsl.resolve import resolve
from qdsl.resolve.plan import ModelIndex
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.model import Accumulator, Granularity, GranularityKind, Kind, ObserverSpec, Overflow, Role
from resolve_specs import body, rule, sp, spec, tq

W8 = {"w8": tq(2, kind=Kind.INT, bits=8, scale="pot", granularity=Granularity(GranularityKind.CHANNEL))}


def all_levels(overrides=None):
    return spec(
        presets=W8,
        defaults=body(5, weight=tq(5, extends="w8")),
        rules=[
            rule(10, "type:Conv2d", weight=tq(10, bits=6)),
            rule(11, "layer1.*.conv1", weight=tq(11, bits=5)),
            rule(12, "layer1.0.conv1", weight=tq(12, bits=4)),
        ],
        overrides=overrides,
    )


def bits(plan, fqn, role=Role.WEIGHT):
    return plan.layer(fqn).recipe(role).bits


def test_each_level_beats_the_one_below(resnet):
    plan = resolve(resnet, all_levels())
    assert bits(plan, "layer1.0.conv1") == 4  # exact
    assert bits(plan, "layer1.1.conv1") == 5  # glob
    assert bits(plan, "layer1.0.conv2") == 6  # type
    assert bits(plan, "fc") == 8  # defaults (Linear is not a Conv2d)
    prov = plan.layer("layer1.0.conv1").provenance[(Role.WEIGHT, "bits")]
    assert prov.set_by.label == "rule layer1.0.conv1"
    assert prov.set_by.span.line == 12
    # everything it beat, nearest first, with the values they wanted
    assert [(o.label, v) for o, v in prov.overridden] == [
        ("rule layer1.*.conv1", 5), ("rule type:Conv2d", 6), ("defaults via w8", 8)]


def test_overrides_beat_exact_rules(resnet):
    plan = resolve(resnet, all_levels(overrides=body(90, weight=tq(90, bits=3))))
    for fqn in ("layer1.0.conv1", "layer1.1.conv1", "fc", "stem.0"):
        assert bits(plan, fqn) == 3
    prov = plan.layer("layer1.0.conv1").provenance[(Role.WEIGHT, "bits")]
    assert prov.set_by.label == "override weight.bits=3"
    assert prov.overridden[0][1] == 4


def test_cascade_is_field_by_field(resnet):
    plan = resolve(resnet, all_levels())
    lp = plan.layer("layer1.0.conv1")
    # bits came from the exact rule, scale and granularity still from the defaults' preset
    assert lp.recipe("weight").scale == "pot"
    assert lp.recipe("weight").granularity == Granularity(GranularityKind.CHANNEL, 0)
    scale = lp.provenance[(Role.WEIGHT, "scale")]
    assert scale.set_by.label == "defaults" and scale.set_by.span.line == 5
    assert [v.label for v in scale.via] == ["w8"] and scale.via[0].span.line == 2
    # unset fields are built-in defaults
    rounding = lp.provenance[(Role.WEIGHT, "rounding")]
    assert rounding.set_by.label == "built-in default" and rounding.value == "half_even"


def test_same_specificity_different_values_is_an_error_naming_both(resnet):
    s = spec(rules=[
        rule(3, "layer1.*.conv1", weight=tq(3, bits=4)),
        rule(7, r"re:layer1\.0\..*", weight=tq(7, bits=6)),
    ])
    with pytest.raises(SpecError) as exc:
        resolve(resnet, s)
    (d,) = [d for d in exc.value.diagnostics if d.code == "E209"]
    assert "rule layer1.*.conv1" in d.message and r"rule re:layer1\.0\..*" in d.message
    assert "weight.bits" in d.message and "glob/regex" in d.message
    assert "m.qspec:3:10" in " ".join(d.notes) and "m.qspec:7:10" in " ".join(d.notes)
    assert any("layer1.0.conv1" in n for n in d.notes)
    assert "priority" in d.hints[0]


def test_same_value_is_not_a_conflict(resnet):
    s = spec(rules=[
        rule(3, "layer1.*.conv1", weight=tq(3, bits=4)),
        rule(7, r"re:layer1\.0\..*", weight=tq(7, bits=4)),
    ])
    plan = resolve(resnet, s)
    prov = plan.layer("layer1.0.conv1").provenance[(Role.WEIGHT, "bits")]
    assert prov.set_by.span.line == 7  # the later rule is recorded
    assert prov.overridden[0][0].label == "rule layer1.*.conv1"


@pytest.mark.parametrize("first,second,expect", [(5, None, 4), (None, 1, 6), (2, 1, 4), (-1, None, 6)])
def test_priority_decides_within_a_level(resnet, first, second, expect):
    s = spec(rules=[
        rule(3, "layer1.*.conv1", priority=first, weight=tq(3, bits=4)),
        rule(7, r"re:layer1\.0\..*", priority=second, weight=tq(7, bits=6)),
    ])
    assert bits(resolve(resnet, s), "layer1.0.conv1") == expect


def test_equal_priorities_still_conflict(resnet):
    s = spec(rules=[
        rule(3, "layer1.*.conv1", priority=2, weight=tq(3, bits=4)),
        rule(7, r"re:layer1\.0\..*", priority=2, weight=tq(7, bits=6)),
    ])
    with pytest.raises(SpecError, match="E209"):
        resolve(resnet, s)


def test_priority_never_crosses_levels(resnet):
    s = spec(rules=[
        rule(3, "layer1.0.conv1", weight=tq(3, bits=4)),
        rule(7, "layer1.*.conv1", priority=100, weight=tq(7, bits=6)),
    ])
    assert bits(resolve(resnet, s), "layer1.0.conv1") == 4


def test_multi_target_rule_takes_its_most_specific_matching_target(resnet):
    s = spec(rules=[
        rule(3, "type:Conv2d", "stem.0", weight=tq(3, bits=4)),
        rule(7, "stem.*", weight=tq(7, bits=6)),
    ])
    plan = resolve(resnet, s)
    assert bits(plan, "stem.0") == 4  # exact via its second target beats the glob
    assert bits(plan, "layer1.0.conv1") == 4  # type level; the glob does not match here


def test_unmatched_target_is_an_error_at_the_target(resnet):
    s = spec(rules=[rule(4, "layer1.0.conv1", "layer1.0.convv2", weight=tq(4, bits=4))])
    with pytest.raises(SpecError) as exc:
        resolve(resnet, s)
    (d,) = exc.value.diagnostics
    assert d.code == "E201" and "layer1.0.convv2" in d.message
    assert (d.span.line, d.span.col) == (4, 18)
    assert "did you mean 'layer1.0.conv2'" in d.hints[0]


def test_unmatched_type_lists_the_model_types(resnet):
    with pytest.raises(SpecError) as exc:
        resolve(resnet, spec(rules=[rule(4, "type:Conv1d", weight=tq(4, bits=4))]))
    assert "BasicBlock" in exc.value.diagnostics[0].hints[0]


def test_optional_rule_may_match_nothing(resnet):
    s = spec(rules=[rule(4, "features.*", optional=True, weight=tq(4, bits=4))])
    plan = resolve(resnet, s)
    assert plan.rule_matches[0].fqns == ()


def test_rule_matching_modules_without_its_tensor_is_an_error(resnet):
    with pytest.raises(SpecError) as exc:
        resolve(resnet, spec(rules=[rule(4, "re:.*relu.*", weight=tq(4, bits=4))]))
    (d,) = exc.value.diagnostics
    assert d.code == "E202" and "weight" in d.message and d.span.line == 4


def test_type_rule_on_a_class_without_the_parameter_is_e203(resnet):
    # a class without a weight kernel is the same mistake as an exact name without one
    with pytest.raises(SpecError) as exc:
        resolve(resnet, spec(rules=[rule(4, "type:ReLU", weight=tq(4, bits=4))]))
    (d,) = exc.value.diagnostics
    assert d.code == "E203" and "ReLU" in d.message and d.span.line == 4


def test_exact_rule_on_a_module_without_the_parameter(resnet):
    with pytest.raises(SpecError) as exc:
        resolve(resnet, spec(rules=[rule(4, "layer1.0.relu1", weight=tq(4, bits=4))]))
    codes = exc.value.codes
    assert codes == ["E203"]  # not also E202
    assert "ReLU" in exc.value.diagnostics[0].message


def test_optional_exact_rule_on_a_container_sets_what_the_container_has(resnet):
    # a bundled spec's "first layer" name (features.0) is a ConvBN-ReLU6 block in MobileNetV2
    # (was E203 there); optional, it sets only the container's input, not a weight
    s = spec(rules=[rule(4, "layer1.0", optional=True, weight=tq(4, bits=4), input=tq(4, bits=8))])
    plan = resolve(resnet, s)
    assert plan.layer("layer1.0").recipe("input").bits == 8
    assert Role.WEIGHT not in plan.layer("layer1.0").roles
    assert plan.layer("layer1.0.conv1").recipe(Role.WEIGHT) is None  # not passed down
    # without 'optional', or where the module has a parameter of its own, it stays E203
    with pytest.raises(SpecError) as exc:
        resolve(resnet, spec(rules=[rule(4, "layer1.0", weight=tq(4, bits=4))]))
    assert exc.value.codes == ["E203"]


def test_glob_rule_applies_roles_only_where_the_tensor_exists(resnet):
    s = spec(rules=[rule(4, "layer1.0.*", weight=tq(4, bits=4), output=tq(4, bits=8))])
    plan = resolve(resnet, s)
    assert plan.layer("layer1.0.relu1").recipe("output").bits == 8
    assert Role.WEIGHT not in plan.layer("layer1.0.relu1").roles
    assert bits(plan, "layer1.0.conv1") == 4


def test_container_output_rule(resnet):
    plan = resolve(resnet, spec(rules=[rule(4, "type:BasicBlock", output=tq(4, bits=8, signed=False))]))
    blocks = [lp.fqn for lp in plan.layers if lp.type_name == "BasicBlock"]
    assert blocks == ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]
    out = plan.layer("layer2.0").recipe("output")
    assert (out.bits, out.signed) == (8, False)
    assert plan.layer("layer2.0").recipe("input") is None


def test_skip_and_unskip(resnet):
    s = spec(
        defaults=body(3, weight=tq(3, bits=8), input=tq(3, bits=8)),
        rules=[
            rule(5, "re:.*downsample.*", skip=True),
            rule(6, "layer2.0.downsample.0", skip=False),
            rule(7, "layer2.*.conv1", skip=True),
        ],
    )
    plan = resolve(resnet, s)
    assert plan.layer("layer2.0.downsample.0").skip is False  # exact beats regex
    assert plan.layer("layer2.0.downsample.0").recipe("weight").bits == 8
    lp = plan.layer("layer2.1.conv1")
    assert lp.skip and not lp.quantized and all(r is None for r in lp.roles.values())
    assert lp.provenance[("layer", "skip")].set_by.label == "rule layer2.*.conv1"
    assert plan.layer("layer2.0.downsample").skip  # the container too (regex matches it)


def test_kind_float_leaves_that_role_float_and_overrides_do_not_revive_it(resnet):
    s = spec(
        defaults=body(3, weight=tq(3, bits=8), input=tq(3, bits=8)),
        rules=[rule(5, "stem.0", input=tq(5, kind=Kind.FLOAT))],
        overrides=body(9, input=tq(9, bits=4), output=tq(9, bits=4)),
    )
    plan = resolve(resnet, s)
    lp = plan.layer("stem.0")
    assert lp.recipe("input") is None and lp.recipe("weight").bits == 8
    assert lp.provenance[(Role.INPUT, "kind")].value is Kind.FLOAT
    # overrides touch only quantized roles: other inputs change, no output appears anywhere
    assert plan.layer("fc").recipe("input").bits == 4
    assert all(lp.recipe("output") is None for lp in plan.layers)


def test_override_can_turn_a_role_float(resnet):
    s = spec(defaults=body(3, weight=tq(3, bits=8)), overrides=body(9, weight=tq(9, kind=Kind.FLOAT)))
    plan = resolve(resnet, s)
    assert all(lp.recipe("weight") is None for lp in plan.layers)


def test_roles_are_quantized_only_when_mentioned(resnet):
    plan = resolve(resnet, spec(defaults=body(3, weight=tq(3, bits=8))))
    fc = plan.layer("fc")
    assert fc.recipe("bias") is None and fc.recipe("input") is None and fc.recipe("output") is None
    assert Role.BIAS not in plan.layer("stem.0").roles  # bias=False convs have no bias role
    # weighted layers are listed even when nothing applies to them; others are not
    plain = resolve(resnet, spec())
    assert {lp.type_name for lp in plain.layers} == {"Conv2d", "Linear"}
    assert not any(lp.quantized for lp in plain.layers)


def test_builtin_defaults_depend_on_kind_and_role(resnet):
    s = spec(defaults=body(
        3,
        weight=tq(3, kind=Kind.BINARY, granularity=Granularity(GranularityKind.CHANNEL)),
        input=tq(4),
        bias=tq(5, scale="input*weight"),
    ))
    fc = resolve(resnet, s).layer("fc")
    w, b, x = fc.recipe("weight"), fc.recipe("bias"), fc.recipe("input")
    assert (w.bits, w.observer.name, w.granularity.axis) == (1, "mean_abs", 0)
    assert x.observer.name == "auto" and x.bits == 8
    # (a per-channel input cannot feed an input*weight bias: E214, so it is checked alone)
    s = spec(defaults=body(3, input=tq(4, granularity=Granularity(GranularityKind.CHANNEL))))
    assert resolve(resnet, s).layer("fc").recipe("input").granularity.axis == 1
    assert (b.bits, b.signed, b.symmetric) == (32, True, True)
    assert fc.provenance[(Role.BIAS, "bits")].set_by.label == "built-in default"


def test_accumulator_cascades_as_a_layer_field(resnet):
    s = spec(
        defaults=body(3, accumulator=Accumulator(24, Overflow.SATURATE, span=sp(3, 20)), weight=tq(3, bits=8)),
        rules=[rule(6, "fc", accumulator=Accumulator(16, span=sp(6, 20)))],
    )
    plan = resolve(resnet, s)
    assert plan.layer("stem.0").accumulator == Accumulator(24, Overflow.SATURATE)
    assert plan.layer("fc").accumulator.bits == 16
    prov = plan.layer("fc").provenance[("layer", "accumulator")]
    assert prov.set_by.span.line == 6 and prov.overridden[0][1].bits == 24


def test_rule_matches_and_matched_rules(resnet):
    s = spec(rules=[
        rule(3, "layer1.*.conv?", weight=tq(3, bits=4)),
        rule(4, "fc", input=tq(4, bits=8)),
    ])
    plan = resolve(resnet, s)
    assert plan.rule_matches[0].fqns == ("layer1.0.conv1", "layer1.0.conv2", "layer1.1.conv1", "layer1.1.conv2")
    assert plan.rule_matches[1].fqns == ("fc",)
    assert plan.layer("fc").matched_rules == (1,)
    assert plan.layer("stem.0").matched_rules == ()


def test_observer_params_are_validated_objects(conv1d):
    s = spec(defaults=body(3, input=tq(3, observer=ObserverSpec("histogram", {"percentile": 99.5}))))
    params = resolve(conv1d, s).layer("features.0").recipe("input").observer_params
    assert params.percentile == 99.5 and params.bins == 2048


def test_module_and_index_resolve_the_same(cbr):
    s = spec(presets=W8, defaults=body(3, weight=tq(3, extends="w8")),
             rules=[rule(5, "features.3", weight=tq(5, bits=4))])
    a, b = resolve(cbr, s), resolve(ModelIndex.from_module(cbr), s)
    assert a.layers == b.layers
    assert [lp.provenance for lp in a.layers] == [lp.provenance for lp in b.layers]


def test_every_error_is_reported_at_once(resnet):
    s = spec(rules=[
        rule(3, "nope", weight=tq(3, bits=4)),
        rule(4, "re:.*relu.*", weight=tq(4, bits=4)),
        rule(5, "fc", weight=tq(5, bits=40)),
        rule(6, "layer1.*.conv1", weight=tq(6, bits=4)),
        rule(7, "re:layer1.0.conv1", weight=tq(7, bits=5)),
    ])
    with pytest.raises(SpecError) as exc:
        resolve(resnet, s)
    assert sorted(exc.value.codes) == ["E201", "E202", "E209", "E210"]


def test_layer_fields_conflict_like_any_other(resnet):
    s = spec(rules=[rule(3, "layer1.*.conv1", skip=True), rule(4, "re:layer1.0.conv.", skip=False)])
    with pytest.raises(SpecError) as exc:
        resolve(resnet, s)
    (d,) = exc.value.diagnostics
    assert d.code == "E209" and "set skip" in d.message and "on layer layer1.0.conv1" in d.notes

"""Validation of quantizers: reasons, codes and locations; model-dependent shape checks."""

import pytest

from qdsl.resolve import check_spec, resolve, validate_recipe
from qdsl.resolve.plan import QuantizerRecipe
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.model import Granularity, GranularityKind, Kind, ObserverSpec, Role
from resolve_specs import body, rule, sp, spec, tq

CH = Granularity(GranularityKind.CHANNEL)


def group(n):
    return Granularity(GranularityKind.GROUP, group_size=n)


def only(diags, code):
    found = [d for d in diags if d.code == code]
    assert len(found) == 1, [d.render() for d in diags]
    return found[0]


# (role, fields, code, the field the caret must point at)
CASES = [
    ("weight", dict(bits=17), "E210", "bits"),
    ("weight", dict(bits=0), "E210", "bits"),
    ("weight", dict(kind=Kind.BINARY, bits=4), "E211", "bits"),
    ("weight", dict(kind=Kind.BINARY, symmetric=False), "E211", "symmetric"),
    ("weight", dict(kind=Kind.TERNARY, bits=3), "E211", "bits"),
    ("weight", dict(kind=Kind.POT, bits=1), "E211", "bits"),
    ("input", dict(granularity=group(32)), "E212", "granularity"),
    ("weight", dict(granularity=group(0)), "E212", "granularity"),
    ("input", dict(scale="learned", dynamic=True), "E213", "dynamic"),
    ("weight", dict(scale="input*weight"), "E214", "scale"),
    ("weight", dict(kind=Kind.INT, observer=ObserverSpec("mean_abs")), "E215", "observer"),
    ("weight", dict(observer=ObserverSpec("minmaxx")), "E204", "observer"),
    ("weight", dict(scale="pots"), "E204", "scale"),
    ("weight", dict(rounding="nearest"), "E204", "rounding"),
    ("input", dict(observer=ObserverSpec("histogram", {"percentil": 99.0})), "E205", "observer"),
    ("input", dict(observer=ObserverSpec("percentile", {"percentile": 120.0})), "E206", "observer"),
]


@pytest.mark.parametrize("role,fields,code,at", CASES, ids=[f"{c[2]}-{'-'.join(c[1])}" for c in CASES])
def test_invalid_quantizer_located_at_its_field(resnet, role, fields, code, at):
    q = tq(7, **fields)
    s = spec(rules=[rule(7, "fc", **{role: q})])
    d = only(check_spec(s), code)
    assert d.span == q.span_of(at)
    with pytest.raises(SpecError) as exc:
        resolve(resnet, s)
    assert exc.value.codes.count(code) == 1  # model-free and resolved checks are not both shown


def test_messages_give_reasons_and_known_names():
    d = only(check_spec(spec(rules=[rule(7, "fc", weight=tq(7, observer=ObserverSpec("minmaxx")))])), "E204")
    assert "unknown observer 'minmaxx'" in d.message
    assert "did you mean 'minmax'" in d.hints[0] and "percentile" in d.hints[0]
    d = only(check_spec(spec(rules=[rule(7, "fc", input=tq(7, scale="learned", dynamic=True))])), "E213")
    assert "nothing to learn" in d.message


def test_bias_may_use_32_bits_but_not_more(resnet):
    ok = spec(defaults=body(3, weight=tq(3, bits=8), input=tq(3, bits=8), bias=tq(4, bits=32)))
    assert resolve(resnet, ok).layer("fc").recipe("bias").bits == 32
    assert only(check_spec(spec(defaults=body(3, bias=tq(4, bits=33)))), "E210")


def test_conflicting_fields_from_different_sources_are_caught_after_the_cascade(resnet):
    # each source is fine alone; together on fc they ask for a dynamic learned scale
    s = spec(defaults=body(3, input=tq(3, dynamic=True)), rules=[rule(6, "fc", input=tq(6, scale="learned"))])
    assert check_spec(s) == []
    with pytest.raises(SpecError) as exc:
        resolve(resnet, s)
    d = only(exc.value.diagnostics, "E213")
    assert d.span.line == 3  # the dynamic = true in the defaults
    assert any("fc" in n for n in d.notes)


def test_derived_bias_needs_quantized_input_and_weight(resnet):
    s = spec(defaults=body(3, weight=tq(3, bits=8), bias=tq(4, scale="input*weight")))
    with pytest.raises(SpecError) as exc:
        resolve(resnet, s)
    d = only(exc.value.diagnostics, "E214")
    assert "input" in d.message and d.span == sp(4, 10)


def test_channel_axis_out_of_range_names_layer_and_shape(resnet):
    s = spec(rules=[rule(5, "layer1.0.conv1", weight=tq(5, granularity=Granularity(GranularityKind.CHANNEL, 4)))])
    with pytest.raises(SpecError) as exc:
        resolve(resnet, s)
    d = only(exc.value.diagnostics, "E216")
    assert "Conv2d" in d.message and "(16, 16, 3, 3)" in d.message and d.span == sp(5, 10)
    assert d.notes == ("on layer layer1.0.conv1",)
    neg = spec(rules=[rule(5, "layer1.0.conv1", weight=tq(5, granularity=Granularity(GranularityKind.CHANNEL, -1)))])
    assert resolve(resnet, neg).layer("layer1.0.conv1").recipe("weight").granularity.axis == -1


def test_group_size_must_divide_the_reduction_size(resnet, conv1d):
    # fc: 32 inputs; layer1.*.conv1: 16*3*3 = 144
    assert resolve(resnet, spec(rules=[rule(5, "fc", weight=tq(5, granularity=group(8)))]))
    assert resolve(resnet, spec(rules=[rule(5, "layer1.0.conv1", weight=tq(5, granularity=group(48)))]))
    with pytest.raises(SpecError) as exc:
        resolve(resnet, spec(rules=[rule(5, "type:Conv2d", "fc", weight=tq(5, granularity=group(32)))]))
    # one diagnostic per distinct reduction size, listing the layers that have it
    (d,) = [d for d in exc.value.diagnostics if "144 (= 16 x 3 x 3)" in d.message]
    assert d.code == "E217" and "weight of Conv2d layers" in d.message
    assert d.notes == ("on layers layer1.0.conv1, layer1.0.conv2, layer1.1.conv1, layer1.1.conv2 and 1 more",)
    assert "48" in d.hints[0]  # sizes that fit
    assert d.span == sp(5, 10)
    assert not any("Linear" in d.message for d in exc.value.diagnostics)  # fc: 32 % 32 == 0
    # Conv1d rows are in_channels * kernel: features.3 is 16 * 3 = 48
    with pytest.raises(SpecError, match="48 \\(= 16 x 3\\)"):
        resolve(conv1d, spec(rules=[rule(5, "features.3", weight=tq(5, granularity=group(32)))]))


def test_validate_recipe_direct():
    r = QuantizerRecipe(Kind.BINARY, 4, True, False, True, "float", Granularity(), ObserverSpec("mean_abs"),
                        "half_even", False)
    diags = validate_recipe(r, "weight", {"bits": sp(3, 5)})
    assert [d.code for d in diags] == ["E211"] and diags[0].span == sp(3, 5)
    good = QuantizerRecipe(Kind.INT, 8, True, False, True, "float", Granularity(), ObserverSpec("minmax"),
                           "half_even", False)
    assert validate_recipe(good, Role.INPUT) == []
    assert [d.code for d in validate_recipe(good, Role.BIAS, {})] == []


def test_bad_preset_is_reported_once_however_often_used():
    presets = {"bad": tq(2, observer=ObserverSpec("minmaxx"))}
    s = spec(presets=presets, defaults=body(5, weight=tq(5, extends="bad"), input=tq(6, extends="bad")),
             rules=[rule(8, "fc", output=tq(8, extends="bad"))])
    assert [d.code for d in check_spec(s)] == ["E204"]


def test_malformed_targets_and_rule_shapes():
    s = spec(rules=[
        rule(3, "re:layer(", weight=tq(3, bits=4)),
        rule(4, "layer[1.*", weight=tq(4, bits=4)),
        rule(5, "type:", weight=tq(5, bits=4)),
        rule(6, "fc"),
        rule(7, "fc", skip=True, weight=tq(7, bits=4)),
    ])
    diags = check_spec(s)
    assert [d.code for d in diags] == ["E218", "E218", "E218", "E222", "E223"]
    assert diags[0].span.line == 3 and "re:layer(" in diags[0].message
    assert "unterminated" in diags[1].message


def test_clean_spec_has_no_diagnostics():
    s = spec(presets={"w": tq(2, bits=4, granularity=CH)}, defaults=body(4, weight=tq(4, extends="w")),
             rules=[rule(6, "type:Conv2d", weight=tq(6, granularity=group(16)))])
    assert check_spec(s) == []

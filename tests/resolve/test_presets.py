"""Preset chains (``extends``): expansion, provenance ``via``/shadowing, unknown names, cycles."""

import pytest

from qdsl.resolve import check_spec, resolve
from qdsl.resolve.presets import PresetTable
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.model import Kind, ObserverSpec, Role
from resolve_specs import body, rule, spec, tq

CHAIN = {
    "base": tq(2, kind=Kind.INT, bits=8, scale="float", observer=ObserverSpec("minmax")),
    "w4": tq(3, extends="base", bits=4, scale="pot"),
    "w4mse": tq(4, extends="w4", observer=ObserverSpec("mse")),
}


def test_chain_expands_with_nearest_field_winning():
    fields, diags = PresetTable(CHAIN).expand(tq(9, extends="w4mse", bits=6))
    assert diags == []
    values = {f: c.value for f, c in fields.items()}
    assert values == {"kind": Kind.INT, "bits": 6, "scale": "pot", "observer": ObserverSpec("mse")}
    # kind travelled w4mse -> w4 -> base, written in base (line 2)
    assert [o.label for o in fields["kind"].via] == ["w4mse", "w4", "base"]
    assert fields["kind"].span.line == 2
    # bits is the use site's own; it shadowed w4's 4, which shadowed base's 8
    assert fields["bits"].via == ()
    assert [(o.label, v) for o, v in fields["bits"].shadowed] == [("w4", 4), ("base", 8)]


def test_rule_via_preset_provenance_on_a_model(resnet):
    s = spec(presets=CHAIN,
             defaults=body(10, weight=tq(10, extends="w4")),
             rules=[rule(12, "type:Conv2d", weight=tq(12, extends="w4mse", scale="learned_pot"))])
    lp = resolve(resnet, s).layer("layer1.0.conv1")
    w = lp.recipe("weight")
    assert (w.bits, w.scale, w.observer.name) == (4, "learned_pot", "mse")
    scale = lp.provenance[(Role.WEIGHT, "scale")]
    assert scale.set_by.label == "rule type:Conv2d" and scale.via == ()
    # the rule's own value shadowed its preset chain's, then the defaults' chain
    assert [(o.label, v) for o, v in scale.overridden] == [("w4", "pot"), ("base", "float"), ("defaults via w4", "pot")]
    bits = lp.provenance[(Role.WEIGHT, "bits")]
    assert bits.set_by.span.line == 12  # "set by" points at the rule's use of the preset
    assert [o.label for o in bits.via] == ["w4mse", "w4"]


def test_unknown_preset_is_located_at_the_use_with_suggestion(resnet):
    s = spec(presets=CHAIN, defaults=body(10, weight=tq(10, extends="w4mze")))
    (d,) = check_spec(s)
    assert d.code == "E207" and "w4mze" in d.message
    assert (d.span.line, d.span.col) == (10, 10)
    assert "did you mean 'w4mse'" in d.hints[0]
    with pytest.raises(SpecError, match="E207"):
        resolve(resnet, s)


def test_cycle_is_reported_once_with_the_chain():
    presets = {
        "a": tq(2, extends="b", bits=4),
        "b": tq(3, extends="c"),
        "c": tq(4, extends="a"),
        "ok": tq(5, bits=8),
    }
    s = spec(presets=presets, defaults=body(9, weight=tq(9, extends="a")),
             rules=[rule(11, "fc", weight=tq(11, extends="c"))])
    diags = check_spec(s)
    assert [d.code for d in diags] == ["E208"]
    d = diags[0]
    assert " -> ".join(["a", "b", "c", "a"]) in d.message
    assert len(d.notes) == 3 and "'c' extends 'a' at m.qspec:4:10" in d.notes[2]


def test_self_cycle():
    diags = check_spec(spec(presets={"x": tq(2, extends="x", bits=4)}))
    assert [d.code for d in diags] == ["E208"] and "x -> x" in diags[0].message


def test_cycle_does_not_hide_other_errors(resnet):
    presets = {"a": tq(2, extends="a"), "b": tq(3, bits=99)}
    s = spec(presets=presets, defaults=body(9, weight=tq(9, extends="a"), input=tq(10, extends="b")))
    with pytest.raises(SpecError) as exc:
        resolve(resnet, s)
    assert set(exc.value.codes) == {"E208", "E210"}

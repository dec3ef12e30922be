"""Every shipped spec in ``specs/`` resolves against every reference model it targets.

The examples are written for the ``qdsl.zoo.models`` networks (their model-specific
rules are ``optional``), so each must resolve cleanly on all of them, and the DSL and
TOML forms of one example must give the same plan, provenance values included.
"""

from pathlib import Path

import pytest

from qdsl.parse import load_spec
from qdsl.resolve import check_spec, resolve
from qdsl.spec.model import Kind, Overflow, Role

SPECS = Path(__file__).resolve().parents[2] / "specs"
EXAMPLES = sorted(p.name[: -len(".qspec")] for p in SPECS.glob("*.qspec"))
MODELS = ["resnet", "conv1d", "cbr", "mlp_model"]


def test_examples_exist():
    assert {"int8-default", "w4a8-per-channel", "pot-asic", "xnor-binary", "mixed-precision"} <= set(EXAMPLES)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_resolves_identically_from_both_forms(name, model, request):
    net = request.getfixturevalue(model)
    dsl, toml = load_spec(SPECS / f"{name}.qspec"), load_spec(SPECS / f"{name}.qspec.toml")
    assert check_spec(dsl) == [] and check_spec(toml) == []
    a, b = resolve(net, dsl), resolve(net, toml)
    assert a.layers == b.layers
    for la, lb in zip(a.layers, b.layers):
        assert {k: p.value for k, p in la.provenance.items()} == {k: p.value for k, p in lb.provenance.items()}
        assert {k: p.set_by.label for k, p in la.provenance.items()} == {
            k: p.set_by.label for k, p in lb.provenance.items()}
    # every weighted layer is quantized, with an explicit recipe for each of its weights
    weighted = [lp for lp in a.layers if lp.type_name in ("Conv1d", "Conv2d", "Linear")]
    assert weighted and all(lp.recipe("weight") is not None for lp in weighted)


def weight_bits(plan):
    return {lp.fqn: lp.recipe("weight").bits for lp in plan.layers if lp.recipe("weight") is not None}


def test_mixed_precision_on_resnet(resnet):
    plan = resolve(resnet, SPECS / "mixed-precision.qspec")
    bits = weight_bits(plan)
    assert bits["stem.0"] == 8 and bits["fc"] == 8
    assert bits["layer1.0.conv1"] == 4 and bits["layer2.1.conv1"] == 4
    assert bits["layer2.0.conv2"] == 3 and bits["layer2.1.conv2"] == 3  # priority 1 beats the stage glob
    assert bits["layer2.0.downsample.0"] == 8
    prov = plan.layer("layer2.1.conv2").provenance[(Role.WEIGHT, "bits")]
    assert prov.set_by.label == "rule stage2_conv2"
    assert prov.overridden[0][0].label == "rule stage_convs"


def test_mixed_precision_on_conv1d(conv1d):
    bits = weight_bits(resolve(conv1d, SPECS / "mixed-precision.qspec"))
    assert bits == {"features.0": 8, "features.3": 4, "features.6": 4, "classifier": 8}


def test_xnor_binary_keeps_first_and_last_layers_int8(resnet):
    plan = resolve(resnet, SPECS / "xnor-binary.qspec")
    for fqn in ("stem.0", "fc"):
        w = plan.layer(fqn).recipe("weight")
        assert (w.kind, w.bits) == (Kind.INT, 8)
    w = plan.layer("layer1.0.conv1").recipe("weight")
    assert (w.kind, w.bits, w.observer.name, w.granularity.axis) == (Kind.BINARY, 1, "mean_abs", 0)
    assert plan.layer("layer1.0").recipe("output").bits == 8  # residual adds stay 8-bit


def test_pot_asic_is_all_power_of_two(cbr):
    plan = resolve(cbr, SPECS / "pot-asic.qspec")
    for lp in plan.layers:
        assert lp.accumulator.overflow is Overflow.SATURATE
        for role, r in lp.roles.items():
            if r is not None and role is not Role.BIAS:
                assert r.scale == "pot" and r.symmetric
    bias = plan.layer("classifier").recipe("bias")
    assert (bias.bits, bias.scale) == (32, "input*weight")


def test_overrides_through_resolve(resnet):
    plan = resolve(resnet, SPECS / "w4a8-per-channel.qspec", overrides=["weight.bits=6"])
    assert set(weight_bits(plan).values()) == {6}
    plan = resolve(resnet, load_spec(SPECS / "w4a8-per-channel.qspec"), overrides={"input.bits": 7})
    assert plan.layer("fc").recipe("input").bits == 7

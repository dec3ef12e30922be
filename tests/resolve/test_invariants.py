"""The derived-bias-scale rule is written once (qdsl/resolve/invariants.py); resolve (E214),
apply (E504) and lint (E316) all ask it."""

import pathlib

import attrs
import pytest

import qdsl
from qdsl.parse import parse_text
from qdsl.resolve.invariants import bias_scale_problem, plan_problems
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.model import GranularityKind, Role
from qdsl.zoo.models import mlp

SPEC = """
version 1
defaults {
  weight = int(bits=8, per_channel)
  input = int(bits=8)
  bias = int(bits=32, scale=input*weight)
}
"""


def _plan(model):
    return qdsl.resolve.resolve(model, parse_text(SPEC, "t.qspec"))


def _drop(plan, fqn, role):
    layers = [attrs.evolve(lp, roles={r: q for r, q in lp.roles.items() if r is not role}) if lp.fqn == fqn else lp
              for lp in plan.layers]
    return attrs.evolve(plan, layers=layers)


def test_a_sound_plan_has_no_problem():
    assert plan_problems(_plan(mlp())) == {}


@pytest.mark.parametrize("role", [Role.INPUT, Role.WEIGHT])
def test_a_missing_role_is_named(role):
    plan = _drop(_plan(mlp()), "net.3", role)
    problems = plan_problems(plan)
    assert set(problems) == {"net.3"}
    assert problems["net.3"].missing == (role.value,)
    assert problems["net.3"].reason == "its input and its weight must both be quantized"


def test_a_per_channel_input_cannot_form_the_scale():
    plan = _plan(mlp())
    lp = plan.layers[1]
    iq = lp.roles[Role.INPUT]
    bad = attrs.evolve(iq, granularity=attrs.evolve(iq.granularity, kind=GranularityKind.CHANNEL, axis=1))
    problem = bias_scale_problem({**lp.roles, Role.INPUT: bad})
    assert problem.missing == () and "one scale" in problem.reason
    # a bias with its own scale, or none, has nothing to check
    assert bias_scale_problem({Role.INPUT: bad}) is None


def test_apply_reports_the_same_reason_as_e504():
    model = mlp()
    plan = _drop(_plan(model), "net.3", Role.INPUT)
    with pytest.raises(SpecError) as e:
        qdsl.apply(model, plan)
    assert e.value.codes == ["E504"]
    assert plan_problems(plan)["net.3"].reason in str(e.value)


def test_the_rule_has_one_caller_of_its_core():
    # derived_bias_problem (the clause) is only asked through invariants.bias_scale_problem
    root = pathlib.Path(qdsl.__file__).parent
    callers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if "derived_bias_problem(" in p.read_text() and p.name != "validate.py")
    assert callers == ["resolve/invariants.py"]


def test_a_transposed_conv_weight_is_per_channel_along_axis_1():
    # ConvTranspose weights are in × out/groups × k: channel granularity without an axis is
    # the output channels (axis 1), and that is the axis the derived bias scale needs
    from torch import nn

    model = nn.Sequential(nn.ConvTranspose2d(4, 6, 2, stride=2), nn.ConvTranspose1d(6, 2, 3))
    plan = _plan(model)
    for fqn in ("0", "1"):
        g = plan.layer(fqn).roles[Role.WEIGHT].granularity
        assert (g.kind, g.axis) == (GranularityKind.CHANNEL, 1)
    assert plan_problems(plan) == {}
    with pytest.raises(SpecError, match=r"E214.*output channels \(axis 1\)"):
        qdsl.resolve.resolve(model, parse_text(SPEC.replace("per_channel", "granularity=channel(0)"), "t.qspec"))

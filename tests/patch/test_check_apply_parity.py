"""Property: a spec that checks clean applies; a spec that cannot apply fails at check, located.

Random ``.qspec`` texts cover every quantizer field (kind int/binary/ternary/pot, bits
0..17, signed, narrow, symmetric, the scale rules, tensor/channel/group granularity with
group sizes that do and do not divide the reduction size, every observer with good and
bad parameters, roundings, dynamic) on every role, bias forms (derived int32, its own
quantizer, float), ``fold_bn`` and type rules on top of the defaults.

"check" is what ``qdsl check --model`` runs: parse, then resolve against the model.
When it raises, every error must be a located E0xx/E1xx/E2xx diagnostic.  When it
passes, apply + forward + calibrate + freeze + forward must succeed; the one refusal
left to run time is a channel axis beyond a (non-conv) activation's rank, which only
the data reveals, and that is a located E507 ``SpecError``.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import qdsl
from qdsl.parse import parse_text
from qdsl.resolve import resolve
from qdsl.spec.diagnostics import SpecError

KINDS = ["int", "binary", "ternary", "pot"]
SCALES = ["float", "pot", "pot_ceil", "learned", "learned_pot"]
# the model's reduction sizes: conv 3*3*3 = 27, linear 6*4*4 = 96; 3 divides both, 4 and 27 one
GRANULARITIES = ["tensor", "channel", "channel(1)", "channel(-1)", "channel(5)",
                 "group(3)", "group(4)", "group(27)", "group(5)"]
OBSERVERS = ["minmax", "ema", "ema(momentum=0.5)", "ema(momentum=0)", "histogram", "histogram(bins=16)",
             "histogram(percentile=99)", "histogram(percentile=inf)", "histogram(percentile=0)",
             "histogram(percentile='x')", "percentile(percentile=50)", "percentile(percentile=101)",
             "mse", "mse(grid=3, norm=1)", "mse(grid=0)", "auto", "mean_abs", "minmax(bins=3)"]
ROUNDINGS = ["half_even", "half_away", "floor", "stochastic"]


@st.composite
def quantizer(draw) -> str:
    kind = draw(st.sampled_from(KINDS))
    args = [f"kind={kind}"]
    # mostly widths that fit the kind, sometimes any (incl. out of range)
    if draw(st.booleans()):
        fits = {"int": st.sampled_from([1, 2, 3, 4, 8, 16]), "binary": st.just(1),
                "ternary": st.just(2), "pot": st.integers(2, 8)}[kind]
        args.append(f"bits={draw(st.one_of(fits, st.integers(0, 17)))}")
    for flags in (["signed", "unsigned"], ["narrow"], ["symmetric", "asymmetric"], ["dynamic"]):
        if draw(st.integers(0, 3)) == 0:
            args.append(draw(st.sampled_from(flags)))
    for field, choices in (("scale", SCALES), ("granularity", GRANULARITIES),
                           ("observer", OBSERVERS), ("rounding", ROUNDINGS)):
        if draw(st.integers(0, 2)) == 0:
            args.append(f"{field}={draw(st.sampled_from(choices))}")
    return "(" + ", ".join(args) + ")"


@st.composite
def spec_text(draw) -> str:
    body = [f"weight = {draw(quantizer())}", f"input = {draw(quantizer())}"]
    if draw(st.integers(0, 3)) == 0:
        body.append(f"output = {draw(quantizer())}")
    bias = draw(st.sampled_from(["none", "derived", "own", "float"]))
    if bias == "derived":
        body.append("bias = int(bits=32, scale=input*weight)")
    elif bias == "own":
        body.append(f"bias = {draw(quantizer())}")
    elif bias == "float":
        body.append("bias = float")
    lines = ["version 1"]
    if draw(st.booleans()):
        lines.append("fold_bn")
    lines.append("defaults {\n  " + "\n  ".join(body) + "\n}")
    if draw(st.integers(0, 2)) == 0:
        role = draw(st.sampled_from(["weight", "input"]))
        lines.append(f"rule type:{draw(st.sampled_from(['Conv2d', 'Linear']))} {{ {role} = {draw(quantizer())} }}")
    return "\n".join(lines) + "\n"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(),
                         nn.Linear(6 * 4 * 4, 5))


def _located(err: SpecError) -> None:
    errors = [d for d in err.diagnostics if d.is_error]
    assert errors
    for d in errors:
        assert re.fullmatch(r"E[012]\d\d", d.code), d.render()
        assert d.span.known, d.render()  # file:line:col, so the caret can be shown
        assert "not supported between" not in d.message and "object has no attribute" not in d.message, d.render()


def check_then_apply(text: str) -> str:
    """``"check"`` when check refuses ``text`` (asserting the errors are located), ``"runtime"``
    for a located E507 at the first forward, ``"ok"`` when it applies, calibrates and freezes
    cleanly; anything else raises."""
    model = _model()
    try:
        plan = resolve(model, parse_text(text, "parity.qspec"))
    except SpecError as err:
        _located(err)
        return "check"
    x = torch.randn(4, 3, 4, 4)
    qdsl.apply(model, plan)
    try:
        model(x)
    except SpecError as err:
        # the one data-dependent refusal: an activation's rank is only known when it flows
        # (resolve checks weights and convolution activations), still located at the spec
        assert err.codes == ["E507"], err.render()
        assert err.diagnostics[0].span.known, err.render()
        return "runtime"
    qdsl.calibrate(model, [x, x])
    qdsl.freeze(model)
    with torch.no_grad():
        y = model(x)
    assert y.shape == (4, 5)
    return "ok"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_text())
def test_clean_check_means_apply_works(text):
    event(check_then_apply(text))


# Each of these checked clean and then failed inside apply/calibrate/freeze with a bare
# Python exception before the checks below existed.
@pytest.mark.parametrize("quant, code", [
    ("int(bits=1)", "E210"),                      # signed 1 bit: codes -1..0, "qmax must be > 0"
    ("int(bits=1, unsigned, narrow)", "E210"),    # one code: "empty integer grid"
    ("int(bits=1, signed, narrow)", "E210"),
])
@pytest.mark.parametrize("role", ["weight", "input"])
def test_one_bit_int_grids_fail_at_check(quant, code, role):
    other = "input" if role == "weight" else "weight"
    text = f"version 1\nquantizer q = {quant}\ndefaults {{ {other} = int(bits=8)\n {role} = q }}\n"
    assert check_then_apply(text) == "check"
    with pytest.raises(SpecError) as info:
        resolve(_model(), parse_text(text, "p.qspec"))
    assert code in info.value.codes
    d = next(d for d in info.value.diagnostics if d.code == code)
    assert d.span.line == 2  # at the preset's bits
    # without a model too: `qdsl check` alone catches it
    from qdsl.resolve import check_spec
    assert code in [d.code for d in check_spec(parse_text(text, "p.qspec"))]


def test_one_bit_unsigned_int_applies():
    assert check_then_apply("version 1\ndefaults { weight = int(bits=1, unsigned)\n input = int(bits=8) }\n") == "ok"


@pytest.mark.parametrize("weight, inp, code", [
    ("int(dynamic)", "int", "E219"),                  # derived bias over a dynamic weight: IndexError
    ("int", "int(granularity=channel)", "E214"),      # apply-time E504 before
    ("int(granularity=group(3))", "int", "E214"),
    ("int(granularity=channel(1))", "int", "E214"),
])
def test_derived_bias_problems_fail_at_check(weight, inp, code):
    text = (f"version 1\ndefaults {{\n weight = {weight}\n input = {inp}\n"
            " bias = int(bits=32, scale=input*weight)\n}\n")
    with pytest.raises(SpecError) as info:
        resolve(_model(), parse_text(text, "b.qspec"))
    assert code in info.value.codes
    _located(info.value)


def test_activation_channel_axis_beyond_rank():
    # a conv's activations have its weight's rank: refused at check
    conv = "version 1\ndefaults { weight = int\n input = int(granularity=channel(5)) }\n"
    assert check_then_apply(conv) == "check"
    # a Linear's input rank is only known at run time: a located E507 there, not an IndexError
    lin = ("version 1\ndefaults { weight = int\n input = int }\n"
           "rule type:Linear { input = int(granularity=channel(5)) }\n")
    assert check_then_apply(lin) == "runtime"


@pytest.mark.parametrize("obs, code, says", [
    ("histogram(percentile='x')", "E206", "parameter 'percentile' of histogram must be a number, got 'x'"),
    ("histogram(percentile=true)", "E206", "must be a number, got True"),
    ("histogram(percentile=inf)", "E104", "observer parameter percentile must be finite"),  # DSL: a name
    ("ema(momentum=nan)", "E104", "must be finite"),
])
def test_observer_parameter_types_are_plain_located_errors(obs, code, says):
    # before: E206 "bad parameters for histogram: '<' not supported between instances of 'float' and 'str'"
    text = f"version 1\ndefaults {{ weight = int\n input = int(observer={obs}) }}\n"
    with pytest.raises(SpecError) as info:
        resolve(_model(), parse_text(text, "o.qspec"))
    assert info.value.codes == [code]
    d = info.value.diagnostics[0]
    assert says in d.message and d.span.line == 3

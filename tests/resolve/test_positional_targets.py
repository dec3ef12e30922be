"""Positional targets ``@first`` / ``@last`` (qdsl/resolve/positions.py): which module they
name, by which order, their cascade level, and the errors around them."""

from __future__ import annotations

import pytest
from torch import nn

from qdsl.parse import parse_text
from qdsl.parse.format import format_spec
from qdsl.resolve import explain, resolve
from qdsl.resolve.explain import positional_targets
from qdsl.resolve.plan import ModelIndex, ModuleEntry
from qdsl.resolve.positions import positions
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.model import Kind, TargetKind
from qdsl.zoo.resnet import resnet18

HEAD = """
version 1
quantizer w8 = int(bits=8, signed, symmetric)
quantizer w4 = int(bits=4, signed, symmetric)
defaults { weight = w4 }
"""


def _bits(plan, fqn):
    return plan.layer(fqn).recipe("weight").bits


def test_resnet18_first_and_last():
    spec = parse_text(HEAD + "rule @first, @last { weight = w8 }")
    plan = resolve(resnet18(width=8, num_classes=10), spec)
    eight = sorted(lp.fqn for lp in plan.layers if lp.recipe("weight") is not None and lp.recipe("weight").bits == 8)
    assert eight == ["conv1", "fc"]
    assert positional_targets(plan) == {"order": "forward execution", "note": "",
                                        "targets": {"first": {"module": "conv1"}, "last": {"module": "fc"}}}
    assert "@first = conv1, @last = fc" in explain(plan)


class _Backwards(nn.Module):
    """Registers the head before the stem: registration order is the reverse of execution."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.mid = nn.Linear(8, 8)
        self.stem = nn.Conv1d(2, 8, 3)

    def forward(self, x):
        x = self.stem(x).mean(-1)
        return self.head(self.mid(x))


class _Untraceable(_Backwards):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
            x = -x
        return super().forward(x)


def test_execution_order_not_registration_order():
    plan = resolve(_Backwards(), parse_text(HEAD + "rule @first { weight = w8 }\nrule @last { weight = int(bits=6) }"))
    assert (_bits(plan, "stem"), _bits(plan, "mid"), _bits(plan, "head")) == (8, 4, 6)


def test_untraceable_model_falls_back_to_registration_order_and_says_so():
    plan = resolve(_Untraceable(), parse_text(HEAD + "rule @first { weight = w8 }"))
    assert (_bits(plan, "head"), _bits(plan, "stem")) == (8, 4)
    pos = positional_targets(plan)
    assert pos["order"] == "registration" and "cannot trace _Untraceable" in pos["note"]
    assert "note: torch.fx cannot trace _Untraceable" in explain(plan)


def test_index_without_calls_uses_registration_order():
    index = ModelIndex([ModuleEntry("", "Net", leaf=False), ModuleEntry("a", "Conv2d", {"weight": (4, 3, 3, 3)}),
                        ModuleEntry("act", "ReLU"), ModuleEntry("b", "Linear", {"weight": (2, 4)})])
    pos = positions(index)
    assert (pos.first, pos.last, pos.traced) == ("a", "b", False)
    called = ModelIndex(index.entries, calls=("", "b", "act", "a"))
    assert (positions(called).first, positions(called).last, positions(called).traced) == ("b", "a", True)


def test_one_weighted_layer_is_both():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    plan = resolve(model, parse_text(HEAD + "rule @first { weight = w8 }\nrule @last { input = int(bits=8) }"))
    lp = plan.layer("1")
    assert lp.recipe("weight").bits == 8 and lp.recipe("input").bits == 8
    # one module named by both at the same (exact-name) level: a conflicting field needs a priority
    with pytest.raises(SpecError) as err:
        resolve(model, parse_text(HEAD + "rule @first { weight = w8 }\nrule @last { weight = int(bits=6) }"))
    assert err.value.diagnostics[0].code == "E209"


def test_positional_is_exact_name_level():
    spec = parse_text(HEAD + "rule type:Linear, f? { weight = int(bits=6) }\nrule @last { weight = w8 }")
    assert _bits(resolve(resnet18(width=8, num_classes=10), spec), "fc") == 8
    with pytest.raises(SpecError) as err:  # an exact name and @last on one layer tie
        resolve(resnet18(width=8, num_classes=10), parse_text(HEAD + "rule fc { weight = int(bits=6) }\nrule @last { weight = w8 }"))
    assert [d.code for d in err.value.diagnostics] == ["E209"]


def test_no_weighted_layer():
    model = nn.Sequential(nn.ReLU(), nn.Flatten())
    with pytest.raises(SpecError) as err:
        resolve(model, parse_text(HEAD + "rule @first { input = int(bits=8) }"))
    (d,) = err.value.diagnostics
    assert d.code == "E201" and "'@first'" in d.message and "no weighted layer" in " ".join(d.hints)
    plan = resolve(model, parse_text(HEAD + "rule @first, @last optional { input = int(bits=8) }"))
    assert plan.layers == () or all(lp.recipe("input") is None for lp in plan.layers)
    assert positional_targets(plan)["targets"] == {"first": {"module": None}, "last": {"module": None}}


@pytest.mark.parametrize("text,fmt", [("rule @frist { weight = w8 }", "qspec"),
                                      ('[[rules]]\ntarget = "@frist"\nweight = "w8"', "toml")])
def test_misspelled_position_is_located(text, fmt):
    src = (HEAD + text) if fmt == "qspec" else 'version = 1\n[quantizers.w8]\nkind = "int"\n' + text
    with pytest.raises(SpecError) as err:
        parse_text(src, "m." + fmt, fmt=fmt)
    (d,) = err.value.diagnostics
    assert d.code == "E108" and "'@frist'" in d.message and d.span.line == src.count("\n", 0, src.index("@frist")) + 1
    assert "did you mean '@first'?" in " ".join(d.hints)


def test_format_round_trip():
    spec = parse_text(HEAD + "rule @first, @last optional as ends { weight = w8 }")
    assert [t.kind for t in spec.rules[0].targets] == [TargetKind.POSITION] * 2
    dsl = format_spec(spec, "qspec")
    assert "rule @first, @last optional" in dsl
    assert parse_text(dsl) == spec
    assert parse_text(format_spec(spec, "toml"), fmt="toml") == spec


def test_bundled_xnor_binary_on_a_bare_layer():
    plan = resolve(nn.Conv2d(3, 4, 3), "specs/xnor-binary.qspec")
    # a bare-layer model: the root is the one weighted layer, both @first and @last
    assert (plan.layer("").recipe("weight").kind, plan.layer("").recipe("weight").bits) == (Kind.INT, 8)
    assert positional_targets(plan)["order"] == "forward execution"

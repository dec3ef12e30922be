"""threshold = learned through the cascade: shadowed by a more specific kind, E220 otherwise."""

from __future__ import annotations

import pytest
from torch import nn

from qdsl.parse import parse_text
from qdsl.resolve import resolve
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.model import Role

_SPEC = """version 1
quantizer abin = binary(signed, per_tensor, observer=mean_abs, threshold=learned)
defaults {
  weight = binary(signed, per_channel)
  input = abin
}
rule 0 { input = int(bits=8, observer=minmax) }
"""


def _model():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))


def test_a_more_specific_kind_drops_the_default_threshold():
    plan = resolve(_model(), parse_text(_SPEC, "m.qspec"))
    first, second = plan.layer("0"), plan.layer("2")
    assert first.recipe(Role.INPUT).threshold == "none"
    assert second.recipe(Role.INPUT).threshold == "learned"
    prov = first.provenance[(Role.INPUT, "threshold")]
    assert "takes no threshold" in prov.set_by.label and prov.overridden[0][1] == "learned"


@pytest.mark.parametrize("body, message", [
    ("input = abin(unsigned)", "not unsigned"),
    ("input = ternary(extends=abin)", "not ternary"),
    ("weight = abin", "not the weight"),
])
def test_same_source_conflicts_are_located_errors(body, message):
    text = _SPEC.replace("rule 0 { input = int(bits=8, observer=minmax) }", f"rule 0 {{ {body} }}")
    with pytest.raises(SpecError) as info:
        resolve(_model(), parse_text(text, "m.qspec"))
    d = next(d for d in info.value.diagnostics if d.code == "E220")
    assert message in d.message and d.span.line >= 2 and "^" in d.render()

"""Registries of parts: user parts by name in a spec, duplicates, unknown names, isolation."""

import attrs
import pytest
import torch

import qdsl
from qdsl.parse import parse_text
from qdsl.quantizers import Observer, default_registries
from qdsl.quantizers.parts import resolve_factory
from qdsl.spec.diagnostics import QdslError, SpecError
from qdsl.spec.registry import PartInfo
from qdsl.zoo.models import mlp


@attrs.frozen
class ClipParams:
    fraction: float = attrs.field(default=0.5, converter=float)


def _custom_registries():
    regs = default_registries()

    @regs.observers.register("half_range", params=ClipParams, needs_calibration=True)
    class HalfRange(Observer):
        """±fraction · max|x| per slot (a deliberately odd observer, easy to check)."""

        _state = ("amax",)

        def forward(self, x):
            rows, shape = self._rows(x)
            a = rows.abs().amax(dim=1).reshape(shape)
            self.amax = torch.maximum(a, self.amax) if self.observed else a

        def range(self):
            a = self.amax * self.params.fraction
            return -a, a

    @regs.roundings.register("toward_zero")
    def toward_zero(x, generator=None):
        return torch.trunc(x)

    return regs


SPEC = """
version 1
defaults {
  weight = int(bits=8, signed, per_channel, observer=half_range(fraction=0.25), rounding=toward_zero)
}
"""


def test_user_parts_are_used_by_name_in_a_spec():
    regs = _custom_registries()
    model = mlp()
    w = model.net[1].weight.detach().clone()
    handle = qdsl.apply(model, parse_text(SPEC, "user.qspec"), registries=regs)
    q = handle.quantizer("net.1", "weight")
    assert type(q.observer).__name__ == "HalfRange" and q.observer.params == ClipParams(0.25)
    qdsl.freeze(model)
    expect_scale = w.abs().amax(dim=1) * 0.25 / 127
    assert torch.allclose(q.scale, expect_scale, rtol=1e-6)
    codes = q.int_repr(w)
    assert torch.equal(codes.float(), torch.trunc(w / expect_scale[:, None]).clamp(-128, 127))


def test_user_part_params_are_validated_at_resolve():
    regs = _custom_registries()
    bad = SPEC.replace("fraction=0.25", "fractoin=0.25")
    with pytest.raises(SpecError) as e:
        qdsl.apply(mlp(), parse_text(bad, "user.qspec"), registries=regs)
    assert "fractoin" in str(e.value) and "fraction" in str(e.value)


def test_unknown_part_in_a_spec_lists_what_exists():
    with pytest.raises(SpecError) as e:
        qdsl.apply(mlp(), parse_text(SPEC, "user.qspec"))  # default registries: no half_range
    text = str(e.value)
    assert "unknown observer 'half_range'" in text and "minmax" in text and "user.qspec:4" in text


def test_duplicates_need_override_and_bundles_are_isolated():
    regs = _custom_registries()
    with pytest.raises(ValueError, match="'half_range' is already registered.*override=True"):
        regs.observers.register("half_range")(object)
    regs.observers.register("half_range", override=True)(object)
    assert "half_range" not in default_registries().observers
    assert "minmax" in default_registries().observers
    with pytest.raises(ValueError, match="snake_case"):
        regs.observers.register("HalfRange")(object)


def test_unloadable_factory_is_a_clear_error():
    regs = default_registries()
    regs.observers.add(PartInfo("ghost", "qdsl.no_such_module:Ghost"))
    with pytest.raises(QdslError, match="observer 'ghost' is implemented by qdsl.no_such_module:Ghost"):
        resolve_factory(regs.observers.get("ghost"), regs.observers)


def test_builtin_factories_all_load():
    regs = default_registries()
    for registry in (regs.observers, regs.roundings, regs.scales):
        for name in registry:
            assert resolve_factory(registry.get(name), registry) is not None

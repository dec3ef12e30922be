"""Number formats as parts (qdsl.spec.formats, qdsl.quantizers.formats).

* the built-in formats answer what the old per-kind branches did (code ranges);
* a format a user registers on a bundle works through apply / calibrate / forward /
  freeze / int_repr without any other qdsl file knowing it;
* a kind nobody registered is a located E204 at resolve time.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qdsl
from qdsl.quantizers.formats import FormatOps
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.formats import BUILTIN_FORMATS, MINIFLOAT_PRESETS, NumberFormat, builtin_format, int_code_range, register_format
from qdsl.spec.model import Kind


class Tri3Format(NumberFormat):
    """A toy 3-level format: codes {-1, 0, +1} = round(x / s) clamped, s = max |x|."""

    name = "tri3"
    default_bits = 2
    default_observer = "minmax"
    fixed_width = True
    accumulator_weight = True

    def code_range(self, bits, signed, narrow):
        return -1, 1

    def bits_requirement(self):
        return "== 2"

    def bits_ok(self, bits):
        return bits == 2


class Tri3Ops(FormatOps):
    def codes(self, q, x, scale, zp, thr):
        s = scale if scale.dim() == 0 else scale.reshape([-1] + [1] * (x.dim() - 1))
        return torch.clamp(torch.round(x / s), -1, 1).to(torch.int8)

    def fake(self, q, x, scale, zp, thr):
        s = scale if scale.dim() == 0 else scale.reshape([-1] + [1] * (x.dim() - 1))
        return self.codes(q, x, scale, zp, thr).to(x.dtype) * s


SPEC = """
version = 1
[defaults]
weight = { kind = "tri3", granularity = "channel" }
input = { kind = "int", bits = 8 }
"""


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def test_user_format_through_apply_calibrate_forward_freeze():
    regs = qdsl.default_registries()
    register_format(regs, Tri3Format(), Tri3Ops)
    model = _model()
    x = torch.randn(16, 6)
    ref = model(x)
    spec = qdsl.parse_spec(SPEC, "toy.qspec.toml")
    handle = qdsl.apply(model, spec, registries=regs)
    wq = handle.plan.layer("0").recipe("weight")
    assert wq.kind == "tri3" and isinstance(wq.format, Tri3Format) and (wq.qmin, wq.qmax) == (-1, 1)
    assert wq.bits == 2 and wq.observer.name == "minmax"  # the format's defaults
    qdsl.calibrate(model, [x[:8], x[8:]])
    out = model(x)
    assert not torch.equal(out, ref)
    # the weight reads as three levels per output channel: {-s_c, 0, +s_c}
    w = model[0].weight.detach()
    scale = w.abs().amax(dim=1)
    for row, s in zip(w, scale):
        assert set(torch.unique(row / s).tolist()) <= {-1.0, 0.0, 1.0}
    qdsl.freeze(model)
    ints = qdsl.int_tensors(model)["0"]
    assert ints.weight_kind == "tri3" and isinstance(ints.weight_format, Tri3Format)
    assert ints.weight.dtype == torch.int8 and set(ints.weight.unique().tolist()) <= {-1, 0, 1}
    assert torch.equal(ints.weight.float() * ints.weight_scale.reshape(-1, 1), model[0].weight.detach())
    assert torch.equal(model(x), out)  # frozen scales equal the stateless ones for a weight
    handle.remove()
    assert torch.equal(model(x), ref)


def test_user_format_trains_with_the_clipping_mask_ste():
    # a format that defines no QAT hooks gets FormatOps' default: x̂ unchanged, gradient
    # g where |x| <= s and 0 where clipped (before: qat_grad_path raised AssertionError)
    from qdsl.quantizers import proxy_grad

    regs = qdsl.default_registries()
    register_format(regs, Tri3Format(), Tri3Ops)
    model = _model()
    spec = qdsl.parse_spec(SPEC.replace('{ kind = "int", bits = 8 }', '{ kind = "tri3" }'), "toy.qspec.toml")
    handle = qdsl.apply(model, spec, registries=regs)
    qdsl.calibrate(model, [torch.randn(16, 6)])
    assert proxy_grad.install(model) > 0
    x = (torch.randn(16, 6, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_()
    g = torch.randn(16, 6, generator=torch.Generator().manual_seed(2))
    qa = handle.quantizer("0", "input")
    s = qa.qparams()[0]
    with torch.no_grad():
        ref = qa(x)
    y = qa(x)
    y.backward(g)
    assert torch.equal(y.detach(), ref)
    mask = x.detach().abs() <= s
    assert 0 < int(mask.sum()) < mask.numel()  # some inputs clipped, some not
    assert torch.equal(x.grad, g * mask)
    qw = handle.quantizer("0", "weight")
    w = (model[0].weight.detach() * 1).requires_grad_()
    with torch.no_grad():
        wref = qw(w)
    yw = qw(w)
    yw.backward(torch.ones_like(w))
    assert torch.equal(yw.detach(), wref)
    assert torch.equal(w.grad, torch.ones_like(w))  # minmax per channel: nothing is clipped


def test_unregistered_kind_is_a_located_error():
    model = _model()
    spec = qdsl.parse_spec(SPEC, "toy.qspec.toml")
    with pytest.raises(SpecError) as info:
        qdsl.apply(model, spec)
    assert "E204" in info.value.codes
    assert "unknown number format 'tri3'" in str(info.value)


def test_near_miss_of_a_builtin_kind_stays_a_parse_error():
    with pytest.raises(SpecError) as info:
        qdsl.parse_spec('version = 1\n[defaults]\nweight = { kind = "itn" }\n', "p.qspec.toml")
    assert info.value.codes == ["E105"]


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("narrow", [True, False])
def test_int_code_range_is_the_quantizers_range(bits, signed, narrow):
    from qdsl.quantizers.functional import qrange

    assert builtin_format(Kind.INT).code_range(bits, signed, narrow) == int_code_range(bits, signed, narrow)
    assert qrange(bits, signed, narrow) == int_code_range(bits, signed, narrow)
    lo, hi = int_code_range(bits, signed, narrow)
    assert hi - lo + 1 == 2**bits - (1 if narrow else 0)


def test_every_builtin_kind_has_a_format_and_only_float_is_unquantized():
    assert set(BUILTIN_FORMATS) == {k.value for k in Kind}
    assert [f.name for f in BUILTIN_FORMATS.values() if not f.quantized] == ["float"]
    regs = qdsl.default_registries()
    # plus the minifloat presets and their family entry (qdsl.spec.formats.MINIFLOAT_PRESETS)
    assert set(regs.formats.names()) == ({k.value for k in Kind} - {"float"}) | set(MINIFLOAT_PRESETS) | {"minifloat"}


def test_user_kind_round_trips_through_both_front_ends():
    from qdsl.parse import format_spec, parse_text

    spec = parse_text(SPEC, "toy.qspec.toml")
    dsl = format_spec(spec, "qspec")
    assert "(kind=tri3, per_channel)" in dsl  # not ``tri3(...)``, which would name a preset
    assert parse_text(dsl, "toy.qspec") == spec
    assert parse_text(format_spec(spec, "toml"), "again.qspec.toml") == spec


def test_lint_capability_reads_a_registered_formats_own_facts():
    from qdsl.lint.capability import check_quantizer
    from qdsl.spec.model import Role
    from qdsl.spec.profile import TensorCaps

    caps = TensorCaps(bits=(8,), zero_point=False)
    known = {"kind": "tri3", "bits": 2, "symmetric": True}
    # tri3's width is fixed (like binary's): a profile's bit list does not apply to it
    assert check_quantizer(known, caps, Role.WEIGHT, fmt=Tri3Format()) == []
    # an int of the same width is a bits violation
    assert [v.code for v in check_quantizer({**known, "kind": "int"}, caps, Role.WEIGHT)] == ["E302"]

"""Includes (merge order, relative paths, cycles, missing files) and overrides."""

import pytest

from qdsl.parse import compose, load_spec, parse_overrides, parse_text
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.model import Kind, Role


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


BASE = """version 1
fold_bn
quantizer w8 = int(bits=8, signed, per_channel)
quantizer a8 = int(bits=8, unsigned)
defaults {
  weight = int(bits=8, signed, per_channel, observer=minmax)
  input = a8
  accumulator(bits=32, overflow=wrap)
}
rule type:Conv2d { weight = w8 }
"""


def test_include_merge_semantics(tmp_path):
    _write(tmp_path, "common/base.qspec", BASE)
    top = _write(tmp_path, "model.qspec.toml", """
version = 1
include = ["common/base.qspec"]
bias_correction = true

[quantizers.a8]
kind = "int"
bits = 7

[defaults]
weight = { bits = 4 }
input = "w8"

[[rules]]
target = "fc"
skip = true
""")
    spec = load_spec(top)
    assert spec.includes == ()
    assert spec.fold_bn is True and spec.bias_correction is True
    # presets: the including file's replace same-named ones whole
    assert spec.quantizers["a8"].bits == 7 and spec.quantizers["a8"].signed is None
    assert spec.quantizers["w8"].bits == 8
    # defaults: fields edit field by field; a preset name replaces the role
    weight = spec.defaults.roles[Role.WEIGHT]
    assert (weight.bits, weight.signed, weight.observer.name) == (4, True, "minmax")
    assert weight.span_of("bits").file.endswith("model.qspec.toml")
    assert weight.span_of("observer").file.endswith("base.qspec")
    assert spec.defaults.roles[Role.INPUT].extends == "w8"
    assert spec.defaults.accumulator.bits == 32
    # rules: included first
    assert [r.describe() for r in spec.rules] == ["rule type:Conv2d", "rule fc"]


def test_includes_merge_left_to_right(tmp_path):
    _write(tmp_path, "a.qspec", "version 1\nquantizer q = int(bits=2)\nrule a { skip }\n")
    _write(tmp_path, "b.qspec", "version 1\nquantizer q = int(bits=3)\nrule b { skip }\n")
    top = _write(tmp_path, "top.qspec", 'version 1\ninclude "a.qspec"\ninclude "b.qspec"\nrule c { skip }\n')
    spec = load_spec(top)
    assert spec.quantizers["q"].bits == 3
    assert [r.targets[0].pattern for r in spec.rules] == ["a", "b", "c"]


def test_include_cycle_names_the_chain(tmp_path):
    a = _write(tmp_path, "a.qspec", 'version 1\ninclude "sub/b.qspec"\n')
    _write(tmp_path, "sub/b.qspec", 'version 1\ninclude "../a.qspec"\n')
    with pytest.raises(SpecError) as info:
        load_spec(a)
    (diag,) = info.value.diagnostics
    assert diag.code == "E111"
    assert diag.span.file.endswith("b.qspec") and (diag.span.line, diag.span.col) == (2, 9)
    assert "a.qspec -> " in diag.message and diag.message.endswith("a.qspec")
    assert len(diag.notes) == 2


def test_self_include_is_a_cycle(tmp_path):
    a = _write(tmp_path, "a.qspec", 'version 1\ninclude "a.qspec"\n')
    with pytest.raises(SpecError) as info:
        load_spec(a)
    assert info.value.codes == ["E111"]


def test_errors_in_included_files_are_reported_there(tmp_path):
    _write(tmp_path, "bad.qspec", "version 1\nquantizer q = int(bits=99)\n")
    top = _write(tmp_path, "top.qspec", 'version 1\ninclude "bad.qspec"\ninclude "gone.qspec"\n')
    with pytest.raises(SpecError) as info:
        load_spec(top)
    assert info.value.codes == ["E104", "E110"]
    assert info.value.diagnostics[0].span.file.endswith("bad.qspec")


def test_overrides_go_where_they_say():
    spec = parse_text(BASE, "m.qspec")
    out = compose(spec, ["weight.bits=4", "input=float", "defaults.weight.observer=histogram(percentile=99.9)",
                         "quantizers.w8.scale=pot", "quantizers.new=int(bits=2)", "fold_bn=false",
                         "learned_rounding=adaround"])
    assert out.overrides.roles[Role.WEIGHT].bits == 4
    assert out.overrides.roles[Role.INPUT].kind is Kind.FLOAT
    obs = out.defaults.roles[Role.WEIGHT].observer
    assert obs.name == "histogram" and obs.param_dict() == {"percentile": 99.9}
    assert out.defaults.roles[Role.WEIGHT].bits == 8
    assert out.quantizers["w8"].scale == "pot" and out.quantizers["w8"].bits == 8
    assert out.quantizers["new"].bits == 2
    assert out.fold_bn is False and out.learned_rounding == "adaround"
    assert spec.overrides.roles == {}  # the input spec is not modified


def test_overrides_from_a_mapping():
    spec = parse_text(BASE, "m.qspec")
    out = compose(spec, {"weight.bits": 3, "weight.scale": "pot", "bias": "float", "fold_bn": False,
                         "weight.observer": {"name": "percentile", "percentile": 99.0}})
    w = out.overrides.roles[Role.WEIGHT]
    assert (w.bits, w.scale, w.observer.name) == (3, "pot", "percentile")
    assert out.overrides.roles[Role.BIAS].kind is Kind.FLOAT
    assert out.fold_bn is False


@pytest.mark.parametrize(
    "item,code,col",
    [
        ("wieght.bits=4", "E112", 1),
        ("weight.bitz=4", "E112", 8),
        ("weight.bits=40", "E104", 13),
        ("weight.bits=four", "E102", 13),
        ("weight.bits=(", "E002", 14),
        ("weight.bits", "E112", 1),
        ("defaults.wieght.bits=4", "E112", 10),
        ("quantizers.nope.bits=4", "E112", 1),
        ("fold_bn=maybe", "E102", 9),
        ("learned_rounding=adarund", "E105", 18),
        ("input.scale=input*weight", "E105", 13),
    ],
)
def test_bad_overrides_are_located_in_the_set_string(item, code, col):
    spec = parse_text(BASE, "m.qspec")
    with pytest.raises(SpecError) as info:
        compose(spec, [item])
    (diag,) = info.value.diagnostics
    assert diag.code == code
    assert diag.span.file == "<--set>"
    assert diag.span.col == col
    assert item in diag.render()


def test_parse_overrides_collects_every_error():
    with pytest.raises(SpecError) as info:
        parse_overrides(["weight.bits=0", "nope=1", "input.signed=maybe"])
    assert info.value.codes == ["E104", "E112", "E102"]


def test_compose_accepts_parsed_overrides():
    spec = parse_text(BASE, "m.qspec")
    ovs = parse_overrides(["weight.bits=5"])
    assert compose(spec, ovs).overrides.roles[Role.WEIGHT].bits == 5

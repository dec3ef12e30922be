"""Hardware profiles and minifloat / microscaling formats (issue 22).

A profile allows element formats by name in a role's ``kinds`` (``fp8_e4m3``...), block
scales with ``scales = ["pot"]`` (OCP MX's E8M0) or a minifloat-coded scale class
(``"fp8_e4m3"``: NVFP4), and lint reports a spec using a format the target lacks at the
place the spec writes it.  Bad format names in a profile are located errors."""

from __future__ import annotations

import pytest
from torch import nn

import qdsl
from qdsl.lint import load_profile
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.model import GranularityKind, Kind, Role

MXFP4 = """version 1
quantizer mxfp4 = fp4_e2m1(granularity=group(32), scale=pot)
quantizer a_fp8 = fp8_e4m3(scale=pot)
defaults {
  weight = mxfp4
  input = a_fp8
  bias = float
}
"""

NVFP4 = """version 1
defaults {
  weight = fp4_e2m1(granularity=group(16), scale=fp8_e4m3)
  input = fp8_e4m3(scale=pot)
  bias = float
}
"""


def _spec(tmp_path, text: str, name: str = "m.qspec") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _model():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def test_ocp_mx_profile_facts():
    p = load_profile("ocp-mx")
    w = p.caps(Role.WEIGHT, "linear")
    assert set(w.kinds) == {"fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", Kind.INT}
    assert w.scales == ("pot",) and w.granularities == (GranularityKind.GROUP,) and w.group_sizes == (32,)
    assert p.caps(Role.BIAS).kinds == (Kind.FLOAT,)


def test_ocp_mx_accepts_an_mxfp4_spec(tmp_path):
    spec = _spec(tmp_path, MXFP4)
    assert [d for d in qdsl.lint(spec, "ocp-mx") if d.severity.value == "error"] == []
    assert [d for d in qdsl.lint(spec, "ocp-mx", _model()) if d.severity.value == "error"] == []


def test_int8_target_refuses_minifloat_kinds_where_the_spec_writes_them(tmp_path):
    spec = _spec(tmp_path, MXFP4)
    found = [d for d in qdsl.lint(spec, "tflite-int8") if d.code == "E301"]
    by_line = {d.span.line: d for d in found}
    assert set(by_line) == {2, 3}, [d.render() for d in found]
    assert "fp4_e2m1" in by_line[2].message and by_line[2].span.col == 19
    assert "fp8_e4m3" in by_line[3].message
    assert any("kind = int" in h or "int(" in h for h in by_line[2].hints), by_line[2].hints


def test_profile_allows_some_formats_and_names_the_others(tmp_path):
    hw = tmp_path / "fp8.toml"
    hw.write_text('version = 1\n[roles.weight]\nkinds = ["fp8_e4m3"]\n')
    bad = _spec(tmp_path, "version 1\ndefaults {\n  weight = fp8_e5m2(per_channel)\n}\n")
    found = [d for d in qdsl.lint(bad, str(hw)) if d.code == "E301"]
    assert len(found) == 1 and found[0].span.line == 3 and "fp8_e5m2" in found[0].message
    assert "fp8_e4m3" in found[0].render()  # the allowed list
    # the same format under its long name (bias 7, no infinities) is the allowed one
    same = _spec(tmp_path, "version 1\ndefaults {\n  weight = fp8_e4m3_b7_fn(per_channel)\n}\n", "same.qspec")
    assert [d for d in qdsl.lint(same, str(hw)) if d.code == "E301"] == []


def test_nvfp4_scales_against_mx_and_an_nvfp4_profile(tmp_path):
    spec = _spec(tmp_path, NVFP4)
    codes = {d.code for d in qdsl.lint(spec, "ocp-mx")}
    assert {"E304", "E305"} <= codes  # an fp8_e4m3 scale is not E8M0; group(16) is not 32
    hw = tmp_path / "nv.toml"
    hw.write_text('version = 1\n[roles.weight]\nkinds = ["fp4_e2m1"]\nscales = ["fp8_e4m3"]\n'
                  'granularities = ["group"]\ngroup_sizes = [16]\n')
    assert [d for d in qdsl.lint(spec, str(hw)) if d.code in ("E304", "E305", "E301")] == []
    # a target taking any real scale takes a minifloat-coded one
    hw.write_text('version = 1\n[roles.weight]\nscales = ["float"]\n')
    assert [d for d in qdsl.lint(spec, str(hw)) if d.code == "E304"] == []


@pytest.mark.parametrize("entry,needle", [
    ("fp8_e4m4", "at most 8 bits"),
    ("fp8_e4m3_b99", "bias 99 is out of range"),
    ("minifloat", "family of formats"),
    ("fp8e4m3", "not a minifloat format name"),
    ("flaot", "did you mean 'float'"),
])
def test_bad_format_names_in_a_profile_are_located(tmp_path, entry, needle):
    f = tmp_path / "bad.toml"
    f.write_text(f'version = 1\n[roles.weight]\nkinds = ["int", "{entry}"]\n')
    with pytest.raises(SpecError) as info:
        load_profile(str(f))
    (d,) = info.value.diagnostics
    assert d.code == "E105" and (d.span.line, d.span.col) == (3, 17)
    assert needle in info.value.render(), info.value.render()


def test_scale_names_in_a_profile_are_checked(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('version = 1\n[roles.weight]\nscales = ["fp8_e4m4"]\n')
    with pytest.raises(SpecError) as info:
        load_profile(str(f))
    assert info.value.codes == ["E105"] and "fp8_e4m3" in info.value.render()


def test_minifloat_activations_are_reported_as_export_refusals(tmp_path):
    """The integer graph has no minifloat activation type: lint names each place as export
    does ('<layer>:<role>'; tests/export/test_minifloat_export.py checks export's words)."""
    spec = _spec(tmp_path, MXFP4)
    found = [d for d in qdsl.lint(spec, "ocp-mx", _model()) if d.code == "W321"]
    assert len(found) == 1, [d.render() for d in found]
    assert "'fp8_e4m3 input activation' has no integer lowering" in found[0].message
    assert "(0:input, 2:input)" in found[0].message
    # int8 activations lower: no finding
    int_acts = _spec(tmp_path, MXFP4.replace("quantizer a_fp8 = fp8_e4m3(scale=pot)",
                                             "quantizer a_fp8 = int(bits=8, scale=pot)"), "int.qspec")
    assert [d for d in qdsl.lint(int_acts, "ocp-mx", _model()) if d.code == "W321"] == []

"""Profile files: bundled profiles load, ``extends`` flattens field by field, and every
mistake in a profile file is a located error (file:line:col, source line, caret, hint)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qdsl.lint import bundled_profiles, load_profile, parse_profile
from qdsl.lint.profile_loader import BUNDLED_DIR
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.model import GranularityKind, Kind, Overflow, Role
from qdsl.spec.profile import NarrowRange, Position

REPO = Path(__file__).resolve().parents[2]
BUNDLED = ["int-only-photonic", "ocp-mx", "pot-asic-24bit-acc", "tflite-int8", "x86-fbgemm", "xnor-fpga"]


def test_bundled_profiles_are_listed_and_load():
    assert bundled_profiles() == BUNDLED
    for name in BUNDLED:
        p = load_profile(name)
        assert p.name == name
        assert p.source == f"qdsl/data/hw/{name}.toml"
        text = (BUNDLED_DIR / f"{name}.toml").read_text()
        assert text.startswith("#"), "each bundled profile cites its public source in a top comment"


def test_specs_hw_is_the_packaged_copy():
    """``specs/hw/*.toml`` are links to the one source of truth in ``qdsl/data/hw``."""
    for name in BUNDLED:
        linked = REPO / "specs" / "hw" / f"{name}.toml"
        assert linked.read_bytes() == (BUNDLED_DIR / f"{name}.toml").read_bytes()
        assert load_profile(str(linked)) == load_profile(name)


def test_tflite_facts():
    p = load_profile("tflite-int8")
    w = p.caps(Role.WEIGHT, "conv2d")
    assert w.bits == (8,) and w.zero_point is False and w.narrow_range is NarrowRange.REQUIRED
    assert p.caps(Role.WEIGHT, "linear").granularities == (GranularityKind.TENSOR,)
    assert p.caps(Role.BIAS).scales == ("input*weight",)
    assert p.accumulator.bits == 32
    assert p.fixed_outputs["softmax"].zero_point == -128 and p.fixed_outputs["softmax"].scale == 1 / 256


def test_xnor_position_allowances():
    p = load_profile("xnor-fpga")
    assert p.caps(Role.WEIGHT, "conv2d").kinds == (Kind.BINARY,)
    assert p.caps(Role.INPUT, "conv2d", (Position.FIRST,)).kinds == (Kind.INT, Kind.BINARY)
    assert p.caps(Role.INPUT, "conv2d", (Position.LAST,)).kinds == (Kind.INT, Kind.BINARY)
    assert p.caps(Role.INPUT, "conv2d").kinds == (Kind.BINARY,)  # hidden layers
    assert Kind.INT in p.caps(Role.WEIGHT, "linear", (Position.LAST,)).kinds


def test_extends_overrides_field_by_field(tmp_path):
    (tmp_path / "base.toml").write_text(
        'version = 1\nname = "base"\n[accumulator]\nbits = 32\noverflow = "wrap"\n'
        '[roles.weight]\nbits = [8]\nkinds = ["int"]\n')
    (tmp_path / "child.toml").write_text(
        'version = 1\nextends = "base.toml"\ninteger_only = true\n[accumulator]\nbits = 16\n'
        '[roles.weight]\nbits = [4, 8]\n[op.linear.weight]\nbits = [8]\n')
    p = load_profile(str(tmp_path / "child.toml"))
    assert p.name == "child" and p.extends_chain == ("base",)
    assert p.accumulator.bits == 16 and p.accumulator.overflow is Overflow.WRAP
    assert p.caps(Role.WEIGHT).bits == (4, 8) and p.caps(Role.WEIGHT).kinds == (Kind.INT,)
    assert p.caps(Role.WEIGHT, "linear").bits == (8,)
    assert p.integer_only


def test_extends_a_bundled_profile_by_name(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('version = 1\nextends = "tflite-int8"\n[accumulator]\nbits = 24\n')
    p = load_profile(str(f))
    assert p.accumulator.bits == 24
    assert p.caps(Role.WEIGHT).narrow_range is NarrowRange.REQUIRED


def _render(text: str, tmp_path, name="bad.toml") -> str:
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(SpecError) as info:
        load_profile(str(f))
    return info.value.render().replace(str(tmp_path) + "/", "")


def test_unknown_key_with_did_you_mean_is_located(tmp_path):
    out = _render('version = 1\n[roles.weight]\nbitz = [8]\n', tmp_path)
    assert out == (
        "bad.toml:3:1: error[E101]: unknown key 'bitz' in $.roles.weight\n"
        "  3 | bitz = [8]\n"
        "    | ^^^^\n"
        "  hint: did you mean 'bits'? known keys: bits, channel_axes, dynamic, granularities, "
        "group_sizes, kinds, narrow_range, scales, signedness, thresholds, zero_point"
    )


def test_every_problem_is_reported_in_one_pass(tmp_path):
    text = ('version = 1\nintegr_only = true\n[roles.weight]\nbits = [8, 40]\nkinds = ["int", "binry"]\n'
            'narrow_range = "maybe"\n[op.conv3d.weight]\nbits = [4]\n[accumulator]\nbits = "32"\n'
            '[roles.input]\nscales = ["input*weight"]\nsignedness = []\n')
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(SpecError) as info:
        load_profile(str(f))
    err = info.value
    assert err.codes == ["E101", "E104", "E105", "E105", "E105", "E102", "E105", "E193"]
    lines = [d.span.line for d in err.diagnostics]
    assert lines == sorted(lines) and all(d.span.col >= 1 for d in err.diagnostics)
    assert "did you mean 'integer_only'" in err.diagnostics[0].hints[0]
    assert "did you mean 'conv2d'" in err.render()


def test_toml_syntax_error_is_located(tmp_path):
    out = _render('version = 1\n[roles.weight\nbits = [8]\n', tmp_path)
    assert out.startswith("bad.toml:2:")
    assert "error[E001]" in out and "^" in out


def test_version_cycle_and_missing_extends(tmp_path):
    out = _render('version = 2\n', tmp_path)
    assert "error[E190]: unsupported profile version 2" in out
    (tmp_path / "a.toml").write_text('version = 1\nextends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('version = 1\nextends = "a.toml"\n')
    with pytest.raises(SpecError) as info:
        load_profile(str(tmp_path / "a.toml"))
    assert "E192" in info.value.codes and "profile extends itself" in info.value.render()
    out = _render('version = 1\nextends = "nowhere.toml"\n', tmp_path, "c.toml")
    assert out.startswith("c.toml:2:11: error[E191]: cannot find extended profile 'nowhere.toml'")


def test_unknown_bundled_name_suggests():
    with pytest.raises(SpecError) as info:
        load_profile("tflite-int9")
    assert info.value.codes == ["E191"]
    assert "did you mean 'tflite-int8'" in info.value.render()


def test_parse_profile_from_text():
    p = parse_profile('version = 1\nname = "t"\nops = ["conv2d", "relu"]\nfusions = ["conv2d+relu"]\n')
    assert p.ops == ("conv2d", "relu") and p.fusion_heads("relu") == ("conv2d",)
    with pytest.raises(SpecError) as info:
        parse_profile('version = 1\nfusions = ["conv2d", "conv2d+relux"]\n')
    assert info.value.codes == ["E102", "E105"]


def test_missing_version_and_bad_fixed_output(tmp_path):
    out = _render('[fixed_output.softmax]\nzero_point = -128\n[fixed_output.softmx]\nscale = 1.0\nzero_point = 0\n',
                  tmp_path)
    assert "error[E103]: missing required key 'version' at the top level" in out
    assert "bad.toml:1:15: error[E103]: missing required key 'scale' in $.fixed_output.softmax" in out
    assert "bad.toml:3:15: error[E105]: unknown op 'softmx'" in out and "did you mean 'softmax'" in out

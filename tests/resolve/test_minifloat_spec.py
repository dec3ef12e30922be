"""Minifloat kinds, spec side (torch-free): the presets' facts, the generic names, the DSL/TOML
forms, and located errors for names that describe no format (E224) or a bits mismatch (E211)."""

import pytest

from qdsl.parse import format_spec, parse_dsl, parse_toml
from qdsl.resolve import check_spec, resolve
from qdsl.spec.builtins import builtin_registries
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.formats import MINIFLOAT_PRESETS, format_of, minifloat_format

# (name, max normal, min normal, min subnormal, inf, nan): OCP 8-bit FP v1.0 and OCP MX v1.0 tables
RANGES = [
    ("fp8_e4m3", 448.0, 2.0 ** -6, 2.0 ** -9, False, True),
    ("fp8_e5m2", 57344.0, 2.0 ** -14, 2.0 ** -16, True, True),
    ("fp6_e3m2", 28.0, 2.0 ** -2, 2.0 ** -4, False, False),
    ("fp6_e2m3", 7.5, 1.0, 0.125, False, False),
    ("fp4_e2m1", 6.0, 1.0, 0.5, False, False),
]
EMAX = {"fp8_e4m3": 8, "fp8_e5m2": 15, "fp6_e3m2": 4, "fp6_e2m3": 2, "fp4_e2m1": 2}  # OCP MX emax_elem


@pytest.mark.parametrize("name,top,norm,sub,inf,nan", RANGES, ids=[r[0] for r in RANGES])
def test_preset_ranges(name, top, norm, sub, inf, nan):
    f = MINIFLOAT_PRESETS[name]
    assert (f.max_normal, f.min_normal, f.min_subnormal, f.has_inf, f.has_nan) == (top, norm, sub, inf, nan)
    assert f.emax == EMAX[name]
    vals = f.values()
    assert vals[0] == 0.0 and vals[1] == sub and vals[-1] == top and norm in vals
    # every value is a whole number of smallest-subnormal steps: the format's integer grid
    assert all((v / f.grid_step(f.bits)).is_integer() for v in vals)
    assert f.code_range(f.bits, True, False) == (-int(top / sub), int(top / sub))


def test_fp4_and_fp6_e2m3_value_tables():
    # written out from OCP MX v1.0 section 5.3 (FP4 E2M1, FP6 E2M3)
    assert MINIFLOAT_PRESETS["fp4_e2m1"].values() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    e2m3 = [i / 8 for i in range(8)] + [1 + i / 8 for i in range(8)] + [2 + i / 4 for i in range(8)] \
        + [4 + i / 2 for i in range(8)]
    assert MINIFLOAT_PRESETS["fp6_e2m3"].values() == e2m3
    # fp8_e4m3: 127 non-negative codes minus NaN = 126 values + ... (0x00..0x7e, all distinct)
    assert len(MINIFLOAT_PRESETS["fp8_e4m3"].values()) == 0x7F
    assert len(MINIFLOAT_PRESETS["fp8_e5m2"].values()) == 0x7C  # 0x7c.. are inf/NaN


def test_operand_codes_decode_bit_patterns():
    import numpy as np

    f = MINIFLOAT_PRESETS["fp4_e2m1"]
    codes = np.arange(16)
    grid = f.operand_codes(codes) * f.grid_step(4)
    assert grid.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def test_generic_names():
    f = minifloat_format("fp6_e3m2_b2")
    assert (f.exponent, f.mantissa, f.bias, f.max_normal) == (3, 2, 2, 56.0)
    ieee = minifloat_format("fp8_e4m3_ieee")
    assert ieee.max_normal == 240.0 and ieee.has_inf
    assert minifloat_format("fp8_e5m2_ieee").max_normal == MINIFLOAT_PRESETS["fp8_e5m2"].max_normal
    assert minifloat_format("fp8_e3m2") is None and minifloat_format("int") is None
    assert format_of("fp4_e2m1", builtin_registries()) is MINIFLOAT_PRESETS["fp4_e2m1"]


DSL = """version 1
quantizer mx4 = fp4_e2m1(granularity=group(32), scale=pot)
defaults {
  weight = fp8_e5m2(per_channel)
  input = fp8_e4m3
}
rule fc { weight = mx4 }
rule "layer1.*.conv1" { weight = fp6_e3m2_b2(per_channel, rounding=stochastic) }
"""

TOML = """version = 1
[quantizers.mx4]
kind = "fp4_e2m1"
granularity = { kind = "group", size = 32 }
scale = "pot"
[defaults]
weight = { kind = "fp8_e5m2", granularity = "channel" }
input = { kind = "fp8_e4m3" }
[[rules]]
target = "fc"
weight = "mx4"
[[rules]]
target = "layer1.*.conv1"
weight = { kind = "fp6_e3m2_b2", granularity = "channel", rounding = "stochastic" }
"""


def test_dsl_and_toml_forms_agree_and_round_trip():
    a, b = parse_dsl(DSL, "m.qspec"), parse_toml(TOML, "m.qspec.toml")
    assert a == b
    assert parse_dsl(format_spec(a, to="qspec"), "x.qspec") == a
    assert "weight = fp8_e5m2(per_channel)" in format_spec(a, to="qspec")


def test_resolves_with_format_facts(resnet):
    plan = resolve(resnet, parse_dsl(DSL, "m.qspec"))
    stem = plan.layer("layer2.0.conv1")
    assert stem.recipe("weight").format is MINIFLOAT_PRESETS["fp8_e5m2"] and stem.recipe("weight").bits == 8
    assert stem.recipe("input").format.name == "fp8_e4m3"
    fc = plan.layer("fc").recipe("weight")
    assert fc.format.name == "fp4_e2m1" and fc.bits == 4 and fc.scale == "pot"
    assert fc.granularity.group_size == 32
    mixed = plan.layer("layer1.0.conv1").recipe("weight")
    assert (mixed.format.bias, mixed.rounding) == (2, "stochastic")


BAD = [
    ("fp8_e3m2", "1 + 3 + 2 = 6 bits, not 8", "fp6_e3m2"),
    ("fp6_e2m3_b9", "bias 9 is out of range", "0..3"),
    ("fp3_e1m1_ieee", "IEEE-like format needs >= 2 exponent bits", "_ieee"),
    ("fp4_e3m0_fn", "needs >= 1 mantissa bit", "_finite"),
    ("fp9_e5m3", "at most 8 bits", "fp8_e4m3"),
    ("fp8_e4m3_xyz", "not a minifloat format name", "fp{bits}_e{E}m{M}"),
    ("minifloat", "family of formats", "fp4_e2m1"),
]


@pytest.mark.parametrize("name,message,hint", BAD, ids=[b[0] for b in BAD])
def test_bad_names_are_located_e224(name, message, hint):
    text = f"version 1\ndefaults {{ weight = {name}(per_channel) }}\n"
    diags = check_spec(parse_dsl(text, "b.qspec"))
    assert [d.code for d in diags] == ["E224"], [d.render() for d in diags]
    d = diags[0]
    assert message in d.message and hint in d.hints[0]
    assert (d.span.line, d.span.col) == (2, text.splitlines()[1].index(name) + 1)


def test_bits_mismatch_is_e211_at_bits(resnet):
    text = "version 1\ndefaults { weight = fp8_e4m3(bits=4) }\n"
    with pytest.raises(SpecError) as exc:
        resolve(resnet, parse_dsl(text, "b.qspec"))
    (d,) = [d for d in exc.value.diagnostics if d.code == "E211"]
    assert "fp8_e4m3 quantizers need bits == 8" in d.message
    assert d.span.col == text.splitlines()[1].index("bits=4") + 6


def test_preset_cannot_take_a_minifloat_name():
    with pytest.raises(SpecError) as exc:
        parse_dsl("version 1\nquantizer fp4_e2m1 = int(bits=4)\n", "p.qspec")
    assert exc.value.codes == ["E107"]


def _doc_number(text: str) -> float:
    text = text.strip().replace("−", "-")
    return 2.0 ** int(text[2:]) if text.startswith("2^") else float(text)


def test_documented_range_tables_match_the_formats():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for doc, cols in (("docs/spec-language.md", (2, 3, 4)), ("README.md", (1, 2, 3))):
        rows = [line.split("|")[1:-1] for line in (root / doc).read_text().splitlines()
                if line.startswith("| `fp") and line.count("|") >= 6]
        seen = set()
        for row in rows:
            name = row[0].strip().strip("`")
            if name not in MINIFLOAT_PRESETS or name in seen:
                continue
            seen.add(name)
            f = MINIFLOAT_PRESETS[name]
            assert [_doc_number(row[c]) for c in cols] == [f.max_normal, f.min_normal, f.min_subnormal], (doc, name)
        assert seen == set(MINIFLOAT_PRESETS), doc

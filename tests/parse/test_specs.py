"""Every example in specs/ exists in both syntaxes, they lower to equal specs, and fmt round-trips."""

from pathlib import Path

import pytest

from qdsl.parse import format_spec, load_spec, parse_file, parse_text
from qdsl.spec.model import Kind, Role

SPECS = Path(__file__).resolve().parents[2] / "specs"
DSL_FILES = sorted(SPECS.glob("*.qspec"))
IDS = [p.stem for p in DSL_FILES]


def test_required_examples_exist():
    names = {p.stem for p in DSL_FILES}
    assert {"int8-default", "w4a8-per-channel", "pot-asic", "xnor-binary", "mixed-precision"} <= names
    for p in DSL_FILES:
        assert p.with_name(p.name + ".toml").exists(), f"{p.name} has no TOML twin"


@pytest.mark.parametrize("path", DSL_FILES, ids=IDS)
def test_dsl_and_toml_forms_are_equal(path):
    dsl = parse_file(path)
    toml = parse_file(path.with_name(path.name + ".toml"))
    assert dsl == toml


@pytest.mark.parametrize("path", DSL_FILES, ids=IDS)
@pytest.mark.parametrize("to", ["qspec", "toml"])
def test_fmt_round_trips_and_is_idempotent(path, to):
    spec = parse_file(path)
    text = format_spec(spec, to=to)
    again = parse_text(text, "x.qspec.toml" if to == "toml" else "x.qspec")
    assert again == spec
    assert format_spec(again, to=to) == text


@pytest.mark.parametrize("path", DSL_FILES, ids=IDS)
def test_spans_point_into_the_file(path):
    spec = parse_file(path)
    lines = path.read_text().splitlines()
    for name, tq in spec.quantizers.items():
        for field, span in tq.field_spans.items():
            assert span.file == str(path)
            assert 1 <= span.line <= len(lines)
    for rule in spec.rules:
        assert lines[rule.span.line - 1][rule.span.col - 1:].startswith("rule")
        for t in rule.targets:
            written = lines[t.span.line - 1][t.span.col - 1:t.span.end_col - 1]
            assert t.pattern in written or written.strip("'\"") in t.text


def test_pot_asic_content():
    spec = load_spec(SPECS / "pot-asic.qspec")
    assert spec.fold_bn is True
    w = spec.quantizers["w4pot"]
    assert (w.bits, w.scale, w.symmetric) == (4, "pot", True)
    bias = spec.defaults.roles[Role.BIAS]
    assert (bias.kind, bias.bits, bias.scale) == (Kind.INT, 32, "input*weight")


def test_xnor_first_and_last_layers_are_8_bit():
    spec = load_spec(SPECS / "xnor-binary.qspec")
    by_name = {r.name: r for r in spec.rules}
    for name in ("first_layer", "last_layer"):
        assert by_name[name].optional
        assert by_name[name].body.roles[Role.WEIGHT].extends == "w8"
    assert spec.quantizers["wbin"].kind is Kind.BINARY
    assert spec.quantizers["wbin"].observer.name == "mean_abs"


@pytest.mark.parametrize("factory", ["conv_bn_relu_net", "digits_resnet", "conv1d_net", "mlp"])
@pytest.mark.parametrize("path", DSL_FILES, ids=IDS)
def test_examples_resolve_on_the_reference_models(path, factory):
    """The examples are realistic: each resolves (no unmatched rule, no conflict) on every reference net."""
    pytest.importorskip("torch")
    import qdsl
    from qdsl.zoo import models

    plan = qdsl.resolve(getattr(models, factory)(), load_spec(path))
    assert plan is not None


@pytest.mark.parametrize("path", DSL_FILES, ids=IDS)
def test_toml_twins_are_canonical(path):
    """The TOML form is `qdsl fmt X.qspec --to toml` output (plus the header comment): keep it so."""
    from qdsl.cli.main import main

    assert main(["fmt", str(path.with_name(path.name + ".toml")), "--check"]) == 0

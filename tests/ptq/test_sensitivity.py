"""Sensitivity report, mixed-precision emission and the ``qdsl sensitivity`` CLI."""

from pathlib import Path

import pytest
import torch

import qdsl
from qdsl.cli.main import main
from qdsl.parse import load_spec, parse_text
from qdsl.workflows.sensitivity import (
    LayerSensitivity,
    SensitivityReport,
    emit_mixed_precision,
    mixed_average_bits,
    ptq_metric,
    sensitivity,
)
from qdsl.spec.diagnostics import QdslError
from qdsl.spec.model import Role

HERE = Path(__file__).parent
SPEC = HERE.parent.parent / "specs" / "low-bit.qspec"
PROFILE = HERE / "specs" / "lowbit-accel.toml"
REFS = HERE / "_refs.py"


def _report(spec=None, bits=3):
    spec = spec or load_spec(SPEC)
    layers = (
        LayerSensitivity("a", 100, ("weight", "input"), 2.0, 1.0),
        LayerSensitivity("b", 1000, ("weight", "input"), 1.0, 0.5),
        LayerSensitivity("c", 10, ("weight",), 0.5, 0.0),
        LayerSensitivity("d", 890, ("weight", "input"), 0.0, -0.2),
    )
    return SensitivityReport(spec, bits, "accuracy", 99.0, 95.0, layers)


def _bits(spec):
    return {r.targets[0].pattern: {role.value: tq.bits for role, tq in r.body.roles.items()} for r in spec.rules
            if r.priority}


def test_emit_respects_weighted_budget_and_prefers_sensitive_layers():
    rep = _report()
    # budget 3.5 over 2000 weights at +1 bit: 1000 weights can go to 4 bits; a + c (+ d to fill the
    # budget, score 3.3 in all) beats b alone (1.5), and a + b (1100 weights) does not fit
    mixed = emit_mixed_precision(rep, 3.5)
    bits = _bits(mixed)
    assert bits["a"] == {"weight": 4, "input": 4} and bits["c"] == {"weight": 4}
    assert bits["b"] == {"weight": 3, "input": 3}
    high = {k for k, v in bits.items() if v["weight"] == 4}
    assert mixed_average_bits(rep, high, 4) <= 3.5
    # a roomier budget raises b, and 8-bit high precision costs 5 bits per weight
    assert _bits(emit_mixed_precision(rep, 4.0))["b"]["weight"] == 4
    b8 = _bits(emit_mixed_precision(rep, 3.3, high_bits=8))
    assert b8["a"]["weight"] == 8 and b8["b"]["weight"] == 3
    assert mixed_average_bits(rep, {k for k, v in b8.items() if v["weight"] == 8}, 8) <= 3.3


def test_emitted_spec_is_an_ordinary_spec_and_round_trips():
    mixed = emit_mixed_precision(_report(), 3.5)
    for fmt, name in (("qspec", "m.qspec"), ("toml", "m.qspec.toml")):
        text = qdsl.format_spec(mixed, fmt)
        again = parse_text(text, name)
        assert again.rules == mixed.rules and again.defaults == mixed.defaults


def test_emit_rejects_bad_budgets():
    with pytest.raises(QdslError, match="below the report's 3 bits"):
        emit_mixed_precision(_report(), 2.5)
    with pytest.raises(QdslError, match="must be above"):
        emit_mixed_precision(_report(), 3.5, high_bits=3)



def _tiny():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_ptq_refs", REFS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sensitivity_report_and_mixed_spec_on_tiny_model():
    refs = _tiny()
    model = refs.tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    xtr, _, xte, yte = refs.tiny_data()
    rep = sensitivity(model, SPEC, (xtr, xte, yte), "loss", 2)
    assert [s.fqn for s in rep.layers] and {s.fqn for s in rep.layers} == {"c1", "c2", "fc"}
    assert list(rep.layers) == sorted(rep.layers, key=lambda s: -s.score)
    assert rep.float_metric >= rep.all_metric
    assert "drop alone" in rep.format()
    # the model is left exactly as it was
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    mixed = emit_mixed_precision(rep, 2.5, high_bits=4)
    from qdsl.lint import lint
    from qdsl.resolve import check_spec

    assert not [d for d in check_spec(mixed) if d.severity.value == "error"]
    assert not [d for d in lint(mixed, PROFILE, model) if d.severity.value == "error"]
    assert ptq_metric(model, mixed, xtr, xte, yte, "loss") > -10


def test_cli_sensitivity_emit(tmp_path, capsys):
    out = tmp_path / "mixed.qspec"
    rc = main(["sensitivity", str(SPEC), "--model", f"{REFS}:tiny", "--data", f"{REFS}:tiny_data", "--bits", "2",
               "--emit", str(out), "--budget", "2.5", "--calib", "32"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "sensitivity at 2 bits" in text and f"wrote {out}" in text
    assert out.read_text().startswith("# mixed precision from")
    assert main(["check", str(out), "--model", f"{REFS}:tiny"]) == 0


@pytest.mark.parametrize("argv,message", [
    (["--emit", "x.qspec"], "--emit needs --budget"),
    (["--budget", "3.5"], "--budget is only used with --emit"),
    (["--bits", "0"], "--bits must be in 1..16"),
    (["--data", f"{REFS}:not_data"], "must return (x_train, y_train, x_test, y_test)"),
    (["--model", "no_such_module_xyz:f"], "no module named 'no_such_module_xyz'"),
])
def test_cli_errors_are_clear(argv, message, capsys):
    base = {"--model": f"{REFS}:tiny", "--data": f"{REFS}:tiny_data"}
    args = ["sensitivity", str(SPEC)]
    for k, v in base.items():
        if k not in argv:
            args += [k, v]
    assert main(args + argv) == 2
    assert message in capsys.readouterr().err


def test_loss_breaks_accuracy_ties():
    spec = load_spec(SPEC)
    tied = (
        LayerSensitivity("x", 100, ("weight",), 0.0, 0.0, tiebreak=0.3),
        LayerSensitivity("y", 100, ("weight",), 0.0, 0.0, tiebreak=-0.1),
        LayerSensitivity("z", 100, ("weight",), 0.2, 0.0, tiebreak=-5.0),
    )
    rep = SensitivityReport(spec, 3, "accuracy", 99.0, 98.0, tied)
    # room for two of three layers: z (real score) first, then x (better loss score), not y
    bits = _bits(emit_mixed_precision(rep, 3 + 200 / 300))
    assert bits["z"]["weight"] == 4 and bits["x"]["weight"] == 4 and bits["y"]["weight"] == 3
    assert "loss score" in rep.format()


def test_tiny_model_accuracy_report_has_tiebreaks():
    refs = _tiny()
    model = refs.tiny()
    xtr, _, xte, yte = refs.tiny_data()
    rep = sensitivity(model, SPEC, (xtr, xte, yte), "accuracy", 2)
    assert any(s.tiebreak != 0 for s in rep.layers)
    assert [s.key for s in rep.layers] == sorted((s.key for s in rep.layers), reverse=True)

"""``auto`` PTQ steps by bit width, explicit overrides, and the per-layer held-back guard."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import qdsl
from qdsl.parse import parse_text
from qdsl.ptq.guard import LayerProbe, guarded
from qdsl.ptq.report import PtqReport
from qdsl.resolve import resolve
from qdsl.resolve.ptq_policy import AUTO_STEPS, BIAS_CORRECTION, auto_steps, layer_steps

TINY = str(Path(__file__).with_name("_tiny_model.py"))


def _spec(wbits=3, abits=3, extra="", input_q=True):
    inp = f'input = {{ kind = "int", bits = {abits}, symmetric = false }}' if input_q else ""
    bias = 'bias = { kind = "int", bits = 32, scale = "input*weight" }' if input_q else ""
    return parse_text(f"""
version = 1
{extra}
[defaults]
weight = {{ kind = "int", bits = {wbits}, granularity = "channel" }}
{inp}
{bias}
""", "t.qspec.toml")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv1d(2, 6, 3, padding=1)
        self.fc = nn.Linear(6 * 8, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.c(x)).flatten(1))


def _table_steps(bits):
    for max_bits, steps in AUTO_STEPS:
        if bits <= max_bits:
            return steps
    return ()


@pytest.mark.parametrize("bits", [16, 8, 7, 6, 5, 4, 3, 2])
def test_auto_resolves_to_the_table_steps_at_each_bit_width(bits):
    plan = resolve(Net(), _spec(bits, bits))
    got = {s.fqn: s.steps for s in layer_steps(plan)}
    assert got == {"c": _table_steps(bits), "fc": _table_steps(bits)}
    assert auto_steps(bits) == _table_steps(bits)
    assert all(s.learned_rounding_by == f"auto at {bits} bits" for s in layer_steps(plan))


def test_auto_tries_learned_rounding_and_bias_correction_below_8_bits_only():
    assert auto_steps(8) == ()
    assert BIAS_CORRECTION in auto_steps(3) and "gptq" in auto_steps(3)
    assert auto_steps(2) == ("adaround", BIAS_CORRECTION)  # block reconstruction at 2 bits


def test_layer_bits_are_the_narrowest_of_weight_and_input():
    plan = resolve(Net(), _spec(8, 3))
    assert {s.bits for s in layer_steps(plan)} == {3}
    plan = resolve(Net(), _spec(3, 8, input_q=False))  # weight-only: the weight's bits
    assert [s.steps for s in layer_steps(plan)] == [auto_steps(3)] * 2


@pytest.mark.parametrize("extra, lr, bc", [
    ('learned_rounding = "none"', None, True),
    ("bias_correction = false", "gptq", False),
    ('learned_rounding = "none"\nbias_correction = false', None, False),
])
def test_explicit_settings_override_auto(extra, lr, bc):
    for s in layer_steps(resolve(Net(), _spec(3, 3, extra))):
        assert (s.learned_rounding, s.bias_correction) == (lr, bc)
        assert s.learned_rounding_by.startswith("spec" if "learned_rounding" in extra else "auto")
        assert s.bias_correction_by.startswith("spec" if "bias_correction" in extra else "auto")


def test_explicit_bias_correction_runs_at_8_bits_and_none_disables_every_step():
    steps = layer_steps(resolve(Net(), _spec(8, 8, "bias_correction = true")))
    assert [s.steps for s in steps] == [(BIAS_CORRECTION,)] * 2
    model = Net().eval()
    qdsl.apply(model, _spec(3, 3, 'learned_rounding = "none"\nbias_correction = false'))
    x = torch.randn(64, 2, 8)
    qdsl.calibrate(model, [x[:32], x[32:]])
    handle = qdsl.patch.get_handle(model)
    assert handle.quantizer("fc", "weight").codes.numel() == 0 and handle.quantizer("fc", "bias").offset.numel() == 0
    assert qdsl.ptq.ptq_report(model) is None


def test_auto_calibration_reports_every_step_on_every_layer():
    model = Net().eval()
    qdsl.apply(model, _spec(3, 3))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 2, 8, generator=g)
    qdsl.calibrate(model, [x[i : i + 32] for i in range(0, 128, 32)])
    rep = qdsl.ptq.ptq_report(model)
    assert [(d.layer, d.step) for d in rep] == [("c", "gptq"), ("fc", "gptq"), ("c", BIAS_CORRECTION),
                                                 ("fc", BIAS_CORRECTION)]
    for d in rep:  # every verdict follows the held-back errors it reports
        assert d.kept == (d.error_after < d.error_before), d
    handle = qdsl.patch.get_handle(model)
    for d in rep.for_step("gptq"):
        assert (handle.quantizer(d.layer, "weight").codes.numel() > 0) == d.kept
    for d in rep.for_step(BIAS_CORRECTION):
        assert (handle.quantizer(d.layer, "bias").offset.numel() > 0) == d.kept


def _shifted_batches():
    # fit batches all have x > 0, the held-back one (every 4th) x < 0: the mean output
    # error of a rounded weight flips sign with x, so the fit's correction doubles it there
    g = torch.Generator().manual_seed(2)
    pos = [torch.rand(32, 4, generator=g) + 1.0 for _ in range(3)]
    return pos + [-(torch.rand(32, 4, generator=g) + 1.0)]


def test_a_harmful_bias_correction_is_rejected_per_layer():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    spec = _spec(2, 8, 'learned_rounding = "none"\nbias_correction = true')
    batches = _shifted_batches()
    qdsl.apply(model, spec)
    qdsl.calibrate(model, batches)
    [d] = qdsl.ptq.ptq_report(model).decisions
    assert d.step == BIAS_CORRECTION and not d.kept and d.error_after > d.error_before
    assert qdsl.patch.get_handle(model).quantizer("0", "bias").offset.numel() == 0
    # the same correction unguarded (the direct API) does raise the held-back error
    qdsl.remove(model)
    qdsl.apply(model, spec)
    with qdsl.calibration.calibrating(model), torch.no_grad():
        for b in batches:
            model(b)
    probe = LayerProbe(model, model[0], batches[3:])
    before = probe.error()
    qdsl.ptq.correct_bias(model, batches[:3])
    assert probe.error() > before


def test_a_helpful_bias_correction_is_kept():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    g = torch.Generator().manual_seed(2)
    batches = [torch.rand(32, 4, generator=g) + 1.0 for _ in range(4)]
    qdsl.apply(model, _spec(2, 8, 'learned_rounding = "none"'))
    qdsl.calibrate(model, batches)
    [d] = qdsl.ptq.ptq_report(model).decisions
    assert d.kept and d.error_after < d.error_before
    assert qdsl.patch.get_handle(model).quantizer("0", "bias").offset.numel() == 4


def test_guard_undoes_a_change_that_raises_the_error_and_keeps_one_that_lowers_it():
    model = Net().eval()
    qdsl.apply(model, _spec(3, 3, 'learned_rounding = "none"\nbias_correction = false'))
    x = torch.randn(64, 2, 8)
    qdsl.calibrate(model, [x])
    bq = qdsl.patch.get_handle(model).quantizer("fc", "bias")
    fc = model.fc
    report = PtqReport()
    bad = torch.full((3,), 5.0)
    assert not guarded(model, "fc", fc, [x], "push", lambda: bq.add_offset(bad),
                       lambda: setattr(bq, "offset", torch.empty(0)), report)
    assert bq.offset.numel() == 0
    assert guarded(model, "fc", fc, [], "unchecked", lambda: None, lambda: None, report)
    assert [d.kept for d in report] == [False, True] and math.isnan(report.decisions[1].error_before)
    assert "unchecked" in report.decisions[1].note


def test_explain_prints_the_auto_steps_and_with_data_the_report(tmp_path, capsys):
    from qdsl.cli.main import main

    spec = tmp_path / "s.qspec.toml"
    spec.write_text('version = 1\n[defaults]\nweight = { kind = "int", bits = 3, granularity = "channel" }\n'
                    'input = { kind = "int", bits = 3, symmetric = false }\n'
                    'bias = { kind = "int", bits = 32, scale = "input*weight" }\n')
    assert main(["explain", str(spec), "--model", f"{TINY}:build"]) == 0
    out = capsys.readouterr().out
    assert "PTQ steps tried" in out and "gptq (auto at 3 bits)" in out and "on (auto at 3 bits)" in out
    assert "PTQ report" not in out
    assert main(["explain", str(spec), "--model", f"{TINY}:build", "--data", f"{TINY}:data"]) == 0
    out = capsys.readouterr().out
    assert "PTQ report" in out and "held-back error before -> after" in out
    assert out.count("bias_correction") >= 2
    assert main(["explain", str(spec), "--model", f"{TINY}:build", "--data", f"{TINY}:data",
                 "--format", "json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert {r["step"] for r in rec["ptq_report"]} == {"gptq", BIAS_CORRECTION}
    assert [s["layer"] for s in rec["ptq_steps"]] == ["0", "3"]


def test_shared_references_compute_a_layers_float_outputs_once():
    from qdsl.ptq.guard import shared_references

    model = Net().eval()
    qdsl.apply(model, _spec(3, 3, 'learned_rounding = "none"\nbias_correction = false'))
    x = torch.randn(64, 2, 8)
    qdsl.calibrate(model, [x])
    held = [x[:16]]
    with shared_references():
        a, b = LayerProbe(model, model.fc, held), LayerProbe(model, model.fc, list(held))
        assert a.ref is b.ref and a.error() == b.error()
    assert LayerProbe(model, model.fc, held).ref is not a.ref  # outside the block: recomputed


def test_per_channel_input_scales_calibrate_and_export_refuses_them_naming_the_spec_line():
    from qdsl.export.values import ExportError

    spec = parse_text("""version = 1
[defaults]
weight = { kind = "int", bits = 3, granularity = "channel" }
input = { kind = "int", bits = 3, symmetric = false, granularity = "channel" }
bias = { kind = "float" }
""", "pc.qspec.toml")
    model = nn.Sequential(nn.Conv1d(2, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(48, 3)).eval()
    x = torch.randn(64, 2, 8)
    qdsl.apply(model, spec)
    qdsl.calibrate(model, [x[:32], x[32:]])
    qdsl.freeze(model)
    assert qdsl.patch.get_handle(model).quantizer("0", "input").scale.shape[0] == 2  # one scale per channel
    with pytest.raises(ExportError, match=r"per-channel activation scales .* set by defaults \(pc\.qspec\.toml:4\)"):
        qdsl.export(model, x[:1])


def test_auto_leaves_learned_scale_layers_to_qat():
    spec = parse_text("""version = 1
[defaults]
weight = { kind = "int", bits = 3, granularity = "channel", scale = "learned" }
input = { kind = "int", bits = 3, symmetric = false }
bias = { kind = "int", bits = 32, scale = "input*weight" }
""", "l.qspec.toml")
    steps = layer_steps(resolve(Net(), spec))
    assert [s.steps for s in steps] == [(), ()] and "learned scale" in steps[0].learned_rounding_by


def test_qat_models_get_no_auto_step_and_entering_qat_drops_ptq_adjustments():
    from qdsl.quantizers import proxy_grad

    model = Net().eval()
    qdsl.apply(model, _spec(3, 3))
    x = torch.randn(128, 2, 8)
    qdsl.calibrate(model, [x[i : i + 32] for i in range(0, 128, 32)])
    handle = qdsl.patch.get_handle(model)
    kept = [d for d in qdsl.ptq.ptq_report(model) if d.kept]
    assert kept  # auto ran and kept something on this model
    proxy_grad.install(model)
    assert all(q.codes.numel() == 0 and q.offset.numel() == 0 for q in handle.container.quantizers.values())
    assert all(s.steps == () and "QAT" in s.learned_rounding_by for s in qdsl.ptq.pipeline.planned_steps(model))
    model.train()
    model(x[:8]).square().sum().backward()
    assert model.c.weight_float.grad is not None and model.c.weight_float.grad.abs().sum() > 0


def test_a_training_forward_drops_fixed_codes_so_the_weight_gets_a_gradient():
    model = Net().eval()
    qdsl.apply(model, _spec(3, 3, "bias_correction = false\nlearned_rounding = \"none\""))
    x = torch.randn(64, 2, 8)
    qdsl.calibrate(model, [x])
    wq = qdsl.patch.get_handle(model).quantizer("fc", "weight")
    with torch.no_grad():
        wq.set_codes(wq.int_repr(model.fc.weight_float).long())  # what learned rounding leaves
    assert wq.codes.numel() > 0
    with torch.no_grad():
        model(x)  # an eval forward keeps them
    assert wq.codes.numel() > 0
    model.train()
    model(x[:8]).square().sum().backward()
    assert wq.codes.numel() == 0 and model.fc.weight_float.grad.abs().sum() > 0


def test_a_single_calibration_batch_is_split_by_rows_so_the_steps_are_still_checked():
    model = Net().eval()
    qdsl.apply(model, _spec(3, 3))
    qdsl.calibrate(model, [torch.randn(64, 2, 8)])
    rep = qdsl.ptq.ptq_report(model)
    assert len(rep) == 4 and not any("unchecked" in d.note for d in rep)

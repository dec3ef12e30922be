"""Block reconstruction (``learned_rounding = adaround``): the soft-rounding pieces, the
block split, keep/revert on held-back data, and the codes reaching export and C++."""

import numpy as np
import pytest
import torch

import qdsl
from qdsl.parse import parse_text
from qdsl.patch import get_handle, int_tensors
from qdsl.ptq.adaround import (SoftRounding, beta_schedule, initial_logits, rectified_sigmoid,
                               rounding_regulariser)
from qdsl.ptq.reconstruct import STEP, find_blocks, reconstruct
from qdsl.ptq.report import PtqReport
from qdsl.zoo.data import digits
from qdsl.zoo.models import conv1d_net, digits_resnet

SPEC = """
version 1
fold_bn
{extra}
quantizer w = int(bits={bits}, signed, symmetric, per_channel, observer=auto)
quantizer a = int(bits={bits}, unsigned, symmetric, per_tensor, observer=auto)
defaults {{
  weight = w
  input = a
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}}
rule type:BasicBlock optional {{
  output = a
}}
"""


def _spec_text(bits, extra=""):
    # without a named step the auto policy would run GPTQ and bias correction at calibrate
    return SPEC.format(bits=bits, extra=extra or "learned_rounding = none\nbias_correction = false")


def _spec(bits, extra=""):
    return parse_text(_spec_text(bits, extra), "t.qspec")


def _calibrated(bits=2, extra=""):
    xtr, _, xte, _ = digits()
    model = digits_resnet(seed=0, width=8).eval()
    qdsl.apply(model, _spec(bits, extra))
    batches = [xtr[i : i + 32] for i in range(0, 128, 32)]
    qdsl.calibrate(model, batches, progress=False)
    return model, batches, xte


def _weighted(model):
    return {f: p for f, p in get_handle(model).layers.items() if p.wq is not None}


# ------------------------------------------------------------------ soft rounding
def test_rectified_sigmoid_is_clamped_and_inverted_by_the_initial_logits():
    v = torch.linspace(-20, 20, 101)
    h = rectified_sigmoid(v)
    assert float(h.min()) == 0.0 and float(h.max()) == 1.0
    rest = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(rectified_sigmoid(initial_logits(rest)), rest, atol=2e-4)


def test_regulariser_is_zero_on_hard_values_and_the_schedule_anneals():
    assert float(rounding_regulariser(torch.tensor([0.0, 1.0, 1.0]), 3.0)) == 0.0
    assert float(rounding_regulariser(torch.tensor([0.25]), 2.0)) == pytest.approx(0.75)
    betas = [beta_schedule(i, 100) for i in range(100)]
    assert betas[:20] == [None] * 20 and betas[20] == 20.0 and betas[-1] == 2.0
    assert all(a > b for a, b in zip(betas[20:], betas[21:]))


@pytest.mark.parametrize("per_channel", [True, False])
def test_soft_rounding_starts_at_the_weight_and_hardens_to_floor_or_ceiling(per_channel):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, 3, generator=g)
    scale = w.abs().amax((1, 2)) / 1.5 if per_channel else w.abs().max() / 1.5
    zp = torch.zeros(scale.shape, dtype=torch.int32)
    sr = SoftRounding(w, scale, zp, -2, 1, axis=0 if per_channel else None)
    s = scale.reshape(-1, 1, 1) if per_channel else scale
    inside = ((w / s) >= -2) & ((w / s) <= 1)
    assert torch.allclose(sr()[inside], w[inside], atol=1e-4)
    # every hard code is the floor or the ceiling of w/s (clamped), whatever V is
    with torch.no_grad():
        sr.v.copy_(torch.randn(sr.v.shape, generator=g) * 5)
    codes = sr.hard_codes()
    floor = torch.floor(w / s)
    assert bool((((codes == floor) | (codes == floor + 1)) | ~inside).all())
    assert int(codes.min()) >= -2 and int(codes.max()) <= 1
    # and the soft weight is differentiable in V
    sr().sum().backward()
    assert sr.v.grad is not None and bool(sr.v.grad.abs().sum() > 0)


# ----------------------------------------------------------------------- blocks
def _layers(model):
    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear))]


def test_blocks_are_residual_blocks_and_layer_activation_runs():
    resnet = digits_resnet(seed=0, width=8)
    blocks = find_blocks(resnet, _layers(resnet))
    assert [b.name for b in blocks] == ["stem", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "fc"]
    assert blocks[3].layers == ("layer2.0.conv1", "layer2.0.conv2", "layer2.0.downsample.0")
    chain = conv1d_net(seed=0)
    blocks = find_blocks(chain, _layers(chain))
    assert [b.name for b in blocks] == ["features.0..2", "features.3..5", "features.6..8", "classifier"]
    assert len(blocks[0].modules) == 3  # conv, BN, ReLU: the target is the activation's output
    # a smaller block size splits a residual block into its layers
    names = [b.name for b in find_blocks(resnet, _layers(resnet), max_layers=1)]
    assert names[:4] == ["stem", "layer1.0.conv1", "layer1.0.conv2", "layer1.1.conv1"]
    assert sorted(f for b in find_blocks(resnet, _layers(resnet), max_layers=1) for f in b.layers) == \
        sorted(_layers(resnet))


# ------------------------------------------------------------------ keep/revert
def test_reconstruction_lowers_held_back_error_and_stores_codes():
    model, batches, _ = _calibrated(2)
    flags = [p.requires_grad for p in model.parameters()]
    report = reconstruct(model, batches, iters=20, batch_size=32)
    # the fit leaves the model as it found it: no gradients, flags, hooks or paths changed
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    for patch in get_handle(model).layers.values():
        assert patch.acc_sim is None or patch.acc_sim.enabled
        assert all(q.grad_path is None for q in patch.proxies().values())
    assert isinstance(report, PtqReport) and len(report) == 6
    assert all(d.step == STEP for d in report)
    assert any(d.kept for d in report)
    from qdsl.ptq.layers import weighted_layers

    order = [f for f, _ in weighted_layers(model, batches)]
    first_layer = {b.layers[0]: b for b in find_blocks(model, order)}
    for d in report:
        block = first_layer[d.layer]
        for fqn in block.layers:
            codes = _weighted(model)[fqn].wq.codes
            assert (codes.numel() > 0) == d.kept
        assert (d.error_after < d.error_before) == d.kept
    qdsl.freeze(model)
    ints = int_tensors(model)
    for fqn, patch in _weighted(model).items():
        if patch.wq.codes.numel():
            assert torch.equal(ints[fqn].weight.to(torch.int64), patch.wq.codes)


def test_a_block_made_worse_is_reverted(monkeypatch):
    # rounding every weight up is worse than rounding to nearest on every block
    def always_up(self):
        return torch.clamp(self.floor + 1 + self.z, self.qmin, self.qmax).to(torch.int64)

    model, batches, xte = _calibrated(3)
    with torch.no_grad():
        before = model(xte[:64])
    monkeypatch.setattr(SoftRounding, "hard_codes", always_up)
    report = reconstruct(model, batches, iters=2)
    assert len(report) == 6 and not any(d.kept for d in report)
    assert all(d.error_after > d.error_before for d in report)
    assert all(p.wq.codes.numel() == 0 for p in _weighted(model).values())
    with torch.no_grad():
        assert torch.equal(model(xte[:64]), before)


def test_the_spec_setting_runs_it_and_returns_the_report(monkeypatch):
    import qdsl.ptq.rounding as rounding

    reports = []

    def short(model, batches, **kw):  # the dispatch's call, with fewer steps (test time)
        reports.append(reconstruct(model, batches, iters=5, **kw))
        return reports[-1]

    monkeypatch.setattr(rounding, "reconstruct", short)
    model, batches, _ = _calibrated(3, "learned_rounding = adaround")
    assert len(reports) == 1 and isinstance(reports[0], PtqReport)
    # one shared report: the blocks' decisions, then auto's bias correction per layer
    ada = reports[0].for_step("adaround")
    assert len(ada) == 6 and {d.step for d in reports[0]} <= {"adaround", "bias_correction"}
    kept = [d for d in ada if d.kept]
    assert kept and any(p.wq.codes.numel() for p in _weighted(model).values())
    assert isinstance(rounding.learn_rounding(model, batches, "adaround"), PtqReport)


def test_reconstruction_is_deterministic():
    runs = []
    for _ in range(2):
        model, batches, _ = _calibrated(2)
        reconstruct(model, batches, iters=10)
        runs.append({f: p.wq.codes.clone() for f, p in _weighted(model).items()})
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_export_and_cpp_agree_on_a_reconstructed_model():
    rt = pytest.importorskip("qdsl.runtime")
    if not rt.available():  # pragma: no cover - depends on the build
        pytest.skip(f"C++ runtime not built: {rt.load_error()}")
    from qdsl.export import export
    from qdsl.graph import execute
    from qdsl.runtime.run import run_graph

    model, batches, xte = _calibrated(3)
    report = reconstruct(model, batches, iters=20)
    assert any(d.kept for d in report)
    qdsl.freeze(model)
    graph = export(model, xte[:2])
    x = xte[:100].numpy()
    ref = execute(graph, x).outputs[0]
    np.testing.assert_array_equal(run_graph(graph, x, backend="cpp"), ref)
    # the graph computes what the fake-quant model computes (same argmax on nearly all)
    with torch.no_grad():
        fq = model(xte[:100]).argmax(1).numpy()
    assert (ref.argmax(1) == fq).mean() >= 0.97


def test_a_module_run_twice_per_forward_is_left_alone():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = torch.nn.Conv2d(2, 2, 3, padding=1)
            self.fc = torch.nn.Linear(2 * 16, 3)

        def forward(self, x):
            return self.fc(torch.relu(self.c(torch.relu(self.c(x)))).flatten(1))

    torch.manual_seed(0)
    model = Twice().eval()
    x = torch.randn(64, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    with pytest.warns(Warning, match="called more than once"):
        qdsl.apply(model, parse_text(_spec_text(3).replace("fold_bn", ""), "t.qspec"))
    batches = [x[i : i + 16] for i in range(0, 64, 16)]
    qdsl.calibrate(model, batches, progress=False)
    report = reconstruct(model, batches, iters=2, max_layers=1)
    shared = [d for d in report if d.layer == "c"]
    assert len(shared) == 1 and not shared[0].kept and "more than once" in shared[0].note
    assert get_handle(model).layers["c"].wq.codes.numel() == 0
    assert [d.layer for d in report] == ["c", "fc"]


def test_adaround_doctests():
    import doctest

    from qdsl.ptq import adaround

    result = doctest.testmod(adaround)
    assert result.attempted > 0 and result.failed == 0

"""GPTQ where the fit data is thin (fewer calibration positions than inputs): the damping
is searched on held-back data (qdsl.ptq.gptq.gptq_damped, qdsl.ptq.rounding), so GPTQ
helps there instead of being reverted by the held-back check."""

import pytest
import torch
from torch import nn

import qdsl
from qdsl.parse import parse_text
from qdsl.ptq import learn_rounding
from qdsl.ptq import gptq as G
from qdsl.ptq.gptq import HessianAccumulator, gptq_codes, gptq_damped, input_hessian
from qdsl.ptq.layers import float_mode, scales_fixed
from qdsl.ptq.rounding import DAMP_SEARCH_BELOW


@pytest.mark.parametrize("layer", ["linear", "grouped-conv", "wide"])
def test_each_damping_gives_the_codes_of_gptq_at_that_damping(layer, monkeypatch):
    """One permuted Hessian serves every candidate (its lower triangle restored from the
    upper one in between): candidate k equals a fresh gptq_codes at damps[k], bit for bit,
    from a caller's matrix (left unchanged) and from an accumulator."""
    g = torch.Generator().manual_seed(11)
    if layer == "wide":  # the cycle-walk permutation of matrices above FLOAT64_MAX_D
        monkeypatch.setattr(G, "FLOAT64_MAX_D", 8)
    if layer == "grouped-conv":
        module = nn.Conv2d(8, 6, 3, padding=1, groups=2)
        xs = [torch.randn(2, 8, 5, 5, generator=g) for _ in range(2)]
    else:
        module = nn.Linear(24, 6)
        xs = [torch.relu(torch.randn(10, 24, generator=g) @ torch.randn(24, 24, generator=g)) for _ in range(2)]
    w = module.weight.detach()
    s = w.reshape(6, -1).abs().amax(1) / 3
    z = torch.zeros(6)
    damps = (0.01, 0.1, 1.0, 10.0)
    want = [gptq_codes(w, input_hessian(module, xs), s, z, -4, 3, damp=d) for d in damps]
    assert not torch.equal(want[0], want[-1])  # the damping matters here
    h = input_hessian(module, xs)
    kept = h.clone()
    got = list(gptq_damped(w, h, s, z, -4, 3, damps))
    assert torch.equal(h, kept)
    assert [d for d, _ in got] == list(damps) and all(torch.equal(c, q) for (_, c), q in zip(got, want))
    acc = HessianAccumulator()
    for x in xs:
        acc.add(module, x)
    assert all(torch.equal(c, q) for (_, c), q in zip(gptq_damped(w, acc, s, z, -4, 3, damps), want))


def _spec():
    return parse_text(
        "version 1\nlearned_rounding = none\nbias_correction = false\n"
        "quantizer w3 = int(bits=3, signed, symmetric, per_channel, observer=minmax)\n"
        "defaults {\n  weight = w3\n}\n", "t.qspec")


def _thin_data(seed: int, d: int = 64):
    """Correlated non-negative inputs of unequal scales (like a ReLU layer's): 4 batches of
    8 rows (24 fit rows for 64 inputs, 8 held back), and 2000 unseen rows."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g) / d**0.5
    scales = torch.exp(torch.randn(d, generator=g))

    def data(n):
        return torch.relu(torch.randn(n, d, generator=g) @ mix) * scales

    return [data(8) for _ in range(4)], data(2000)


def _rounded(batches, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32)).eval()
    qdsl.apply(model, _spec())
    qdsl.calibrate(model, batches[:1], progress=False)
    with scales_fixed(model):
        out = learn_rounding(model, batches, **options)
    return model, out.report.decisions[0]


def _unseen_error(model, x):
    """The model's output error against its float self on data no step saw."""
    with torch.no_grad():
        y = model(x)
        with float_mode(model):
            return float((y - model(x)).pow(2).mean())


def test_gptq_with_fewer_positions_than_inputs_beats_nearest_rounding():
    batches, unseen = _thin_data(0)
    assert 24 < DAMP_SEARCH_BELOW * 64
    # at 1 % damping alone, GPTQ overfits the 24 rows and loses to nearest rounding on the
    # held-back ones: reverted, so the layer is nearest-rounded
    plain, d0 = _rounded(batches, search_damp=False)
    assert not d0.kept and d0.error_after > d0.error_before
    # with the search: kept, better than nearest rounding on the held-back rows, and on 2000
    # rows nothing saw
    searched, d1 = _rounded(batches, search_damp=True)
    assert d1.kept and d1.error_after < d1.error_before == d0.error_before
    assert d1.note.startswith("damp ") and "tried (24 fit positions for 64 inputs)" in d1.note
    assert _unseen_error(searched, unseen) < _unseen_error(plain, unseen)


def test_enough_positions_per_input_use_the_given_damping_alone():
    g = torch.Generator().manual_seed(12)
    batches = [torch.randn(16 * DAMP_SEARCH_BELOW, 8, generator=g) for _ in range(4)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4)).eval()
    qdsl.apply(model, _spec())
    qdsl.calibrate(model, batches[:1], progress=False)
    with scales_fixed(model):
        out = learn_rounding(model, batches)
    assert "damp" not in out.report.decisions[0].note

"""Blocked, in-place GPTQ (qdsl.ptq.gptq) against a plain per-column GPTQ written out here,
on every layer shape it serves, and learn_rounding's held-back check (keep GPTQ on a layer
only if it lowers that layer's output error on held-back batches)."""

import math

import pytest
import torch
from torch import nn

import qdsl
from qdsl.parse import parse_text
from qdsl.ptq import learn_rounding
from qdsl.ptq import gptq as G
from qdsl.ptq.gptq import HessianAccumulator, gptq_codes, input_hessian, unfold_inputs
from qdsl.ptq.layers import scales_fixed
from qdsl.ptq.report import PtqReport


def reference_gptq(w, h, s, z, qmin, qmax, act_order=True, damp=0.01):
    """GPTQ as in the paper, one column at a time, float64, explicit inverse: ``w`` [C, d],
    ``h`` [d, d], ``s``/``z`` [C, d] (each column's scale and zero point)."""
    w, h, s, z = w.double().clone(), h.double().clone(), s.double(), z.double()
    d = h.shape[0]
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(d)
    w, h, s, z = w[:, perm], h[perm][:, perm], s[:, perm], z[:, perm]
    h += damp * torch.diagonal(h).mean() * torch.eye(d, dtype=h.dtype)
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)  # H⁻¹ = Uᵀ U
    q = torch.empty_like(w)
    for i in range(d):
        q[:, i] = torch.clamp(torch.round(w[:, i] / s[:, i]) + z[:, i], qmin, qmax)
        err = (w[:, i] - (q[:, i] - z[:, i]) * s[:, i]) / u[i, i]
        w[:, i + 1 :] -= err[:, None] * u[i, i + 1 :][None, :]
    return q[:, torch.argsort(perm)].long()


def _columns_scale(s, c, d):
    """[] / [C] / [C, G] -> each column's value, [C, d]."""
    s = torch.as_tensor(s, dtype=torch.float64)
    if s.dim() == 0:
        return s.expand(c, d)
    if s.dim() == 1:
        return s[:, None].expand(c, d)
    return s.repeat_interleave(d // s.shape[1], dim=1)


def _reference_layer(module, xs, s, z, qmin, qmax, act_order=True):
    """Per conv group: H from the layer's im2col columns, then reference_gptq."""
    cols = torch.cat([unfold_inputs(module, x).double() for x in xs], dim=2)  # [g, d, n]
    g, d = cols.shape[0], cols.shape[1]
    w = module.weight.detach().reshape(module.weight.shape[0], -1)
    c = w.shape[0]
    per = c // g
    s_cols, z_cols = _columns_scale(s, c, d), _columns_scale(z, c, d)
    out = []
    for gi in range(g):
        h = cols[gi] @ cols[gi].T / cols.shape[2]
        r = slice(gi * per, (gi + 1) * per)
        out.append(reference_gptq(w[r], h, s_cols[r], z_cols[r], qmin, qmax, act_order))
    return torch.cat(out).reshape(module.weight.shape)


def _correlated(shape, g, channel_dim):
    """Random inputs whose channels (features) are mixed, so GPTQ has correlations to use."""
    x = torch.randn(*shape, generator=g)
    c = shape[channel_dim]
    mix = torch.randn(c, c, generator=g) / c**0.5 + torch.eye(c)
    return (x.movedim(channel_dim, -1) @ mix).movedim(-1, channel_dim)


CASES = {
    "linear": (lambda: nn.Linear(24, 6, bias=False), (64, 24), -1),
    "linear-3d-tokens": (lambda: nn.Linear(20, 5), (3, 17, 20), -1),  # (batch, tokens, features)
    "linear-4d": (lambda: nn.Linear(12, 4), (2, 3, 5, 12), -1),
    "linear-wide": (lambda: nn.Linear(300, 4), (4, 200, 300), -1),  # several Cholesky/sweep blocks
    "conv1d": (lambda: nn.Conv1d(4, 6, 5, padding=2), (3, 4, 30), 1),
    "conv1d-strided-dilated": (lambda: nn.Conv1d(3, 5, 3, stride=2, dilation=2, padding=1), (4, 3, 40), 1),
    "conv2d": (lambda: nn.Conv2d(3, 8, 3, padding=1), (4, 3, 9, 9), 1),
    "conv2d-grouped": (lambda: nn.Conv2d(4, 6, 3, padding="same", groups=2), (4, 4, 8, 8), 1),
    "conv2d-depthwise": (lambda: nn.Conv2d(3, 6, (3, 1), padding=(1, 0), groups=3), (5, 3, 8, 4), 1),
}


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_blocked_gptq_equals_the_per_column_reference(case, act_order):
    make, shape, channel_dim = CASES[case]
    torch.manual_seed(0)
    layer = make()
    g = torch.Generator().manual_seed(1)
    xs = [_correlated(shape, g, channel_dim) for _ in range(2)]
    w = layer.weight.detach()
    c = w.shape[0]
    s = w.reshape(c, -1).abs().amax(1) / 3
    acc = HessianAccumulator()
    for x in xs:
        acc.add(layer, x)
    # a small block so the lazy-batch updates between blocks are exercised
    got = gptq_codes(w, acc, s, torch.zeros(c), -4, 3, act_order=act_order, block=5)
    want = _reference_layer(layer, xs, s, torch.zeros(c), -4, 3, act_order)
    assert got.shape == w.shape
    assert torch.equal(got, want)
    assert acc.h is None  # the accumulator handed its matrix over (factorised in place)


@pytest.mark.parametrize("case", ["linear-3d-tokens", "conv2d", "conv2d-grouped"])
def test_group_wise_and_asymmetric_scales_match_the_reference(case):
    make, shape, channel_dim = CASES[case]
    torch.manual_seed(0)
    layer = make()
    g = torch.Generator().manual_seed(2)
    xs = [_correlated(shape, g, channel_dim)]
    w = layer.weight.detach()
    c, row = w.shape[0], w[0].numel()
    gs = next(k for k in (10, 9, 6, 5, 4, 3, 2) if row % k == 0 and k < row)
    wg = w.reshape(c, row // gs, gs)
    lo, hi = wg.amin(2), wg.amax(2)
    s = ((hi - lo) / 7).clamp(min=1e-6)  # unsigned 3-bit grid per group, zero point per group
    z = torch.round(-lo / s)
    h = input_hessian(layer, xs)
    got = gptq_codes(w, h, s, z, 0, 7, block=4)
    want = _reference_layer(layer, xs, s, z, 0, 7)
    assert torch.equal(got, want)
    assert int(got.min()) >= 0 and int(got.max()) <= 7


def test_float32_path_is_as_good_as_float64():
    """Wide layers run in float32: same codes as float64 but for a few near-ties, and the
    same output error."""
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(400, 16, bias=False)
    x = _correlated((2000, 400), g, -1)
    w = torch.randn(16, 400, generator=g)
    s = w.abs().amax(1) / 3
    q32 = gptq_codes(w, input_hessian(lin, [x]).float(), s, torch.zeros(16), -4, 3)
    acc = HessianAccumulator(torch.float32)
    acc.add(lin, x)
    assert acc.h.dtype == torch.float32
    assert torch.equal(gptq_codes(w, acc, s, torch.zeros(16), -4, 3), q32)
    q64 = gptq_codes(w, input_hessian(lin, [x]), s, torch.zeros(16), -4, 3)
    err = lambda q: float(((w.double() - q * s[:, None].double()) @ x.T.double()).pow(2).mean())  # noqa: E731
    assert (q32 != q64).float().mean() < 0.01
    assert err(q32) == pytest.approx(err(q64), rel=0.02)


def test_hessian_is_streamed_in_chunks(monkeypatch):
    """A tiny chunk limit (conv: one sample per im2col piece, Linear: a few rows) changes
    nothing but the order of additions; wide inputs accumulate in float32."""
    torch.manual_seed(0)
    for layer, x in [(nn.Conv2d(3, 4, 3, padding=1, groups=1), torch.randn(5, 3, 6, 6)),
                     (nn.Linear(7, 2), torch.randn(3, 11, 7))]:
        whole = input_hessian(layer, [x])
        monkeypatch.setattr(G, "_CHUNK_ELEMENTS", 40)
        monkeypatch.setattr(G, "_GRAM_BLOCK", 3)
        chunked = input_hessian(layer, [x])
        monkeypatch.undo()
        cols = unfold_inputs(layer, x).double()
        assert torch.allclose(chunked, whole) and torch.allclose(whole, cols @ cols.transpose(1, 2) / cols.shape[2])
    monkeypatch.setattr(G, "FLOAT64_MAX_D", 6)
    assert input_hessian(nn.Linear(7, 2), [torch.randn(4, 7)]).dtype == torch.float32


def test_in_place_symmetric_permutation(monkeypatch):
    g = torch.Generator().manual_seed(10)
    a = torch.randn(40, 40, generator=g)
    h = a @ a.T
    order = torch.randperm(40, generator=g)
    for limit in (2048, 0):  # the copy (small matrices) and the cycle walk (wide ones)
        monkeypatch.setattr(G, "FLOAT64_MAX_D", limit)
        m = h.clone()
        G._permute_symmetric_(m, order, 8)
        assert torch.equal(m, h[order][:, order])


def test_dead_inputs_keep_nearest_rounding_and_indefinite_hessians_get_more_damping():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(200, 10, generator=g)
    x[:, 3] = 0.0  # an input that is always zero
    lin = nn.Linear(10, 4, bias=False)
    w = torch.randn(4, 10, generator=g)
    s = w.abs().amax(1) / 3
    q = gptq_codes(w, input_hessian(lin, [x]), s, torch.zeros(4), -4, 3)
    assert torch.equal(q[:, 3], torch.clamp(torch.round(w[:, 3] / s), -4, 3).long())
    # numerically indefinite (a negative eigenvalue): retried with more damping, restored from
    # the untouched upper triangle in between
    a = torch.randn(300, 300, generator=g, dtype=torch.float64)
    h = a @ a.T
    h[250, 250] = -1.0
    w = torch.randn(3, 300, generator=g)
    q = gptq_codes(w, h, torch.ones(3), torch.zeros(3), -4, 3, damp=0.0)
    assert q.shape == (3, 300) and int(q.abs().max()) <= 4
    m = h.clone()
    base = torch.diagonal(m).clone()
    assert not G._cholesky_lower_(m, 64)
    G._restore_lower_(m, base, 64)
    assert torch.equal(m, h)


# ---------------------------------------------------------------- learn_rounding


def _spec(extra="", granularity="per_channel"):
    # the steps off: calibrate runs the observers only, the tests call learn_rounding themselves
    return parse_text(
        f"version 1\nlearned_rounding = none\nbias_correction = false\n{extra}\n"
        f"quantizer w3 = int(bits=3, signed, symmetric, {granularity}, observer=minmax)\n"
        "defaults {\n  weight = w3\n}\n", "t.qspec")


class Tokens(nn.Module):
    """A transformer-like pair of Linears on (batch, tokens, features)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _tokens(n, g, basis=None):
    """(n, 6 tokens, 16 features); with ``basis`` [3, 16] the features lie near its span."""
    x = torch.randn(n, 6, 16, generator=g)
    if basis is not None:  # inputs on a low-dimensional subspace plus a little noise
        x = torch.randn(n, 6, 3, generator=g) @ basis + 0.05 * x
    return x


def _calibrated(granularity="per_channel"):
    torch.manual_seed(0)
    model = Tokens().eval()
    qdsl.apply(model, _spec(granularity=granularity))
    return model


def _learn(model, batches):
    qdsl.calibrate(model, batches[:1], progress=False)
    with scales_fixed(model):
        return learn_rounding(model, batches)


def test_held_back_check_keeps_gptq_where_it_helps():
    g = torch.Generator().manual_seed(5)
    basis = torch.randn(3, 16, generator=g)
    batches = [_tokens(32, g, basis) for _ in range(4)]
    model = _calibrated()
    out = _learn(model, batches)
    assert isinstance(out.report, PtqReport)
    decisions = {d.layer: d for d in out.report}
    assert set(decisions) == {"a", "b"} and all(d.step == "gptq" for d in decisions.values())
    a = decisions["a"]
    assert a.kept and a.error_after < a.error_before
    assert out["a"] > 0  # codes moved away from nearest rounding, and are the ones in use
    assert qdsl.patch.get_handle(model).quantizer("a", "weight").codes.numel() == 32 * 16


def test_held_back_check_reverts_gptq_where_it_hurts():
    """Fitted on inputs confined to a 3-dimensional subspace, GPTQ pushes the rounding error
    into the other directions; held-back inputs that fill all 16 make that worse than nearest
    rounding, so the layer goes back to nearest rounding (and says so)."""
    g = torch.Generator().manual_seed(6)
    basis = torch.randn(3, 16, generator=g)
    batches = [_tokens(32, g, basis), _tokens(32, g, basis), _tokens(32, g, basis), _tokens(32, g)]
    model = _calibrated()
    wq = qdsl.patch.get_handle(model).quantizer("a", "weight")
    out = _learn(model, batches)
    a = next(d for d in out.report if d.layer == "a")
    assert not a.kept and a.error_after > a.error_before > 0
    assert out["a"] == 0.0 and wq.codes.numel() == 0  # nearest rounding, as before the step
    assert "a" in out.report.format()


def test_without_held_back_data_gptq_is_kept_unchecked():
    g = torch.Generator().manual_seed(7)
    model = _calibrated()
    qdsl.calibrate(model, [_tokens(32, g)], progress=False)
    with scales_fixed(model):
        out = learn_rounding(model, [_tokens(32, g)], heldback=False)
    assert all(d.kept and math.isnan(d.error_before) and d.note == "held-back check off: kept unchecked" for d in out.report)
    shared = PtqReport()
    with scales_fixed(model):
        again = learn_rounding(model, [{"x": _tokens(8, g)}])  # one kwargs batch: cannot be split
    assert all(d.note == "no held-back data: kept unchecked" for d in again.report)
    with scales_fixed(model):
        learn_rounding(model, [_tokens(32, g) for _ in range(2)], report=shared)
    assert len(shared) == 2


def test_group_wise_weight_scales_through_learn_rounding():
    g = torch.Generator().manual_seed(8)
    basis = torch.randn(3, 16, generator=g)
    batches = [_tokens(32, g, basis) for _ in range(4)]
    model = _calibrated("granularity=group(8)")
    out = _learn(model, batches)
    handle = qdsl.patch.get_handle(model)
    wq = handle.quantizer("a", "weight")
    assert wq.group_size == 8 and out.report.for_step("gptq")
    with torch.no_grad():
        w = model.a.weight.clone()  # the fake-quantized weight the model now uses
    scale, zp, _ = wq.qparams(handle.layers["a"].float_params()[0])
    assert scale.shape == (32, 2)
    codes = wq.codes if wq.codes.numel() else wq.int_repr(handle.layers["a"].float_params()[0]).long()
    assert torch.equal(w, (codes.float().reshape(32, 2, 8) * scale[:, :, None]).reshape(32, 16))


class Attention(nn.Module):
    """query/key/value read the same tensor; out reads their combination."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / 4, dim=-1)
        return self.out(a @ self.v(x))


def test_layers_reading_one_input_share_a_pass(monkeypatch):
    """q, k and v get their Hessians from one pass over the batches (2 passes for the 4
    layers instead of 4), and the codes are those of one pass per layer.  A pass is counted
    where it happens: each forward of the model itself (a hook on the root module), each
    batch of each pass once, whoever runs it."""
    from qdsl.ptq import rounding

    g = torch.Generator().manual_seed(9)
    basis = torch.randn(3, 16, generator=g)
    batches = [_tokens(16, g, basis) for _ in range(4)]
    codes = {}
    for grouped in (True, False):
        torch.manual_seed(0)
        model = Attention().eval()
        qdsl.apply(model, _spec())
        qdsl.calibrate(model, batches[:1], progress=False)
        if not grouped:
            monkeypatch.setattr(rounding, "_shared_input_groups", lambda m, layers, b: [[lp] for lp in layers])
        forwards = []
        hook = model.register_forward_pre_hook(lambda m, args: forwards.append(1))
        with scales_fixed(model):
            out = learn_rounding(model, batches)
        hook.remove()
        monkeypatch.undo()
        # per group: the 3 fit batches and the 1 held-back batch; plus one float forward of
        # the first batch for the execution order and, grouped, one to find shared inputs
        assert len(forwards) == (2 * 4 + 2 if grouped else 4 * 4 + 1)
        handle = qdsl.patch.get_handle(model)
        codes[grouped] = {f: handle.quantizer(f, "weight").codes.clone() for f in out}
        assert [d.layer for d in out.report] == ["q", "k", "v", "out"]
    assert any(c.numel() for c in codes[True].values())
    assert all(torch.equal(codes[True][f], codes[False][f]) for f in codes[True])

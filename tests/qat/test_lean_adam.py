"""qdsl.qat.LeanAdam: packed-code QAT with the update in backward (and qdsl.qat.lean_state)."""

import doctest

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qdsl import calibrate, freeze
from qdsl.export import export
from qdsl.parse import parse_text
from qdsl.patch import apply, get_handle, remove
from qdsl.patch.ints import int_tensors
from qdsl.qat import LeanAdam, lean_state
from qdsl.qat.lean_state import (BLOCK, BlockQuantized, pack_rows, packed_cols, round_bf16_stochastic,
                                 stochastic_codes, unpack_rows)
from qdsl.quantizers import proxy_grad
from qdsl.runtime.run import run_graph
from qdsl.spec.diagnostics import QdslError, SpecError
from qdsl.zoo.models import mlp

W4 = """version 1
defaults {
  weight = int(bits=4, signed, narrow, symmetric, per_channel, observer=minmax)
  input = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
"""
EXACT = dict(master="fp32", grad_dtype=torch.float32, state_bits=32)


def _data(n=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)


def _applied(x, text=W4, sizes=(64, 48, 32, 10)):
    model = mlp(seed=0, sizes=sizes)
    apply(model, parse_text(text, "w4.qspec"))
    calibrate(model, [x[:32], x[32:64]])
    proxy_grad.install(model)  # the normal QAT path (LeanAdam installs it too)
    return model.train()


def _step(model, opt, x, y, i, grad_hook=None):
    idx = slice(i * 16 % 80, i * 16 % 80 + 16)
    opt.zero_grad()
    loss = F.cross_entropy(model(x[idx]), y[idx])
    loss.backward()
    if grad_hook is not None:
        grad_hook(model)
    opt.step()
    return loss.item()


def _masters(model, opt=None):
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for fqn, lay in (opt.layers.items() if opt is not None else ()):
        out[fqn + ".weight_float"] = lay.master.float().clone()
    return out


# ---------------------------------------------------------------- lean_state
def test_lean_state_doctests():
    res = doctest.testmod(lean_state)
    assert res.attempted >= 8 and res.failed == 0


@pytest.mark.parametrize("qmin,qmax,cols", [(-7, 7, 9), (-8, 7, 10), (0, 15, 1), (0, 255, 5), (-127, 127, 7), (-1, 1, 3)])
def test_pack_rows_round_trip(qmin, qmax, cols):
    codes = torch.randint(qmin, qmax + 1, (5, cols))
    packed = pack_rows(codes, qmin, qmax)
    assert packed.dtype == torch.uint8
    assert packed.shape == (5, packed_cols(cols, qmin, qmax))
    assert packed.shape[1] == ((cols + 1) // 2 if qmax - qmin < 16 else cols)
    assert torch.equal(unpack_rows(packed, cols, qmin, qmax).long(), codes)
    # a row block is a slice of the packed rows
    assert torch.equal(unpack_rows(packed[2:4], cols, qmin, qmax, torch.float32), codes[2:4].float())


@pytest.mark.parametrize("signed", [True, False])
def test_block_quantized_round_trip(signed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2 * BLOCK + 37, generator=g) * torch.logspace(-6, 0, 6).unsqueeze(1)
    if not signed:
        x = x.square()
    x[0, :10] = 0.0
    s = BlockQuantized(*x.shape, signed=signed)
    s.write(0, 3, x[:3])
    s.write(3, 6, x[3:])
    r = s.read(0, 6)
    assert s.nbytes() == 6 * 3 * BLOCK + 6 * 3 * 4  # 8-bit codes (rows padded to blocks) + absmax
    # error bound of the square-root (signed) / fourth-root (non-negative) companding: below
    # 0.8% of the block's largest magnitude; zeros and each block's largest value are exact
    blocks = torch.nn.functional.pad(x, (0, 3 * BLOCK - x.shape[1])).reshape(6, 3, BLOCK)
    amax = blocks.abs().amax(2).repeat_interleave(BLOCK, 1)[:, :x.shape[1]]
    assert bool(((r - x).abs() <= 0.008 * amax + 1e-30).all())
    assert bool((r[0, :10] == 0).all())
    top = x.abs().reshape(-1).argmax()
    assert r.reshape(-1)[top] == x.reshape(-1)[top]
    # re-encoding decoded values keeps them (codes are a fixed point)
    s2 = BlockQuantized(*x.shape, signed=signed)
    s2.write(0, 6, r)
    assert torch.equal(s2.codes, s.codes)
    torch.testing.assert_close(s2.read(0, 6), r, rtol=1e-6, atol=0)


def test_stochastic_rounding_is_unbiased_and_on_grid():
    g = torch.Generator().manual_seed(0)
    x = torch.full((50000,), 0.3) + torch.rand(50000, generator=g) * 1e-3
    b = round_bf16_stochastic(x, g)
    assert b.dtype == torch.bfloat16
    lo, hi = x.to(torch.bfloat16).float().min(), x.to(torch.bfloat16).float().max()
    assert abs(float(b.float().mean() - x.mean())) < 2e-5  # nearest rounding is biased by ~5e-4 here
    assert float(b.float().min()) >= float(lo) - 2e-3 and float(b.float().max()) <= float(hi) + 2e-3
    c = stochastic_codes(torch.full((50000,), -1.3), g)
    assert set(c.unique().tolist()) == {-2.0, -1.0}
    assert abs(float(c.mean()) + 1.3) < 0.01


# ------------------------------------------------------------- equivalence
def test_fp32_master_matches_normal_qat_with_torch_adam():
    x, y = _data()
    ref = _applied(x)
    ref_opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    lean = _applied(x)
    opt = LeanAdam(lean, lr=1e-2, **EXACT)
    assert set(opt.layers) == {"net.1", "net.3", "net.5"} and not opt.skipped
    assert all(lay.track for lay in opt.layers.values())
    ref_losses = [_step(ref, ref_opt, x, y, i) for i in range(5)]
    losses = [_step(lean, opt, x, y, i) for i in range(5)]
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    ours, theirs = _masters(lean, opt), _masters(ref)
    assert set(ours) == set(theirs)
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-6, atol=1e-7)


def test_weight_decay_is_adamw():
    x, y = _data()
    ref = _applied(x)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    lean = _applied(x)
    opt = LeanAdam(lean, lr=1e-2, weight_decay=0.1, **EXACT)
    ref_losses = [_step(ref, ref_opt, x, y, i) for i in range(4)]
    assert [_step(lean, opt, x, y, i) for i in range(4)] == pytest.approx(ref_losses, rel=1e-6)
    for k, v in _masters(ref).items():
        torch.testing.assert_close(_masters(lean, opt)[k], v, rtol=1e-6, atol=1e-7)


def test_bf16_gradients_are_the_fp32_gradients_rounded():
    # the reference: normal QAT whose weight gradients are rounded to bfloat16 before Adam
    def round_weight_grads(model):
        for n, p in model.named_parameters():
            if n.endswith("weight_float"):
                p.grad = p.grad.to(torch.bfloat16).float()

    x, y = _data()
    ref = _applied(x)
    ref_opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    lean = _applied(x)
    opt = LeanAdam(lean, lr=1e-2, master="fp32", grad_dtype=torch.bfloat16, state_bits=32)
    ref_losses = [_step(ref, ref_opt, x, y, i, round_weight_grads) for i in range(4)]
    assert [_step(lean, opt, x, y, i) for i in range(4)] == pytest.approx(ref_losses, rel=1e-6)
    for k, v in _masters(ref).items():
        torch.testing.assert_close(_masters(lean, opt)[k], v, rtol=1e-6, atol=1e-7)


def test_row_blocks_do_not_change_the_result():
    x, y = _data()
    whole, blocks = _applied(x), _applied(x)
    o1 = LeanAdam(whole, lr=1e-3, **EXACT)
    o2 = LeanAdam(blocks, lr=1e-3, chunk=200, **EXACT)  # 3-4 rows per block, a short last one
    assert o2.layers["net.1"].step_rows == 3
    l1 = [_step(whole, o1, x, y, i) for i in range(3)]
    l2 = [_step(blocks, o2, x, y, i) for i in range(3)]
    # the same arithmetic summed in another order: float rounding only
    assert l2 == pytest.approx(l1, rel=1e-4)


@pytest.mark.parametrize("kw", [{}, {"master": "none"}, {"master": "fp32", "state_bits": 8}, {"scale": "fixed"}])
def test_lean_variants_train(kw):
    x, y = _data()
    model = _applied(x)
    opt = LeanAdam(model, lr=1e-2, **kw)
    before = {k: lay.codes.clone() for k, lay in opt.layers.items()}
    losses = [_step(model, opt, x, y, i) for i in range(10)]
    assert sum(losses[-3:]) < sum(losses[:3])
    assert all(not torch.equal(before[k], lay.codes) for k, lay in opt.layers.items())
    assert not any(n.endswith("weight_float") for n, _ in model.named_parameters())


def test_bytes_held_per_weight():
    x, _ = _data()
    n_w = 64 * 48 + 48 * 32 + 32 * 10
    chans = 48 + 32 + 10
    blocks = 48 + 32 + 10  # one 256-value block per row (rows are shorter than a block)
    for kw, per_weight in (({}, 0.5 + 2), ({"master": "none"}, 0.5), ({"master": "fp32"}, 0.5 + 4)):
        opt = LeanAdam(_applied(x), **kw)
        moments = 2 * (blocks * BLOCK + blocks * 4)
        assert opt.nbytes() == int(per_weight * n_w) + 8 * chans + moments
    opt = LeanAdam(_applied(x), **EXACT)
    assert opt.nbytes() == (0.5 + 4 + 8) * n_w + 8 * chans


# -------------------------------------------------- apply(..., materialize=False)
def _lazy_lean(x, sizes=(64, 48, 32, 10), **kw):
    model = mlp(seed=0, sizes=sizes)
    apply(model, parse_text(W4, "w4.qspec"), materialize=False)
    opt = LeanAdam(model, lr=1e-2, **kw)
    calibrate(model, [x[:32], x[32:64]])
    return model.train(), opt


@pytest.mark.parametrize("kw", [{}, {"master": "none"}, EXACT], ids=["defaults", "none", "exact"])
def test_lazily_applied_model_trains_as_the_eager_one(kw):
    x, y = _data()
    eager = mlp(seed=0, sizes=(64, 48, 32, 10))
    apply(eager, parse_text(W4, "w4.qspec"))
    o1 = LeanAdam(eager, lr=1e-2, **kw)
    calibrate(eager, [x[:32], x[32:64]])
    eager.train()
    lazy, o2 = _lazy_lean(x, **kw)
    assert [_step(eager, o1, x, y, i) for i in range(4)] == [_step(lazy, o2, x, y, i) for i in range(4)]
    for k, lay in o1.layers.items():
        assert torch.equal(lay.codes, o2.layers[k].codes) and torch.equal(lay.scale, o2.layers[k].scale)
    o1.finish(), o2.finish()
    freeze(eager), freeze(lazy)
    eager.eval(), lazy.eval()
    with torch.no_grad():
        assert torch.equal(eager(x), lazy(x))


def test_lean_form_of_a_lazily_applied_model_holds_no_float_weight():
    import gc

    x, y = _data()
    model, opt = _lazy_lean(x, sizes=(64, 45, 29, 11))  # shapes no other test's tensors have
    _step(model, opt, x, y, 0)
    gc.collect()
    for fqn, lay in opt.layers.items():
        full = lay.rows * lay.cols * 4
        alive = [t for t in gc.get_objects() if type(t) in (torch.Tensor, nn.Parameter) and t.shape == (lay.rows, lay.cols)]
        # the bf16 master, and the stride-0 stand-in nn.Linear sees: no fp32 copy of the weight
        assert {t.dtype for t in alive if t.untyped_storage().nbytes() >= full // 2} == {torch.bfloat16}
        assert all(t.untyped_storage().nbytes() < full for t in alive)
    assert not any(n.endswith("weight_float") for n, _ in model.named_parameters())


# ------------------------------------------------------------ calibration, export
def test_calibrating_in_lean_form_observes_the_float_network():
    x, _ = _data()
    spec = parse_text(W4, "w4.qspec")
    normal = mlp(seed=0, sizes=(64, 48, 32, 10))
    apply(normal, spec)
    calibrate(normal, [x[:32]])
    proxy_grad.install(normal)  # QAT drops calibrate's PTQ adjustments (auto GPTQ, bias correction)
    lean = mlp(seed=0, sizes=(64, 48, 32, 10))
    apply(lean, spec)
    opt = LeanAdam(lean, master="fp32")  # before calibration: no fake-quantized copies at all
    calibrate(lean, [x[:32]])
    for fqn in ("net.3", "net.5"):
        a, b = get_handle(normal).layers[fqn].iq.observer, get_handle(lean).layers[fqn].iq.observer
        assert torch.equal(a.min_val, b.min_val) and torch.equal(a.max_val, b.max_val)
    normal.eval(), lean.eval()
    with torch.no_grad():
        torch.testing.assert_close(lean(x), normal(x), rtol=1e-5, atol=1e-6)
    assert opt.layers["net.1"].module.__dict__["weight"].stride() == (0, 0)  # no fp32 copy kept


def test_export_after_lean_steps_keeps_the_codes():
    x, y = _data()
    model = _applied(x)
    opt = LeanAdam(model, lr=1e-2)
    for i in range(3):
        _step(model, opt, x, y, i)
    with pytest.raises(QdslError, match="finish"):
        freeze(model)
    with pytest.raises(QdslError, match="finish"):
        remove(model)
    codes = {k: unpack_rows(lay.codes, lay.cols, lay.qmin, lay.qmax).long() for k, lay in opt.layers.items()}
    model.eval()
    with torch.no_grad():
        lean_out = model(x)
    opt.finish()
    with pytest.raises(QdslError, match="finished"):
        opt.step()
    with torch.no_grad():
        torch.testing.assert_close(model(x), lean_out, rtol=1e-6, atol=1e-6)
    freeze(model)
    ints = int_tensors(model)
    for k, c in codes.items():
        assert torch.equal(ints[k].weight.long(), c)  # the trained codes are the exported weights
    graph = export(model, x[:4])
    with torch.no_grad():
        expected = model(x[:8])
    out = torch.as_tensor(run_graph(graph, x[:8], backend="reference"), dtype=torch.float32)
    torch.testing.assert_close(out, expected, rtol=0, atol=float(expected.abs().max()) * 0.05)


def test_finish_without_freezing_weights_returns_float_weights():
    x, y = _data()
    model = _applied(x)
    opt = LeanAdam(model, lr=1e-2)
    _step(model, opt, x, y, 0)
    lay = opt.layers["net.3"]
    deq = lay.dequantize(0, lay.rows)
    opt.finish(freeze_weights=False)
    assert torch.equal(model.net[3].weight_float.detach(), deq)
    assert not get_handle(model).layers["net.3"].wq.frozen
    _step(model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad]), x, y, 1)  # normal QAT again


# -------------------------------------------------------------------- errors
def test_unsupported_layers_are_located_errors():
    x, _ = _data()
    text = W4 + "rule net.3 { weight = binary(bits=1, signed, per_channel) }\n"
    model = _applied(x, text)
    with pytest.raises(SpecError) as err:
        LeanAdam(model)
    assert err.value.codes == ["E520"]
    msg = str(err.value)
    assert "net.3" in msg and "binary" in msg and "w4.qspec:7" in msg
    opt = LeanAdam(model, skip_unsupported=True)
    assert set(opt.layers) == {"net.1", "net.5"} and set(opt.skipped) == {"net.3"}

    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return self.conv(x)

    conv = Conv()
    apply(conv, parse_text(W4, "w4.qspec"))
    with pytest.raises(SpecError, match="nn.Linear weights, not Conv2d"):
        LeanAdam(conv)
    learned = _applied(x, W4.replace("observer=minmax)\n  input", "scale=learned, observer=minmax)\n  input"))
    with pytest.raises(SpecError, match="learned weight scale"):
        LeanAdam(learned)
    with pytest.raises(QdslError, match="master must be"):
        LeanAdam(_applied(x), master="fp16")


def test_shared_layers_and_second_backward_are_errors():
    x, y = _data()
    model = _applied(x)
    opt = LeanAdam(model, lr=1e-2)
    with pytest.raises(QdslError, match="already in lean form"):
        LeanAdam(model)
    model(x[:8])
    with pytest.raises(QdslError, match="ran twice"):
        model(x[:8])  # a second training forward before step(): a shared layer / accumulation
    opt.step()
    loss = F.cross_entropy(model(x[:8]), y[:8])
    loss.backward(retain_graph=True)
    with pytest.raises(QdslError, match="second backward"):
        loss.backward()
    opt.step()
    with torch.no_grad():  # evaluation between steps is fine
        model(x[:8])
    _step(model, opt, x, y, 0)

    tied = _applied(x, sizes=(64, 64, 64, 10))
    tied.net[3]._parameters["weight_float"] = tied.net[1]._parameters["weight_float"]
    with pytest.raises(SpecError, match="tied weights"):
        LeanAdam(tied)


def test_bundled_w4a8_spec_trains_with_its_searched_scale_fixed():
    from pathlib import Path

    from qdsl.parse import load_spec

    x, y = _data()
    model = mlp(seed=0, sizes=(64, 48, 32, 10))
    apply(model, load_spec(Path(__file__).resolve().parents[2] / "specs" / "w4a8-per-channel.qspec"))
    opt = LeanAdam(model, lr=1e-2)  # the mse-searched weight scale: kept (scale="auto" -> fixed)
    calibrate(model, [x[:32], x[32:64]])
    model.train()
    assert not any(lay.track for lay in opt.layers.values())
    with pytest.raises(QdslError, match="minmax"):
        LeanAdam(_applied(x, W4.replace("observer=minmax)\n  input", "observer=mse)\n  input")), scale="track")
    losses = [_step(model, opt, x, y, i) for i in range(10)]
    assert sum(losses[-3:]) < sum(losses[:3])

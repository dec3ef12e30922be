"""qdsl.qat.lean: packed low-bit weights train exactly like the normal QAT path, in less memory."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qdsl.export import export
from qdsl.runtime.run import run_graph
from qdsl.parse import load_spec, parse_text
from qdsl import calibrate, freeze
from qdsl.patch import apply, get_handle, remove
from qdsl.qat.lean import LeanOptimizer, pack_codes, unpack_codes, weight_bytes
from qdsl.quantizers import proxy_grad
from qdsl.spec.diagnostics import QdslError
from qdsl.zoo.models import mlp

SPECS = Path(__file__).resolve().parents[2] / "specs"

W8 = """version 1
defaults {
  weight = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
  input = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
"""


W8_ASYM = W8.replace("signed, narrow, symmetric, per_channel", "unsigned, asymmetric, per_tensor")
W8_LEARNED = W8.replace("observer=minmax)\n  input", "scale=learned, observer=minmax)\n  input")
SPEC_TEXTS = {"w8": W8, "w8asym": W8_ASYM, "w8learned": W8_LEARNED}


def _spec(name):
    if name == "w4a8":
        return load_spec(SPECS / "w4a8-per-channel.qspec")
    return parse_text(SPEC_TEXTS[name], f"{name}.qspec")


def _data(n=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)


def _applied(spec, x):
    model = mlp(seed=0, sizes=(64, 48, 32, 10))
    apply(model, spec)
    calibrate(model, [x[:32], x[32:64]])
    proxy_grad.install(model)  # the normal QAT path (LeanOptimizer installs it too)
    return model.train()


def _train(model, opt, x, y, steps=6, accumulate=1):
    losses = []
    for i in range(steps):
        opt.zero_grad()
        total = 0.0
        for j in range(accumulate):
            idx = slice((i * 16 + j * 8) % 80, (i * 16 + j * 8) % 80 + 16)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize("spec_name", ["w4a8", "w8", "w8asym", "w8learned"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_lean_training_matches_normal_qat(spec_name, accumulate):
    spec = _spec(spec_name)
    x, y = _data()
    # Accumulated gradients reach the master as mask·(g1 + g2) here, mask·g1 + mask·g2 in
    # the normal path: equal up to float rounding, which Adam's normalisation of tiny
    # (learned-scale) gradients amplifies past 1e-5; SGD keeps it at rounding level.
    opt_cls, kw = ((torch.optim.Adam, {"lr": 1e-2}) if accumulate == 1
                   else (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))
    ref = _applied(spec, x)
    ref_opt = opt_cls([p for p in ref.parameters() if p.requires_grad], **kw)
    ref_losses = _train(ref, ref_opt, x, y, accumulate=accumulate)

    lean = _applied(spec, x)
    opt = LeanOptimizer(lean, opt_cls, **kw)
    assert set(opt.layers) == {"net.1", "net.3", "net.5"} and not opt.skipped
    losses = _train(lean, opt, x, y, accumulate=accumulate)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert losses[-1] < losses[0]  # it trains

    lean.eval()
    with torch.no_grad():
        lean_out = lean(x)
    opt.finish()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(lean(x), ref(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lean_out, ref(x), rtol=1e-5, atol=1e-5)
    assert len(list(lean.named_parameters())) == len(list(ref.named_parameters()))
    for (name, p), (rname, rp) in zip(lean.named_parameters(), ref.named_parameters()):
        assert name == rname
        torch.testing.assert_close(p, rp, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec_name,factor", [("w4a8", 16), ("w8", 8)])
def test_module_resident_weight_memory_shrinks(spec_name, factor):
    spec = _spec(spec_name)
    x, y = _data()
    model = _applied(spec, x)
    with torch.no_grad():
        model(x[:4])
    normal, _ = weight_bytes(model)
    n_weights = 64 * 48 + 48 * 32 + 32 * 10
    assert normal == 8 * n_weights  # fp32 master + fp32 fake-quantized weight
    opt = LeanOptimizer(model, torch.optim.SGD, lr=0.1)
    _train(model, opt, x, y, steps=2)
    module, masters = weight_bytes(model, opt)
    assert masters == 4 * n_weights
    scales = 4 * (48 + 32 + 10) + 4 * 3  # per-channel fp32 scale + one int32 zero point per layer
    assert module == 8 * n_weights // factor + scales
    assert normal / module > factor * 0.8
    # master parameters are off the module: only the optimizer holds them
    assert not any(n.endswith("weight_float") for n, _ in model.named_parameters())


def test_freeze_and_remove_need_finish_then_export_works():
    x, y = _data()
    model = _applied(load_spec(SPECS / "w4a8-per-channel.qspec"), x)
    opt = LeanOptimizer(model, torch.optim.SGD, lr=0.05)
    _train(model, opt, x, y, steps=2)
    with pytest.raises(QdslError, match="finish"):
        freeze(model)
    with pytest.raises(QdslError, match="finish"):
        remove(model)
    lean_state = model.state_dict()
    opt.finish()
    state = model.state_dict()
    assert set(lean_state) == set(state)
    assert all(torch.equal(lean_state[k], state[k]) for k in state)
    with pytest.raises(QdslError, match="finished"):
        opt.step()
    model.eval()
    freeze(model)
    graph = export(model, x[:4])
    with torch.no_grad():
        expected = model(x[:8])
    out = torch.as_tensor(run_graph(graph, x[:8], backend="reference"), dtype=torch.float32)
    torch.testing.assert_close(out, expected, rtol=0, atol=float(expected.abs().max()) * 0.05)


def test_lean_refuses_models_without_eligible_layers_and_double_wrapping():
    x, _ = _data()
    binary = parse_text("version 1\ndefaults { weight = binary(signed, per_channel) }\n", "b.qspec")
    model = mlp(seed=0, sizes=(64, 10))
    apply(model, binary)
    with pytest.raises(QdslError, match="no layer can keep lean weights"):
        LeanOptimizer(model, torch.optim.SGD, lr=0.1)
    model2 = _applied(load_spec(SPECS / "w4a8-per-channel.qspec"), x)
    LeanOptimizer(model2, torch.optim.SGD, lr=0.1)
    with pytest.raises(QdslError, match="already in lean form"):
        LeanOptimizer(model2, torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("qmin,qmax,n", [(-7, 7, 9), (-8, 7, 10), (0, 255, 5), (-127, 127, 7), (-1, 1, 3)])
def test_pack_roundtrip(qmin, qmax, n):
    codes = torch.randint(qmin, qmax + 1, (n,))
    packed = pack_codes(codes, qmin, qmax)
    assert packed.dtype == torch.uint8
    assert packed.numel() == (n if qmax - qmin > 15 else (n + 1) // 2)
    assert torch.equal(unpack_codes(packed, n, qmin, qmax).long(), codes)


def test_lean_state_dict_round_trip():
    x, y = _data()
    spec = _spec("w4a8")
    trained = _applied(spec, x)
    opt = LeanOptimizer(trained, torch.optim.SGD, lr=0.1)
    _train(trained, opt, x, y, steps=3)
    fresh = _applied(spec, x)
    fresh_opt = LeanOptimizer(fresh, torch.optim.SGD, lr=0.1)
    fresh.load_state_dict(trained.state_dict())
    trained.eval()
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(x), trained(x))
        assert fresh.net[1].__dict__["weight"] is None  # inference keeps no fp32 copy
    fresh_opt.finish()
    opt.finish()
    with torch.no_grad():
        assert torch.equal(fresh(x), trained(x))

"""nn.MultiheadAttention under qdsl.apply (qdsl.patch.attention): its in_proj weight and
bias per q/k/v slice, its input, q, k, v, scores and probs quantized through hooks on the
unmodified module; out_proj patched as a Linear."""

import warnings

import pytest
import torch
from torch import nn

import qdsl
from qdsl.patch import get_handle
from qdsl.ptq.layers import float_mode
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.model import Role
from patch_helpers import same_state, snapshot, spec

W8A8 = """version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
quantizer s8 = int(bits=8, signed, asymmetric, per_tensor, observer=minmax)
defaults {
  weight = w8
  input = s8
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
rule type:MultiheadAttention optional { probs = a8 }
"""


def _apply(model, text=W8A8, **kw):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        handle = qdsl.apply(model, spec(text), **kw)
    floats = [w for w in rec if getattr(w.message, "coverage", None) is not None and w.message.coverage.floats]
    assert not floats, floats[0].message
    return handle


class Cross(nn.Module):
    """An MHA as a child, called with the query and a different memory tensor."""

    def __init__(self, batch_first):
        super().__init__()
        self.attn = nn.MultiheadAttention(12, 3, batch_first=batch_first)

    def forward(self, x, mem, **kw):
        return self.attn(x, mem, mem, **kw)


class Self(nn.Module):
    """Self-attention in a model (calibrate forwards one tensor per batch)."""

    def __init__(self, e, heads, **kw):
        super().__init__()
        self.attn = nn.MultiheadAttention(e, heads, batch_first=True, **kw)

    def forward(self, x):
        return self.attn(x, x, x)


def _masks(n, heads, length, s, kind):
    g = torch.Generator().manual_seed(1)
    if kind == "none":
        return {}
    if kind == "bool-causal":
        return {"attn_mask": torch.triu(torch.ones(length, s, dtype=torch.bool), 1)}
    if kind == "float-3d":
        return {"attn_mask": torch.randn(n * heads, length, s, generator=g)}
    if kind == "kpm-bool":
        kpm = torch.zeros(n, s, dtype=torch.bool)
        kpm[:, -2:] = True
        return {"key_padding_mask": kpm}
    if kind == "kpm-float+mask":
        return {"key_padding_mask": torch.randn(n, s, generator=g), "attn_mask": torch.randn(length, s, generator=g)}
    raise AssertionError(kind)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "bool-causal", "float-3d", "kpm-bool", "kpm-float+mask"])
@pytest.mark.parametrize("weights", ["avg", "per-head", "none"])
def test_the_reimplementation_equals_torch_when_the_quantizers_are_identity(batch_first, masks, weights):
    torch.manual_seed(0)
    m = Cross(batch_first).eval()
    n, length, s = 2, 5, 7
    x = torch.randn(n, length, 12) if batch_first else torch.randn(length, n, 12)
    mem = torch.randn(n, s, 12) if batch_first else torch.randn(s, n, 12)
    kw = dict(_masks(n, 3, length, s, masks), need_weights=weights != "none", average_attn_weights=weights == "avg")
    ref = m(x, mem, **kw)
    handle = _apply(m)
    with float_mode(m):
        out = m(x, mem, **kw)
    for a, b in zip(ref, out):
        if a is None:
            assert b is None
            continue
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()
    handle.remove()


def test_self_attention_unbatched_and_remove_restores_the_module():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2).eval()
    x = torch.randn(6, 8)
    before = snapshot(m)
    ref = m(x, x, x)
    handle = _apply(m)
    with float_mode(m):
        out = m(x, x, x)
    assert torch.allclose(ref[0], out[0], atol=1e-6) and torch.allclose(ref[1], out[1], atol=1e-6)
    handle.remove()
    assert same_state(snapshot(m), before)
    assert not m._forward_hooks and not m._forward_pre_hooks
    assert torch.equal(m(x, x, x)[0], ref[0])


def test_roles_proxies_and_ptq_close_to_float():
    torch.manual_seed(0)
    m = Self(16, 4).eval()
    x = torch.randn(4, 9, 16)
    ref = m(x)[0]
    handle = _apply(m)
    keys = set(m._qdsl.quantizers.keys())
    assert {f"attn:{r}" for r in ("weight_q", "weight_k", "weight_v", "bias_q", "bias_v", "input", "q", "k", "v",
                                  "scores", "probs")} <= keys
    assert handle.layers["attn.out_proj"].wq is not None  # patched as a Linear
    qdsl.calibrate(m, [x])
    qdsl.freeze(m)
    out = m(x)[0]
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), 0)
    assert cos > 0.99, cos
    patch = handle.layers["attn"]
    # the probabilities are on their grid (unsigned: softmax >= 0), the weight per row
    assert patch.acts[Role.PROBS].qmin == 0
    w = patch.w["q"]
    codes = patch.rows("weight", "q") / w.scale.reshape(-1, 1)
    assert w.scale.numel() == 16 and torch.allclose(w(patch.rows("weight", "q")) / w.scale.reshape(-1, 1),
                                                    codes.round().clamp(-127, 127), atol=1e-4)
    # derived bias: int32 at s_input · s_weight (per row)
    b = patch.b["k"]
    assert torch.allclose(b.scale, (patch.iq_all.scale * patch.w["k"].scale).reshape(b.scale.shape))
    assert get_handle(m) is handle


def test_qat_gradients_reach_in_proj_weight_and_dropout_in_training():
    torch.manual_seed(0)
    m = Self(8, 2, dropout=0.5).train()
    x = torch.randn(3, 5, 8)
    _apply(m)
    qdsl.calibrate(m, [x])
    out, w = m(x)
    out.sum().backward()
    assert m.attn.in_proj_weight.grad is not None and m.attn.in_proj_weight.grad.abs().sum() > 0
    assert m.attn.out_proj.weight_float.grad.abs().sum() > 0
    assert (w == 0).any()  # dropout on the probabilities (training)


@pytest.mark.parametrize("kw,what", [
    (dict(kdim=4, vdim=4), "kdim=4"),
    (dict(add_bias_kv=True), "add_bias_kv"),
    (dict(add_zero_attn=True), "add_zero_attn"),
])
def test_unsupported_configurations_are_refused_with_a_location(kw, what):
    m = nn.MultiheadAttention(8, 2, **kw)
    with pytest.raises(SpecError) as e:
        qdsl.apply(m, spec(W8A8))
    msg = str(e.value)
    assert "E511" in msg and what in msg and "MultiheadAttention" in msg and ":" in msg.split("E511")[0]
    assert not m._forward_pre_hooks  # untouched


def test_masks_apply_to_the_quantized_scores():
    torch.manual_seed(0)
    m = Self(8, 2).eval()
    x = torch.randn(3, 6, 8)
    _apply(m)
    qdsl.calibrate(m, [x])
    qdsl.freeze(m)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[:, -2:] = True
    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    out, w = m.attn(x, x, x, key_padding_mask=kpm, attn_mask=causal)
    assert torch.isfinite(out).all()
    assert (w[:, :, -2:] == 0).all() and (w.triu(1) == 0).all()  # masked keys get no probability
    free, _ = m.attn(x, x, x)
    assert not torch.allclose(out, free)


def test_a_fully_masked_row_gets_probability_zero():
    # torch gives NaN; the fake-quant model gives 0 everywhere, as the graph's SOFTMAX_MASKED
    torch.manual_seed(0)
    m = Self(8, 2).eval()
    x = torch.randn(3, 6, 8)
    _apply(m)
    qdsl.calibrate(m, [x])
    qdsl.freeze(m)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[1] = True  # every key of sample 1 masked
    out, w = m.attn(x, x, x, key_padding_mask=kpm)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    assert (w[1] == 0).all() and torch.allclose(w[0].sum(-1), torch.ones(6), atol=0.05)
    # with the probs quantizer off too (float_mode): 0, not NaN
    with float_mode(m):
        out, w = m.attn(x, x, x, key_padding_mask=kpm)
    assert torch.isfinite(out).all() and (w[1] == 0).all()
    assert torch.allclose(out[1], m.attn.out_proj.bias.expand(6, -1))  # context 0: out_proj's bias


def test_input_sets_the_inner_activations_and_a_type_rule_refines_them():
    torch.manual_seed(0)
    m = Self(8, 2)
    text = W8A8 + "rule type:MultiheadAttention optional priority 1 { q = int(bits=6, signed, symmetric) }\n"
    handle = _apply(m, text)
    lp = next(lp for lp in handle.plan.layers if lp.fqn == "attn")
    assert lp.roles[Role.Q].bits == 6 and lp.roles[Role.K].bits == 8 and lp.roles[Role.SCORES].bits == 8
    assert lp.roles[Role.PROBS].signed is False and lp.roles[Role.SCORES].signed is True
    # k, v, scores come from `defaults { input = s8 }` (they refine input); probs from the type rule
    assert "defaults" in lp.provenance[(Role.K, "bits")].set_by.label
    assert "type:MultiheadAttention" in lp.provenance[(Role.PROBS, "bits")].set_by.label


def test_research_ranges_and_lean_optimizer_see_the_attention_layer():
    # before: LeanOptimizer read AttentionPatch._moved (AttributeError)
    import qdsl.qat

    torch.manual_seed(0)
    m = Self(8, 2)
    x = torch.randn(4, 5, 8)
    _apply(m, W8A8.replace("per_channel, observer=minmax)\nquantizer a8", "per_channel, observer=mse)\nquantizer a8"))
    qdsl.calibrate(m, [x])
    assert qdsl.qat.research_ranges(m, ["attn"]) == 3  # the q, k, v weight proxies
    lean = qdsl.qat.LeanOptimizer(m, torch.optim.SGD, lr=0.1)
    assert "attention layer" in lean.skipped["attn"] and "attn.out_proj" in lean.layers
    lean.zero_grad()
    m(x)[0].square().mean().backward()
    before = m.attn.in_proj_weight.detach().clone()
    lean.step()
    assert not torch.equal(before, m.attn.in_proj_weight)
    lean.finish()


def test_unfrozen_attention_does_not_look_for_masked_scores(monkeypatch):
    # before freeze there are no fixed grids to simulate the graph's softmax on, so the
    # kept-position mask (~isneginf over every score) is not computed (it was, and thrown
    # away); after freeze it is, and the simulation runs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 12), nn.TransformerEncoderLayer(12, 3, 24, dropout=0.0, batch_first=True))
    _apply(model, W8A8 + "rule type:MultiheadAttention optional { scores = s8 }\n")
    x = torch.randn(2, 5, 12)
    qdsl.calibrate(model, [x])
    calls = []
    real = torch.isneginf
    monkeypatch.setattr(torch, "isneginf", lambda t: calls.append(1) or real(t))
    with torch.no_grad():
        model.eval()(x)
    assert calls == []
    qdsl.freeze(model)
    with torch.no_grad():
        model(x)
    assert calls != []

"""Half-precision models (bfloat16, float16) and TorchScript modules through qdsl.

* a half model is patched, calibrated, trained (backward + step), frozen and exported;
  its outputs keep its dtype while every quantizer computes and stores its state in
  float32, so ``int_tensors`` equals that of a float32 twin holding the same values;
* ``model.to(torch.bfloat16)`` after ``apply`` converts the model, not the quantizers;
* a scripted or traced model is refused by ``apply`` with a QdslError (an eager model
  containing a scripted layer the spec quantizes: a located E510).
"""

import copy

import numpy as np
import pytest
import torch
from torch import nn

import qdsl
from qdsl import calibrate, freeze
from qdsl.patch import apply, get_handle, int_tensors
from qdsl.spec.diagnostics import QdslError, SpecError
from qdsl.zoo.data import digits
from qdsl.zoo.models import digits_resnet
from patch_helpers import spec

HALF = [torch.bfloat16, torch.float16]

LEARNED = """version 1
defaults {
  weight = int(bits=4, signed, narrow, symmetric, per_channel, scale=learned, observer=minmax)
  input = int(bits=8, signed, symmetric, per_tensor, scale=learned_pot, observer=minmax)
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
rule 3 { output = int(bits=8, signed, symmetric, per_tensor, observer=minmax) }
"""


class _Conv1dLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(4 * 8, 3)

    def forward(self, x):
        return self.fc(self.flat(self.relu(self.conv(x))))


@pytest.fixture(scope="module")
def data():
    xtr, _, xte, _ = digits()
    return xtr[:128], xte[:64]


def _quantizer_tensors(model):
    q = get_handle(model).container
    return [t for t in list(q.parameters()) + list(q.buffers()) if t.is_floating_point()]


def _twins(dtype):
    """A float32 digits ResNet whose every value is representable in ``dtype``, and its
    ``dtype`` copy (exactly the same values)."""
    m32 = digits_resnet(seed=0).eval().to(dtype).float()
    return m32, copy.deepcopy(m32).to(dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_half_model_calibrates_freezes_and_matches_float32_codes(dtype, data):
    xtr, xte = data
    m32, mh = _twins(dtype)
    xb = xtr.to(dtype)
    for m, x in ((m32, xb.float()), (mh, xb)):
        apply(m, spec())
        calibrate(m, [x])
        freeze(m)
    y = mh(xte.to(dtype))
    assert y.dtype == dtype and bool(torch.isfinite(y).all())
    assert all(t.dtype == torch.float32 for t in _quantizer_tensors(mh))
    a, b = int_tensors(m32), int_tensors(mh)
    assert a.keys() == b.keys() and len(a) > 5
    for k in a:  # BN folded in float32: the same weight codes and scales
        assert torch.equal(a[k].weight, b[k].weight), k
        assert torch.equal(a[k].weight_scale, b[k].weight_scale), k
        assert torch.equal(a[k].weight_zero_point, b[k].weight_zero_point), k
    # the model input sees identical values in both: identical activation grid
    assert torch.equal(a["stem.0"].input_scale, b["stem.0"].input_scale)
    assert torch.equal(a["stem.0"].input_zero_point, b["stem.0"].input_zero_point)
    ref = m32(xte.to(dtype).float())
    assert (y.float().argmax(1) == ref.argmax(1)).float().mean() >= 0.9


@pytest.mark.parametrize("dtype", HALF)
def test_half_model_exports_and_runs(dtype, data):
    xtr, xte = data
    m32, mh = _twins(dtype)
    for m in (m32, mh):
        apply(m, spec())
        calibrate(m, [xtr.to(dtype).to(next(m.parameters()).dtype)])
        freeze(m)
    gh = qdsl.export(mh, xte[:2])  # a float32 example for a half model is fine
    assert qdsl.export(mh, xte[:2].to(dtype)).ops == gh.ops
    g32 = qdsl.export(m32, xte[:2])
    for name in ("stem.0.weight", "fc.weight"):
        assert np.array_equal(gh.tensor(name).data, g32.tensor(name).data)
    out = qdsl.run_graph(gh, xte.to(dtype), backend="reference")
    y = mh(xte.to(dtype))
    assert out.dtype == np.float32 and out.shape == tuple(y.shape)
    assert (out.argmax(1) == y.float().argmax(1).numpy()).mean() >= 0.9


@pytest.mark.parametrize("dtype", HALF)
def test_half_linear_conv1d_qat_step(dtype):
    torch.manual_seed(0)
    model = _Conv1dLinear().to(dtype)
    x = torch.randn(16, 2, 8).to(dtype)
    apply(model, spec(LEARNED.replace("rule 3", "rule fc")))
    calibrate(model, [x])
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = model.conv.weight_float.detach().clone()
    y = model(x)
    assert y.dtype == dtype
    y.float().square().mean().backward()
    handle = get_handle(model)
    assert handle.quantizer("conv", "weight").scale_rule.scale.grad is not None
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
    opt.step()
    assert not torch.equal(before, model.conv.weight_float.detach())
    assert all(t.dtype == torch.float32 for t in _quantizer_tensors(model))
    model.eval()
    freeze(model)
    g = qdsl.export(model, x[:1])
    out = qdsl.run_graph(g, x, backend="reference")
    assert out.shape == (16, 3) and np.isfinite(out).all()


@pytest.mark.parametrize("when", ["prepared", "frozen"])
def test_to_bfloat16_after_apply_keeps_quantizers_float32(when, data):
    xtr, xte = data
    model = digits_resnet(seed=0).eval()
    apply(model, spec())
    calibrate(model, [xtr])
    if when == "frozen":
        freeze(model)
        ref = model(xte)  # fills the frozen fast path's cached weights
    model.to(torch.bfloat16)
    assert all(t.dtype == torch.float32 for t in _quantizer_tensors(model))
    if when == "prepared":
        freeze(model)
        ref = None
    y = model(xte.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and bool(torch.isfinite(y).all())
    if ref is not None:
        assert (y.float().argmax(1) == ref.argmax(1)).float().mean() >= 0.9
    model.float()
    assert model(xte).dtype == torch.float32
    qdsl.export(model, xte[:1])


@pytest.mark.parametrize("convert", ["script", "trace"])
def test_torchscript_model_is_refused_at_apply(convert):
    model = digits_resnet(seed=0).eval()
    sm = torch.jit.script(model) if convert == "script" else torch.jit.trace(model, torch.zeros(1, 1, 8, 8))
    with pytest.raises(QdslError, match="apply qdsl to the eager model before scripting"):
        apply(sm, spec())
    with pytest.raises(QdslError, match="qdsl was not applied"):
        calibrate(sm, [torch.zeros(1, 1, 8, 8)])
    with pytest.raises(QdslError, match="eager nn.Module"):  # `qdsl check --model` resolves
        qdsl.resolve(sm, spec())


def test_scripted_submodule_the_spec_quantizes_is_a_located_error():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.jit.script(nn.Linear(3, 3))
            self.b = nn.Linear(3, 2)

        def forward(self, x):
            return self.b(self.a(x))

    text = """version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
defaults { weight = w8 }
rule a { weight = w8 }
"""
    model = Net()
    before = [(k, v.clone()) for k, v in model.state_dict().items()]
    with pytest.raises(SpecError) as err:
        apply(model, spec(text, "script.qspec"))
    assert err.value.codes == ["E510"]
    assert "script.qspec:4:" in str(err.value) and "TorchScript" in str(err.value)
    assert not hasattr(model, "_qdsl")
    assert [(k, v) for k, v in before] and all(torch.equal(v, model.state_dict()[k]) for k, v in before)


@pytest.mark.parametrize("name", ["int8-default", "low-bit", "mixed-precision", "pot-asic", "w4a8-per-channel",
                                  "xnor-binary"])
def test_shipped_specs_on_a_bfloat16_model(name, data):
    xtr, xte = data
    model = digits_resnet(seed=0, width=8).eval().to(torch.bfloat16)
    apply(model, qdsl.load_spec(f"specs/{name}.qspec"))
    calibrate(model, [xtr.to(torch.bfloat16)])
    freeze(model)
    x = xte.to(torch.bfloat16)
    with torch.no_grad():
        fq = model(x)
    assert fq.dtype == torch.bfloat16
    got = qdsl.run_graph(qdsl.export(model, xte[:2]), x, backend="reference")
    assert (got.argmax(1) == fq.float().argmax(1).numpy()).mean() >= 0.9


@pytest.mark.parametrize("dtype", HALF)
def test_lean_optimizer_on_a_half_model(dtype):
    import qdsl.qat

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).to(dtype)
    apply(model, spec("""version 1
defaults {
  weight = int(bits=4, signed, narrow, symmetric, per_channel, observer=minmax)
  input = int(bits=8, signed, symmetric, per_tensor, observer=minmax)
}
""", "lean.qspec"))
    x = torch.randn(16, 8).to(dtype)
    calibrate(model, [x])
    opt = qdsl.qat.LeanOptimizer(model, torch.optim.SGD, lr=0.1)
    model.train()
    before = model(x).detach()
    model(x).float().square().mean().backward()
    opt.step()
    after = model(x)
    assert after.dtype == dtype and not torch.equal(before, after.detach())
    opt.finish()
    assert model(x).dtype == dtype


@pytest.mark.parametrize("dtype", HALF)
def test_half_digits_cnn_qat_with_bn_folding(dtype):
    import qdsl.qat

    xtr, ytr, xte, _ = digits()
    model = digits_resnet(seed=0, width=8).to(dtype)
    apply(model, spec())
    calibrate(model, [xtr[:128].to(dtype)])
    qdsl.qat.prepare_qat(model)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(2):
        loss = nn.functional.cross_entropy(model(xtr[:64].to(dtype)).float(), ytr[:64])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.dtype == dtype for n, p in model.named_parameters() if not n.startswith("_qdsl."))
    model.eval()
    freeze(model)
    y = model(xte.to(dtype))
    out = qdsl.run_graph(qdsl.export(model, xte[:2]), xte.to(dtype), backend="reference")
    assert (out.argmax(1) == y.float().argmax(1).numpy()).mean() >= 0.9

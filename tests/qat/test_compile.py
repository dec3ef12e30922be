"""torch.compile of an applied QAT model: outputs, gradients and state equal eager (slow: compiling)."""

import copy

import pytest
import torch

import qdsl.qat
from qdsl import calibrate
from qdsl.patch import apply
from qdsl.zoo.models import conv_bn_relu_net
from pathlib import Path

SPECS = Path(__file__).resolve().parents[2] / "specs"


class _HardtanhNet(torch.nn.Module):
    """conv-BN-hardtanh (binary activations of a ReLU output would be constant)."""

    def __init__(self, width=8):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, width, 3, padding=1, bias=False), torch.nn.BatchNorm2d(width), torch.nn.Hardtanh(),
            torch.nn.Conv2d(width, width, 3, padding=1, bias=False), torch.nn.BatchNorm2d(width), torch.nn.Hardtanh())
        self.classifier = torch.nn.Linear(width, 10)

    def forward(self, x):
        return self.classifier(self.features(x).mean((2, 3)))


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["int8-default.qspec", "pot-asic.qspec", "xnor-binary.qspec"])
def test_compiled_qat_step_matches_eager(spec):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _HardtanhNet() if spec.startswith("xnor") else conv_bn_relu_net(width=8)
    apply(model, SPECS / spec)
    x = torch.randn(8, 3, 16, 16)
    calibrate(model, [x])
    qdsl.qat.prepare_qat(model)
    model.train()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    # load it here too, as before the eager step below: loading bumps the weights' versions,
    # so both steps see "changed" weights (a searched range starts being carried in both)
    model.load_state_dict(start)
    compiled = torch.compile(model, backend="aot_eager")
    y = compiled(x)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    after = {k: v.clone() for k, v in model.state_dict().items()}
    model.zero_grad()
    model.load_state_dict(start)
    y_eager = model(x)
    y_eager.square().sum().backward()
    assert torch.equal(y, y_eager)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
        assert p.grad.abs().sum() > 0, n
    for k, v in model.state_dict().items():
        assert torch.equal(v, after[k]), k  # BN running statistics updated alike
    model.eval()
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))


# ---------------------------------------------------------------- issue 23: graph breaks, inductor
def _qat_model(spec, width=8, model=None):
    torch.manual_seed(0)
    model = model if model is not None else conv_bn_relu_net(width=width)
    apply(model, SPECS / spec)
    x = torch.randn(8, 3, 16, 16)
    calibrate(model, [x])
    qdsl.qat.prepare_qat(model)
    return model.train(), x


def _breaks(model, x, train):
    torch._dynamo.reset()
    model.train(train)
    with torch.set_grad_enabled(train):
        return torch._dynamo.explain(model)(x).graph_break_count


_BUNDLED = sorted(p.name for p in SPECS.glob("*.qspec") if not p.name.startswith("transformer"))
_FAST = ("int8-default.qspec", "pot-asic.qspec")


@pytest.mark.parametrize("spec", [s if s in _FAST else pytest.param(s, marks=pytest.mark.slow) for s in _BUNDLED])
def test_no_graph_breaks_in_training_or_eval_forward(spec):
    model, x = _qat_model(spec, model=_HardtanhNet() if spec.startswith("xnor") else None)
    model = copy.deepcopy(model)  # a copy takes its static ranges again (proxy.__setstate__)
    assert _breaks(model, x, train=False) == 0
    # live BN statistics still break the graph where the fold factor runs eagerly
    # (bn_fold.fold_factor: a traced one lets the BN's in-place update of running_var
    # corrupt the saved tensor); with frozen statistics (the inference fold) none
    qdsl.qat.freeze_bn_stats(model)
    assert _breaks(model, x, train=True) == 0


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["pot-asic.qspec", "w4a8-per-channel.qspec"])
def test_inductor_qat_step_matches_eager(spec):
    """One training step compiled with inductor: same loss and gradients as eager (within
    float tolerance: inductor fuses and reorders float arithmetic), same BN statistics."""
    torch._dynamo.reset()
    model, x = _qat_model(spec)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(start)
    compiled = torch.compile(model, backend="inductor")
    loss = compiled(x).square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    after = {k: v.clone() for k, v in model.state_dict().items()}
    model.zero_grad()
    model.load_state_dict(start)
    loss_eager = model(x).square().mean()
    loss_eager.backward()
    torch.testing.assert_close(loss, loss_eager, rtol=1e-4, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-3, atol=1e-4, msg=n)
        assert p.grad.abs().sum() > 0, n
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(after[k], v, rtol=1e-4, atol=1e-5, msg=k)
        else:
            assert torch.equal(after[k], v), k


def test_frozen_state_is_a_python_attribute_that_follows_the_buffer():
    model, x = _qat_model("int8-default.qspec")
    qs = [m for m in model.modules() if isinstance(m, qdsl.quantizers.proxy.TensorQuantizer)]
    assert not any(q.frozen for q in qs)
    qdsl.freeze(model)
    assert all(q.frozen for q in qs)
    fresh, _ = _qat_model("int8-default.qspec")
    fresh.load_state_dict(model.state_dict())
    assert all(m.frozen for m in fresh.modules() if isinstance(m, qdsl.quantizers.proxy.TensorQuantizer))

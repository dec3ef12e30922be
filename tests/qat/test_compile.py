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
    # live BN statistics (QAT's default: the fold factor from the running variance, the BN
    # normalising with batch statistics) and frozen statistics (the inference fold)
    assert _breaks(model, x, train=True) == 0
    assert all(qdsl.qat.bn_fold.qat_fold_active(p) for p in qdsl.qat.bn_fold._folded_patches(model))
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


@pytest.mark.slow
def test_inductor_qat_steps_with_live_bn_statistics_match_eager():
    """Several inductor-compiled training steps with live BN statistics (one compiled graph,
    reused) against eager: same loss and gradients at every step, and the compiled backward
    never reads the BN's running buffers.

    The fold factor reads ``running_var``, which the BN updates in place later in the same
    forward.  Written with plain aten ops, inductor's partitioner kept the buffer for the
    backward (buffers count as free to save) and recomputed the inverse std there, from
    the updated statistics.  Here the compiled model's buffers are scaled in place between
    each forward and its backward: a backward that kept them fails autograd's in-place
    check (or computes different gradients).  Each step starts
    both models from the same state (quantized values are discontinuous, so two runs a
    rounding apart would drift apart over steps however exact the gradients)."""
    torch._dynamo.reset()
    model, _ = _qat_model("pot-asic.qspec")
    eager, comp = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(comp, backend="inductor")
    opt = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    bns = {m: [b for b in m.modules() if isinstance(b, torch.nn.BatchNorm2d)] for m in (eager, comp)}
    gammas = [f"{n}.weight" for n, b in eager.named_modules() if isinstance(b, torch.nn.BatchNorm2d)]
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        comp.load_state_dict(eager.state_dict())
        x = torch.randn(8, 3, 16, 16, generator=g)
        losses, grads, states = [], [], []
        for fwd, m in ((eager, eager), (compiled, comp)):
            m.zero_grad(set_to_none=True)
            loss = fwd(x).square().mean()
            states.append({k: v.clone() for k, v in m.state_dict().items()})
            perturb = m is comp  # eager's own BN backward node keeps the buffers (version-checked)
            with torch.no_grad():
                for bn in bns[m] if perturb else ():
                    bn.running_var.mul_(3.0)
                    bn.running_mean.add_(1.0)
            loss.backward()
            with torch.no_grad():
                for bn in bns[m] if perturb else ():
                    bn.running_var.div_(3.0)
                    bn.running_mean.sub_(1.0)
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-6)
        assert grads[0].keys() == grads[1].keys() and all(n in grads[0] for n in gammas)
        for n in grads[0]:
            torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-3, atol=1e-5, msg=f"step {step}: {n}")
        # the BN statistics updated alike (a compiled forward takes a stateless weight's
        # range with tensor ops and leaves its observer's buffers as they were)
        bn_state = [k for k in states[0] if k.rsplit(".", 1)[-1] in ("running_mean", "running_var",
                                                                    "num_batches_tracked")]
        assert len(bn_state) == 3 * len(gammas)
        for k in bn_state:
            torch.testing.assert_close(states[1][k], states[0][k], rtol=1e-4, atol=1e-5, msg=f"step {step}: {k}")
        opt.step()


_ACC_SPEC = """version 1
defaults {{
  weight = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
  input = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
  accumulator(bits={bits}, overflow=saturate)
}}
"""


@pytest.mark.slow
@pytest.mark.parametrize("bits", [12, 24])
def test_compiled_accumulator_simulation_matches_eager(bits):
    """The traced accumulator hook (torch.cond): 12 bits overflows (the exact branch),
    24 bits cannot (the fast branch); value and gradient as in eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.abs_()
    x = torch.rand(6, 16) * 3
    apply(model, qdsl.parse_spec(_ACC_SPEC.format(bits=bits)))
    calibrate(model, [x])
    qdsl.qat.prepare_qat(model)
    model.train()
    compiled = torch.compile(model, backend="aot_eager")
    out = []
    for fwd in (model, compiled):
        xg = x.clone().requires_grad_(True)
        y = fwd(xg)
        y.square().sum().backward()
        out.append((y.detach(), xg.grad))
    sim = qdsl.patch.get_handle(model).layers["0"].acc_sim
    model(x)
    assert sim.simulated == (bits == 12)
    assert torch.equal(out[1][0], out[0][0])
    assert torch.equal(out[1][1], out[0][1])

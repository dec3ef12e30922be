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


# ------------------------------------------- issue 23: the accumulator check as one custom op
_ACC_SPEC_OVF = """version 1
defaults {{
  weight = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
  input = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
  accumulator(bits={bits}, overflow={overflow})
}}
"""


def _recording(targets):
    """aot_eager, recording the dynamo graph's call targets."""
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return lookup_backend("aot_eager")(gm, example_inputs)
    return backend


def _acc_layer(layer, bits, overflow, x):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(layer)
    with torch.no_grad():
        layer.weight.abs_()  # all-positive weights: large inputs sum up (the 12-bit case overflows)
    apply(model, qdsl.parse_spec(_ACC_SPEC_OVF.format(bits=bits, overflow=overflow)))
    calibrate(model, [x])
    qdsl.qat.prepare_qat(model)
    return model.train(), qdsl.patch.get_handle(model).layers["0"].acc_sim


def _eager_and_compiled(model, x, backend):
    compiled = torch.compile(model, backend=backend)
    out = []
    for fwd in (model, compiled):
        xg = x.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        y = fwd(xg)
        y.square().sum().backward()
        grads = [p.grad.clone() for _, p in sorted(model.named_parameters()) if p.grad is not None]
        assert grads
        out.append((y.detach(), xg.grad, *grads))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("bits,overflow", [(12, "saturate"), (12, "wrap"), (16, "saturate"), (24, "saturate")])
def test_compiled_accumulator_check_follows_the_width_bound(bits, overflow):
    """A bias-free layer: 8-bit narrow weights x 8-bit asymmetric inputs over 16 products
    need 21 bits at most (|w| <= 127, |x - z| <= 255), so at 24 bits the trace-time proof
    holds and the compiled graph has no check at all; at 16 bits the proof fails but the
    actual weights cannot overflow (the op runs, takes the eager decision and leaves the
    output alone); at 12 bits they do (the op simulates, as eager).  Value and gradients
    equal eager's to the bit.  (Before: a torch.cond per layer whatever the widths.)"""
    x = torch.rand(6, 16) * 3
    layer = torch.nn.Linear(16, 4, bias=False)
    if bits == 16:
        with torch.no_grad():
            layer.weight.mul_(0.01)[:, 0] = 1.0  # one large weight per row: a small scale-relative sum
    model, sim = _acc_layer(layer, bits, overflow, x)
    lo, hi = sim.width_bound()
    assert (lo, hi) == (-16 * 127 * 255, 16 * 127 * 255)
    assert sim.proven_safe() == (bits == 24)
    targets = []
    out = _eager_and_compiled(model, x, _recording(targets))
    ops = [t for t in targets if t is torch.ops.qdsl.simulate_accumulator.default]
    assert len(ops) == (0 if bits == 24 else 1)
    model(x)
    assert sim.simulated == (bits == 12)
    assert sim.overflows > 0 if bits == 12 else sim.overflows == 0
    assert len(out[1]) == len(out[0])
    for a, b in zip(out[1], out[0]):
        assert torch.equal(a, b)


def test_width_bound_contains_every_reachable_sum():
    """The trace-time bound is sound: the exact per-channel extremes of any weights the
    quantizer can produce (extreme codes, random codes; conv fan-in in/groups x kernel)
    lie inside it, with and without zero points."""
    from qdsl.patch.accumulator_sums import reachable, width_bound

    g = torch.Generator().manual_seed(0)
    for w_rng, x_rng, fan in [([(-7, 7)], [(-128, 127)], 288), ([(-128, 127)], [(0, 255), (-255, 0)], 3 * 9),
                              ([(0, 15), (-15, 0)], [(-127, 127)], 64)]:
        lo, hi = width_bound(w_rng, x_rng, fan)
        wl, wh = min(r[0] for r in w_rng), max(r[1] for r in w_rng)
        for w in (torch.full((2, fan), wl), torch.full((2, fan), wh), torch.randint(wl, wh + 1, (8, fan), generator=g)):
            rlo, rhi = reachable(w, None, x_rng)
            assert lo <= int(rlo.min()) and int(rhi.max()) <= hi
        # the corner is reached: the bound is the exact worst case, not a loose one
        assert max(abs(lo), abs(hi)) == fan * max(abs(a * b) for a in (wl, wh) for r in x_rng for b in r)


def test_bias_against_the_width_bound_takes_the_exact_decision():
    """With a bias the check runs, bias first: it agrees with the exact per-channel one
    whenever it answers, and otherwise defers to it."""
    from qdsl.patch.accumulator_sums import decide, fits, reachable, width_bound

    g = torch.Generator().manual_seed(1)
    x_rng = [(-128, 127)]
    bound = width_bound([(-7, 7)], x_rng, 36)
    for bits in (16, 18, 20):
        for scale in (1, 100, 10_000, 100_000):
            w = torch.randint(-7, 8, (5, 36), generator=g).double()
            b = torch.randint(-scale, scale + 1, (5,), generator=g)
            exact = bool(fits(*reachable(w, b, x_rng), bits).all())
            assert decide(w, b, x_rng, bits, bound) == exact == decide(w, b, x_rng, bits, None)


@pytest.mark.slow
def test_compiled_accumulator_simulation_in_a_channels_last_conv():
    """The op works on the conv output in its own layout (channels-last), overwriting it in
    place only when it simulates; a bias makes the check run; disabling the simulation
    (``enabled = False``, as block reconstruction and LeanAdam do) is honoured compiled too
    (the traced hook ignored it before)."""
    x = (torch.rand(2, 8, 6, 6) * 3).to(memory_format=torch.channels_last)
    layer = torch.nn.Conv2d(8, 4, 3, padding=1, bias=True)
    model, sim = _acc_layer(layer, 12, "saturate", x)
    assert not sim.proven_safe()
    out = _eager_and_compiled(model, x, "aot_eager")
    assert len(out[1]) == len(out[0])
    for a, b in zip(out[1], out[0]):
        assert torch.equal(a, b)
    model(x)
    assert sim.simulated and sim.overflows > 0
    sim.enabled = False
    torch._dynamo.reset()
    out = _eager_and_compiled(model, x, "aot_eager")
    assert len(out[1]) == len(out[0])
    for a, b in zip(out[1], out[0]):
        assert torch.equal(a, b)
    model(x)
    assert not sim.simulated

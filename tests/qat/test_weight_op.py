"""A BN-folded weight's QAT fake quantization as one op under compile (qdsl::fold_weight_fq,
issue 23: compile time): values and gradients equal the eager path, the op is what a
compiled live-statistics step traces, and the compiled step equals eager."""

from pathlib import Path

import pytest
import torch

import qdsl.qat
from qdsl import calibrate
from qdsl.patch import apply
from qdsl.patch.handle import get_handle
from qdsl.qat.bn_fold import fold_factor
from qdsl.quantizers import weight_op
from qdsl.zoo.models import conv_bn_relu_net

SPECS = Path(__file__).resolve().parents[2] / "specs"

# per-tensor, asymmetric, unsigned, pot_ceil, ema: the op's other branches
_OTHER = """version 1
fold_bn
defaults {
  weight = int(bits=5, unsigned, asymmetric, per_tensor, scale=pot_ceil, observer=ema)
  input = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
}
"""


def _spec(name: str, tmp_path) -> Path:
    if name == "other":
        p = tmp_path / "other.qspec"
        p.write_text(_OTHER)
        return p
    return SPECS / f"{name}.qspec"


def _net(spec: Path, width: int = 5):
    torch.manual_seed(0)
    model = conv_bn_relu_net(width=width, activation="hardtanh")
    apply(model, spec)
    x = torch.randn(6, 3, 9, 7)
    calibrate(model, [x])
    qdsl.qat.prepare_qat(model)
    model.train()
    model(x).square().sum().backward()  # an eager training step: a searched range is carried from here on
    model.zero_grad()
    bn = model.features[1]
    with torch.no_grad():  # a zero γ (the fold's guard) and odd running statistics
        bn.weight[0] = 0.0
        bn.running_var.mul_(torch.rand_like(bn.running_var) + 0.5)
    return model, x


def _patches(model):
    return [p for p in get_handle(model).layers.values() if p.bn is not None]


@pytest.mark.parametrize("spec", ["pot-asic", "int8-default", "w4a8-per-channel", "other"])
def test_op_equals_the_eager_fold_values_and_gradients(spec, tmp_path):
    """``weight_op.folded`` (the op, run eagerly here) gives the eager QAT expression
    ``wq(W·f)/f``'s value, scale and gradients to W and γ bit for bit, for every folded
    layer (incl. a zero γ channel)."""
    model, _ = _net(_spec(spec, tmp_path))
    n = 0
    for patch in _patches(model):
        q, bn = patch.wq, patch.bn
        assert weight_op.applies(q, patch.master("weight")), (spec, patch.fqn)
        w0 = patch.master("weight").detach()
        g = torch.randn_like(w0)
        results = []
        for use_op in (False, True):
            w = w0.clone().requires_grad_(True)
            bn.weight.grad = None
            if use_op:
                out = weight_op.folded(q, w, bn)
            else:
                f = fold_factor(bn)
                f = torch.where(f == 0, torch.full_like(f, torch.finfo(f.dtype).tiny), f)
                f = f.reshape(-1, *([1] * (w.dim() - 1)))
                out = q(w * f) / f
            scale = q.current_scale().clone()
            out.backward(g)
            results.append((out.detach(), scale, w.grad.clone(), bn.weight.grad.clone()))
        (o0, s0, gw0, gg0), (o1, s1, gw1, gg1) = results
        assert torch.equal(o0, o1) and torch.equal(s0, s1)
        assert torch.equal(gw0, gw1) and torch.equal(gg0, gg1)
        assert gw1.abs().sum() > 0 and gg1.abs().sum() > 0
        n += 1
    assert n == 3


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("case", range(3))
def test_opcheck(case, layout):
    """torch.library.opcheck: fake (meta) implementations, strides, autograd registration,
    for both ops; the outputs have the weight's layout (what the fake promises)."""
    torch.manual_seed(case)
    w = torch.randn(6, 4, 3, 3) * 0.3
    if layout == "channels_last":
        w = w.contiguous(memory_format=torch.channels_last)
    gamma = torch.rand(6) + 0.5
    gamma[2] = 0.0
    inv_std = torch.rand(6) + 0.5
    args = [
        (w, gamma, inv_std, torch.rand(6) * 0.5 + 0.5, -7, 7, True, "round", True, 0),
        (w, None, inv_std, None, -127, 127, True, "", False, 0),
        (w, gamma, inv_std, None, 0, 31, False, "ceil", True, None),
    ][case]
    out = weight_op.fold_weight_fq(*args)
    for t in (out[0], out[3], out[4]):
        assert t.stride() == w.stride()
    a = list(args)
    a[0] = w.clone().requires_grad_(True)
    if a[1] is not None:
        a[1] = a[1].clone().requires_grad_(True)
    torch.library.opcheck(weight_op.fold_weight_fq, tuple(a))
    o, _s, _z, xhat, mask, f = out
    torch.library.opcheck(weight_op.fold_weight_fq_backward,
                          (torch.randn_like(w), w, args[1], inv_std, xhat, mask, f, args[9] is None))


def _traced(model, x):
    ops: list[str] = []

    def backend(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    return ops, torch.compile(model, backend=backend)


@pytest.mark.parametrize("spec", ["pot-asic", "int8-default"])
def test_live_fold_traces_the_op_and_compiles_once(spec):
    """A compiled live-statistics training forward calls the op once per folded layer, with
    no graph break, a second call does not compile again (before: the eval plan
    attribute ``_eplan`` set while tracing failed the guard, a second compile), and the
    layers' ``weight`` attributes are as before the call."""
    from torch._dynamo.utils import counters

    model, x = _net(SPECS / f"{spec}.qspec")
    convs = [p.module for p in _patches(model)]
    before = [m.__dict__["weight"] for m in convs]
    counters.clear()
    ops, compiled = _traced(model, x)
    for _ in range(2):
        compiled(x).sum().backward()
    assert sum("qdsl.fold_weight_fq" in op for op in ops) == 3, ops
    assert counters["stats"]["unique_graphs"] == 1
    # the layers' weight attributes are put back after their forward: the graph does not
    # output the weights it computed (before: one more output and gradient input per layer)
    assert all(m.__dict__["weight"] is w for m, w in zip(convs, before))
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(x).graph_break_count == 0


@pytest.mark.parametrize("spec", ["pot-asic", "int8-default", "w4a8-per-channel"])
@pytest.mark.parametrize("frozen_bn", [False, True])
def test_compiled_step_equals_eager(spec, frozen_bn):
    """aot_eager (the aten graph inductor starts from): two training steps (SGD between
    them) equal eager's outputs, gradients and state bit for bit, with live BN statistics
    (the op) and frozen ones (the inference fold, no op)."""
    model, x = _net(SPECS / f"{spec}.qspec")
    if frozen_bn:
        qdsl.qat.freeze_bn_stats(model)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    runs = []
    for compiled in (True, False):
        model.load_state_dict(start)
        torch._dynamo.reset()
        fwd = torch.compile(model, backend="aot_eager") if compiled else model
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        rec = []
        for _ in range(2):
            opt.zero_grad()
            y = fwd(x)
            y.square().sum().backward()
            rec.append((y.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
        runs.append((rec, {k: v.clone() for k, v in model.state_dict().items() if "observer" not in k}))
    (rc, sc), (re, se) = runs
    for (yc, gc), (ye, ge) in zip(rc, re):
        assert torch.equal(yc, ye)
        for n in ge:
            assert torch.equal(gc[n], ge[n]), n
    for k in se:
        assert torch.equal(sc[k], se[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["pot-asic", "int8-default"])
def test_inductor_live_fold_step_matches_eager(spec):
    """Inductor (its reductions may reorder float sums): close to eager, two steps."""
    model, x = _net(SPECS / f"{spec}.qspec", width=8)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    runs = []
    for compiled in (True, False):
        model.load_state_dict(start)
        torch._dynamo.reset()
        fwd = torch.compile(model, backend="inductor") if compiled else model
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
        rec = []
        for _ in range(2):
            opt.zero_grad()
            loss = fwd(x).square().mean()
            loss.backward()
            rec.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
        runs.append(rec)
    for (lc, gc), (le, ge) in zip(*runs):
        torch.testing.assert_close(lc, le, rtol=1e-4, atol=1e-5)
        for n in ge:
            torch.testing.assert_close(gc[n], ge[n], rtol=1e-3, atol=1e-4, msg=n)

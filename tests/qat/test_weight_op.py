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


def _with_grads(args: tuple) -> tuple:
    """An op's arguments with the weight and gamma (when given) as fresh leaves that need
    gradients, for opcheck's autograd checks."""
    a = list(args)
    a[0] = a[0].clone().requires_grad_(True)
    if a[1] is not None:
        a[1] = a[1].clone().requires_grad_(True)
    return tuple(a)


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
    torch.library.opcheck(weight_op.fold_weight_fq, _with_grads(args))
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


def _two_steps(model, x, backend: str, lr: float, loss_of):
    """Two SGD steps compiled with ``backend``, then eager, from the same state: per run the
    steps' (output, loss, gradients) and the final state without the observers'."""
    start = {k: v.clone() for k, v in model.state_dict().items()}
    runs = []
    for compiled in (True, False):
        model.load_state_dict(start)
        torch._dynamo.reset()
        fwd = torch.compile(model, backend=backend) if compiled else model
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
        rec = []
        for _ in range(2):
            opt.zero_grad()
            loss = loss_of(y := fwd(x))
            loss.backward()
            rec.append((y.detach().clone(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
        runs.append((rec, {k: v.clone() for k, v in model.state_dict().items() if "observer" not in k}))
    return runs


@pytest.mark.parametrize("spec", ["pot-asic", "int8-default", "w4a8-per-channel", "mxfp4"])
@pytest.mark.parametrize("frozen_bn", [False, True])
def test_compiled_step_equals_eager(spec, frozen_bn):
    """aot_eager (the aten graph inductor starts from): two training steps (SGD between
    them) equal eager's outputs, gradients and state bit for bit, with live BN statistics
    (the op) and frozen ones (the inference fold, no op)."""
    model, x = _net(SPECS / f"{spec}.qspec")
    if frozen_bn:
        qdsl.qat.freeze_bn_stats(model)
    (rc, sc), (re, se) = _two_steps(model, x, "aot_eager", 0.1, lambda y: y.square().sum())
    for (yc, _, gc), (ye, _, ge) in zip(rc, re):
        assert torch.equal(yc, ye)
        for n in ge:
            assert torch.equal(gc[n], ge[n]), n
    for k in se:
        assert torch.equal(sc[k], se[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["pot-asic", "int8-default", "mxfp4"])
def test_inductor_live_fold_step_matches_eager(spec):
    """Inductor (its reductions may reorder float sums): close to eager, two steps."""
    model, x = _net(SPECS / f"{spec}.qspec", width=8)
    (rc, _), (re, _) = _two_steps(model, x, "inductor", 0.01, lambda y: y.square().mean())
    for (_, lc, gc), (_, le, ge) in zip(rc, re):
        torch.testing.assert_close(lc, le, rtol=1e-4, atol=1e-5)
        for n in ge:
            torch.testing.assert_close(gc[n], ge[n], rtol=1e-3, atol=1e-4, msg=n)


# ------------------------------------------------- minifloat / MX weights (qdsl::mx_weight_fq)
# NVFP4-style two-level scale per channel, fp8 e4m3 elements with a float scale per tensor
# (the fp8 cast path), ema: the MX op's other branches
_MX_OTHER = {
    "nvfp4": """version 1
fold_bn
defaults {
  weight = fp4_e2m1(granularity=group(16), scale=fp8_e4m3)
  input = fp8_e4m3(per_tensor, observer=minmax)
}
""",
    "fp8-tensor": """version 1
fold_bn
defaults {
  weight = fp8_e4m3(per_tensor, observer=ema)
  input = fp8_e4m3(per_tensor, observer=minmax)
}
""",
    "fp6-channel": """version 1
fold_bn
defaults {
  weight = fp6_e3m2(per_channel, scale=pot_ceil)
  input = fp8_e4m3(per_tensor, observer=minmax)
}
""",
}


def _mx_spec(name: str, tmp_path) -> Path:
    if name in _MX_OTHER:
        p = tmp_path / f"{name}.qspec"
        p.write_text(_MX_OTHER[name])
        return p
    return SPECS / f"{name}.qspec"


def _eager_q(patch, w):
    """The eager QAT expression of a layer's weight: ``wq(W·f)/f`` folded, ``wq(W)`` not."""
    q, bn = patch.wq, patch.bn
    if bn is None:
        return q(w)
    f = fold_factor(bn)
    f = torch.where(f == 0, torch.full_like(f, torch.finfo(f.dtype).tiny), f)
    f = f.reshape(-1, *([1] * (w.dim() - 1)))
    return q(w * f) / f


def _op_q(patch, w):
    if patch.bn is None:
        return weight_op.mx_plain(patch.wq, w)
    return weight_op.mx_folded(patch.wq, w, patch.bn)


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


def _compare_layer(patch, w0):
    """Value (bits, so -0 vs +0 counts), scale and gradients to W and γ of the op (run
    eagerly) against the eager quantizer."""
    bn = patch.bn
    g = torch.randn_like(w0)
    results = []
    for use_op in (False, True):
        w = w0.clone().requires_grad_(True)
        if bn is not None:
            bn.weight.grad = None
        out = (_op_q if use_op else _eager_q)(patch, w)
        assert out is not None
        scale = patch.wq.current_scale().clone()
        out.backward(g)
        results.append((out.detach(), scale, w.grad.clone(), None if bn is None else bn.weight.grad.clone()))
    (o0, s0, gw0, gg0), (o1, s1, gw1, gg1) = results
    assert torch.equal(_bits(o0), _bits(o1)) and torch.equal(s0, s1)
    assert torch.equal(_bits(gw0), _bits(gw1))
    if bn is not None:
        assert torch.equal(_bits(gg0), _bits(gg1))
    return gw1


@pytest.mark.parametrize("spec", ["mxfp4", "nvfp4", "fp8-tensor", "fp6-channel"])
def test_mx_op_equals_the_eager_quantizer(spec, tmp_path):
    """``weight_op.mx_folded`` / ``mx_plain`` (the MX op, run eagerly) give the eager QAT
    value (bit for bit), scale and gradients to W and γ of every layer: the three
    BN-folded convs (incl. a zero γ channel; rows of 27, 45 and 90: a lone short block,
    one full block and a short one) and the unfolded Linear head."""
    model, _ = _net(_mx_spec(spec, tmp_path))
    patches = list(get_handle(model).layers.values())
    assert len(patches) == 4 and sum(p.bn is not None for p in patches) == 3
    for patch in patches:
        w0 = patch.master("weight").detach()
        assert weight_op.mx_applies(patch.wq, w0), (spec, patch.fqn)
        assert not weight_op.applies(patch.wq, w0)  # the int op's cases are not the MX op's
        gw = _compare_layer(patch, w0)
        assert gw.abs().sum() > 0


@pytest.mark.parametrize("spec", ["mxfp4", "nvfp4"])
def test_mx_op_zero_subnormal_and_short_blocks(spec, tmp_path):
    """Blocks of zeros (incl. -0), of float32 subnormals, of values past the top of the
    grid, and a short last block, through both forms: the op equals the eager quantizer
    bit for bit (values, scales, gradients)."""
    model, _ = _net(_mx_spec(spec, tmp_path))
    patches = list(get_handle(model).layers.values())
    for patch in patches:
        w0 = patch.master("weight").detach().clone()
        rows = w0.reshape(w0.shape[0], -1)
        rows[0] = 0.0
        rows[1, ::2] = -0.0
        rows[1, 1::2] = 0.0
        rows[2] = torch.linspace(-1, 1, rows.shape[1]) * 1e-39  # subnormal float32
        rows[3, :5] = torch.tensor([3e-45, -1e-45, 0.0, 2e-40, -7e-41])
        rows[3, -3:] = torch.tensor([1e30, -2e-30, 5e-3])  # the short last block (or the row's only one)
        rows[4, :] = rows[4, :] * 1e20
        _compare_layer(patch, w0)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("case", range(4))
def test_mx_opcheck(case, layout):
    """torch.library.opcheck of both MX ops (fake implementations, strides, autograd), folded
    and not, group / channel / tensor slots; outputs in the weight's layout."""
    torch.manual_seed(case)
    w = torch.randn(6, 5, 3, 3) * 0.3  # rows of 45: one block of 32 and a short one of 13
    w[1] = 0.0
    if layout == "channels_last":
        w = w.contiguous(memory_format=torch.channels_last)
    gamma = torch.rand(6) + 0.5
    gamma[2] = 0.0
    inv_std = torch.rand(6) + 0.5
    args = [
        (w, gamma, inv_std, "fp4_e2m1", 32, None, "pot"),
        (w, None, None, "fp4_e2m1", 16, None, "fp8_e4m3"),
        (w, None, inv_std, "fp8_e4m3", None, None, "float"),
        (w, None, None, "fp6_e3m2", None, 0, "pot_ceil"),
    ][case]
    out = weight_op.mx_weight_fq(*args)
    folded = args[2] is not None
    for t in (out[0], out[3]) + ((out[2],) if folded else ()):
        assert t.stride() == w.stride()
    torch.library.opcheck(weight_op.mx_weight_fq, _with_grads(args))
    _o, _s, xhat, mask, f = out
    torch.library.opcheck(weight_op.mx_weight_fq_backward,
                          (torch.randn_like(w), w, args[1], args[2], xhat, mask, f))


def test_mx_live_fold_traces_the_op_and_compiles_once():
    """A compiled mxfp4 training forward calls the MX op once per layer (three folded convs
    and the Linear head), in one graph, compiled once, with no graph break; nothing
    else of the weights' quantization is traced (no minifloat rounding in the graph)."""
    from torch._dynamo.utils import counters

    model, x = _net(SPECS / "mxfp4.qspec")
    counters.clear()
    ops, compiled = _traced(model, x)
    for _ in range(2):
        compiled(x).sum().backward()
    assert sum("qdsl.mx_weight_fq" in op for op in ops) == 4, ops
    assert not any("fold_weight_fq" in op for op in ops)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(x).graph_break_count == 0


def test_mx_op_only_for_training_forwards():
    """Without gradients (evaluation before freeze, BN in train mode or not) the MX op does
    not apply: the traced general path computes the plain fake quantization (no +0 of
    the QAT surrogate)."""
    model, x = _net(SPECS / "mxfp4.qspec")
    patches = list(get_handle(model).layers.values())
    with torch.no_grad():
        for patch in patches:
            w = patch.master("weight")
            assert weight_op.mx_plain(patch.wq, w) is None
            if patch.bn is not None:
                assert weight_op.mx_folded(patch.wq, w, patch.bn) is None
    ops, compiled = _traced(model, x)
    with torch.no_grad():
        compiled(x)
    assert not any("mx_weight_fq" in op for op in ops)

"""What a compiled QAT forward traces (issue 23, compile time): a static activation's
scale arithmetic is not traced again."""

from pathlib import Path

import pytest
import torch

import qdsl.qat
from qdsl import calibrate
from qdsl.patch import apply
from qdsl.quantizers.proxy import TensorQuantizer
from qdsl.zoo.models import conv_bn_relu_net

SPECS = Path(__file__).resolve().parents[2] / "specs"


def _qat_net(spec: str):
    """A small ConvBnReluNet under `spec`, calibrated and prepared for QAT."""
    torch.manual_seed(0)
    model = conv_bn_relu_net(width=8)
    apply(model, SPECS / spec)
    calibrate(model, [torch.randn(8, 3, 16, 16)])
    qdsl.qat.prepare_qat(model)
    return model


def _static_input(spec: str) -> TensorQuantizer:
    q = _qat_net(spec)._qdsl.quantizers["features/3:input"]
    assert not q.stateless and not q.learned
    return q


def _traced_ops(fn, *args) -> list[str]:
    ops: list[str] = []

    def backend(gm, inputs):
        ops.extend(f"{n.target} {sorted(n.kwargs)}" for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return ops, out


@pytest.mark.parametrize("spec", ["pot-asic.qspec", "int8-default.qspec"])
def test_compiled_static_activation_reads_its_qparams(spec):
    """The scale and zero point of a calibrated static activation come from the range
    cache (taken eagerly): no range-to-scale arithmetic in the graph (before: the clamps,
    the division and, for pot, frexp/ldexp were traced on every compile), and the compiled
    forward and gradient equal eager to the bit."""
    q = _static_input(spec)
    x = torch.randn(4, 8, 8, 8) * 3
    xc = x.clone().requires_grad_(True)
    ops, out = _traced_ops(q, xc)
    # range -> scale: clamp(lo, max=0), clamp(hi, min=0), clamp(raw, min=TINY), maximum,
    # frexp/ldexp (pot); the fake quantization's own clamp takes (qmin, qmax) positionally
    assert not any(k in op for op in ops for k in ("frexp", "ldexp", "maximum", "'max'", "'min'")), ops
    out.sum().backward()
    xe = x.clone().requires_grad_(True)
    ref = q(xe)
    ref.sum().backward()
    assert torch.equal(out, ref) and torch.equal(xc.grad, xe.grad)
    scale, zp, _ = q.qparams(x)
    fresh = q._from_range(None, *q._static_range(), q.scale_rule)
    assert torch.equal(scale, fresh[0]) and torch.equal(zp, fresh[1])


def test_static_qparams_follow_new_statistics():
    """The cached qparams are the range's: new statistics give new qparams."""
    q = _static_input("int8-default.qspec")
    before = q.qparams(torch.zeros(1))[0].clone()
    q.observing = True
    q(torch.full((2, 8, 4, 4), 50.0))
    q.observing = False
    after = q.qparams(torch.zeros(1))[0]
    assert not torch.equal(before, after)
    assert torch.equal(after, q._from_range(None, *q.observer.range(), q.scale_rule)[0])


# ------------------------------------------------ fake quantization as one op (qdsl::fake_quant_mask)
def _weight_proxy(spec: str) -> TensorQuantizer:
    model = _qat_net(spec)
    model.train()
    model(torch.randn(8, 3, 16, 16)).sum().backward()  # an eager training step: the searched range is carried
    return model._qdsl.quantizers["features/3:weight"]


@pytest.mark.parametrize("spec", ["pot-asic.qspec", "int8-default.qspec", "w4a8-per-channel.qspec"])
@pytest.mark.parametrize("role", ["input", "weight"])
def test_compiled_fake_quant_is_one_op(spec, role, monkeypatch):
    """With QDSL_FQ_OP=1, under compile the fake quantization of a QAT proxy (per-tensor
    activation, per-channel weight) is one opaque op, not the aten passes inductor generated code for
    (before: round, clamp, the compares of the mask); value and gradient equal eager."""
    monkeypatch.setenv("QDSL_FQ_OP", "1")  # opt-in (see qdsl.quantizers.fq_op)
    q = _static_input(spec) if role == "input" else _weight_proxy(spec)
    x = torch.randn(4, 8, 8, 8) * 3 if role == "input" else torch.randn(16, 8, 3, 3) * 0.3
    xc = x.clone().requires_grad_(True)
    ops, out = _traced_ops(q, xc)
    at = [i for i, op in enumerate(ops) if "qdsl.fake_quant_mask" in op]
    assert len(at) == 1, ops
    # (a pot weight scale rounds in the log domain before the op: the scale's own arithmetic)
    assert not any("round" in op for op in ops[0 if role == "input" else at[0]:]), ops
    g = torch.randn_like(x)
    out.backward(g)
    xe = x.clone().requires_grad_(True)
    ref = q(xe)
    ref.backward(g)
    assert torch.equal(out, ref) and torch.equal(xc.grad, xe.grad)


def _fq_cases():
    torch.manual_seed(1)
    x = torch.randn(3, 5, 4, 6) * 4
    x.view(-1)[:4] = torch.tensor([0.5, -1.5, 2.5, 1e6])  # ties, a clipped value
    s = torch.rand(5) * 0.5 + 0.05
    zp = torch.randint(-3, 4, (5,), dtype=torch.int32)
    cl = x.contiguous(memory_format=torch.channels_last)
    return [
        (x, torch.tensor(0.3), None, -128, 127, None),
        (cl, torch.tensor(0.3), torch.tensor(3, dtype=torch.int32), 0, 255, None),
        (x, s, None, -7, 7, 1),
        (cl, s, zp, -8, 7, 1),
        (x.permute(1, 0, 2, 3).contiguous(), s, None, -127, 127, 0),
    ]


@pytest.mark.parametrize("case", range(5))
def test_fake_quant_op_matches_the_eager_path(case):
    """The op's value, mask and x-gradient equal ste.fake_quant's eager (fused) path bit
    for bit, in any dense layout; torch.library.opcheck validates its fake (meta) and
    autograd registrations."""
    from qdsl.quantizers import fq_op, ste

    x, s, zp, qmin, qmax, axis = _fq_cases()[case]
    out, mask = fq_op.fake_quant_mask(x, s, zp, qmin, qmax, axis)
    assert out.stride() == x.stride() and mask.stride() == x.stride() and mask.dtype == torch.bool
    xe = x.clone().requires_grad_(True)
    ref = ste.fake_quant(xe, s, zp, qmin, qmax, axis=axis)
    g = torch.randn_like(x)
    ref.backward(g)
    xo = x.clone().requires_grad_(True)
    out2 = fq_op.fake_quant_mask(xo, s, zp, qmin, qmax, axis)[0]
    out2.backward(g)
    assert torch.equal(out, ref) and torch.equal(out2, ref) and torch.equal(xo.grad, xe.grad)
    torch.library.opcheck(fq_op.fake_quant_mask, (x.clone().requires_grad_(True), s, zp, qmin, qmax, axis))

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


def _static_input(spec: str) -> TensorQuantizer:
    torch.manual_seed(0)
    model = conv_bn_relu_net(width=8)
    apply(model, SPECS / spec)
    calibrate(model, [torch.randn(8, 3, 16, 16)])
    qdsl.qat.prepare_qat(model)
    q = model._qdsl.quantizers["features/3:input"]
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

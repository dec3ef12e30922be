"""A dynamic activation quantizer under torch.compile (issue 23, int8-dynamic's compiled
step): the per-batch range is one reduction over the tensor as it is, and the compiled
value and gradient equal eager bit for bit, including the non-finite and degenerate ranges."""

from pathlib import Path

import pytest
import torch

import qdsl.qat
from qdsl import calibrate
from qdsl.patch import apply
from qdsl.quantizers.proxy import TensorQuantizer
from qdsl.zoo.models import conv_bn_relu_net

SPECS = Path(__file__).resolve().parents[2] / "specs"
INF, NAN = float("inf"), float("nan")


def _dynamic_input() -> TensorQuantizer:
    torch.manual_seed(0)
    model = conv_bn_relu_net(width=8)
    apply(model, SPECS / "int8-dynamic.qspec")
    calibrate(model, [torch.randn(8, 3, 16, 16)])
    qdsl.qat.prepare_qat(model)
    q = model._qdsl.quantizers["features/3:input"]
    assert q.dynamic and q.axis is None and q.group_size is None
    return q


def _cases() -> list[torch.Tensor]:
    torch.manual_seed(3)
    x = torch.randn(4, 8, 6, 5) * 3
    cl = x.contiguous(memory_format=torch.channels_last)
    some = x.clone()
    some.view(-1)[[0, 7, 40]] = torch.tensor([NAN, INF, -INF])
    return [
        x,
        cl,  # a channels-last activation (a conv's output)
        torch.zeros(4, 8, 6, 5),  # all zero
        torch.full((4, 8, 6, 5), 2.5).contiguous(memory_format=torch.channels_last),  # constant, positive
        torch.full((2, 8, 3, 3), -1.25),  # constant, negative
        some,  # NaN and ±inf among finite values: left out of the range
        torch.full((2, 3, 4, 4), NAN),  # nothing finite: range (0, 0)
        torch.tensor([INF, -INF, NAN, INF]).reshape(1, 4, 1, 1),
        torch.tensor([-0.0, 0.0, -0.0]).reshape(1, 3, 1, 1),
        x.permute(0, 2, 1, 3),  # not contiguous
    ]


def _traced_ops(fn, *args) -> list[str]:
    ops: list[str] = []

    def backend(gm, inputs):
        ops.extend(n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
                   for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return ops


def test_traced_per_tensor_range_is_one_reduction_over_the_tensor():
    """The range of a per-tensor dynamic quantizer is reduced over the tensor as it is (no
    reshape to one row first: under inductor the flattened view of a channels-last
    activation was a scalar gather loop, not vectorised) and without a separate
    "any finite value" reduction (an empty finite set shows as min > max)."""
    q = _dynamic_input()
    x = torch.randn(4, 8, 6, 6).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    ops = _traced_ops(q, x)
    assert sorted(op for op in ops if op in ("amin", "amax", "any", "aminmax", "all")) == ["amax", "amin"], ops
    assert not any(k in op for op in ops for k in ("reshape", "view", "flatten")), ops


@pytest.mark.parametrize("case", range(10))
def test_traced_range_equals_the_eager_observer(case):
    """``traced_range`` (the compiled forward's range) equals what the eager observer
    records for the same tensor, for every case of the non-finite policy."""
    q = _dynamic_input()
    x = _cases()[case]
    obs = q.observer
    lo, hi = obs.traced_range(x, False)
    obs.reset()
    obs(x)
    elo, ehi = obs.range()
    assert lo.shape == elo.shape == () and hi.shape == ehi.shape == ()
    assert torch.equal(lo, elo) and torch.equal(hi, ehi), (lo, hi, elo, ehi)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(10))
def test_inductor_dynamic_quantizer_equals_eager(case):
    """Compiled with inductor, a dynamic quantizer's value and gradient equal the eager
    QAT path (torch's fused kernel) bit for bit; the graph has no break.

    Except a NaN element's value, as before this change: eager (torch's fused kernel)
    gives code qmin, the compiled ``clamp`` keeps NaN; its gradient is 0 in both."""
    q = _dynamic_input()
    x = _cases()[case]
    g = torch.randn(x.shape).to(memory_format=torch.channels_last if x.is_contiguous(
        memory_format=torch.channels_last) else torch.contiguous_format)
    torch._dynamo.reset()
    compiled = torch.compile(q, backend="inductor", fullgraph=True)
    xc = x.clone().requires_grad_(True)
    out = compiled(xc)
    out.backward(g)
    xe = x.clone().requires_grad_(True)
    ref = q(xe)
    ref.backward(g)
    num = ~torch.isnan(x)
    assert torch.equal(out[num], ref[num]), (out, ref)
    assert torch.equal(xc.grad, xe.grad)
    assert torch._dynamo.explain(q)(x.clone().requires_grad_(True)).graph_break_count == 0


def test_compiled_fake_quant_saves_no_bool_mask():
    """Compiled, the clipping-mask STE saves the clamp's displacement (float) and builds
    the mask in the backward: the forward saves no bool tensor of the activation's size
    (inductor's CPU code converts a bool mask element by element; storing it cost more than
    the rest of the fake quantization).  Eager still saves the bool mask
    (qdsl.quantizers.ste._FakeQuant)."""
    from torch._dynamo.backends.common import aot_autograd

    q = _dynamic_input()
    x = torch.randn(4, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    saved: list = []

    def fw(gm, inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        saved.extend(a.meta.get("val") for a in out.args[0] if hasattr(a, "meta"))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(q, backend=aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, _: gm.forward),
                             fullgraph=True)
    xc = x.clone().requires_grad_(True)
    out = compiled(xc)
    g = torch.randn_like(x)
    out.backward(g)
    assert saved and not any(t is not None and t.dtype == torch.bool and t.numel() == x.numel() for t in saved), saved
    xe = x.clone().requires_grad_(True)
    ref = q(xe)
    ref.backward(g)
    assert torch.equal(out, ref) and torch.equal(xc.grad, xe.grad)

"""Minifloat / MX quantizers under torch.compile (issue 23): the bit-level formulation the
compiled step traces (grid steps, the shared exponent and the per-block max-abs from the
float32 bits) equals the frexp/ldexp reference, and a compiled QAT forward and backward
equals eager bit for bit, ragged last blocks, zero and subnormal blocks and inf/NaN included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qdsl.quantizers import functional as F
from qdsl.quantizers import proxy_grad, weight_op
from qdsl.quantizers.formats import minifloat as M
from qdsl.quantizers.observers import Observer
from qdsl.spec.formats import MINIFLOAT_PRESETS, MinifloatFormat
from qdsl.spec.model import Granularity, GranularityKind, Role
from test_minifloat import group, quantizer

_FORMATS = list(MINIFLOAT_PRESETS.values()) + [
    MinifloatFormat("e4m3_bias1", 4, 3, bias=1), MinifloatFormat("e3m2_bias_m3", 3, 2, bias=-3)]


def _reference_round(y, fmt, mode):
    """minifloat_round as it was written with frexp/ldexp steps (a division by the step)."""
    step = M._steps(y.abs(), fmt)
    r = F.round_(y / step, mode)
    return torch.clamp(r * step, -fmt.max_normal, fmt.max_normal)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except a NaN's payload and sign (the documented NaN policy)."""
    na, nb = a.isnan(), b.isnan()
    return torch.equal(na, nb) and torch.equal(a[~na].view(torch.int32), b[~nb].view(torch.int32))


_BITS = st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=64)


@pytest.mark.parametrize("fmt", _FORMATS, ids=lambda f: f"{f.name}-b{f.bias}")
@settings(max_examples=60, deadline=None)
@given(bits=_BITS, mode=st.sampled_from(["half_even", "floor", "half_away"]))
def test_bit_steps_equal_the_frexp_steps(fmt, bits, mode):
    """Any float32 bit pattern: zeros, subnormals, normals, ±inf, NaN."""
    y = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    assert M._bits_ok(fmt)
    assert _same(M.minifloat_round(y, fmt, mode), _reference_round(y, fmt, mode))


_AMAX = st.one_of(st.floats(0, 3.3999999521443642e+38, width=32), st.sampled_from([0.0, 1e-45, 1.1754942e-38, 1.1754944e-38,
                                                                   2.0**-127, 6.0, 8.0, 448.0, 2.0**127]))


@pytest.mark.parametrize("kind", list(MINIFLOAT_PRESETS))
@settings(max_examples=80, deadline=None)
@given(amax=st.lists(_AMAX, min_size=1, max_size=16))
def test_mx_scale_from_bits_equals_mx_scale(kind, amax):
    fmt = MINIFLOAT_PRESETS[kind]
    a = torch.tensor(amax, dtype=torch.float32)
    assert torch.equal(M._mx_scale_bits(a.view(torch.int32), fmt), M.mx_scale(a, fmt))


_ELEMS = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 1e-45, -1e-40, float("inf"), float("-inf"), float("nan")]))


@settings(max_examples=80, deadline=None)
@given(data=st.data(), rows=st.integers(1, 4), cols=st.integers(1, 70), g=st.sampled_from([None, 1, 16, 32]))
def test_finite_absmax_bits_equal_the_observers_range(data, rows, cols, g):
    """``max(-lo, hi)`` of the observers' finite min/max, per group (ragged last block incl.)
    or per channel, from the bits; a slot with no finite value gives 0."""
    vals = data.draw(st.lists(_ELEMS, min_size=rows * cols, max_size=rows * cols))
    x = torch.tensor(vals, dtype=torch.float32).reshape(rows, cols)
    lo, hi = Observer._finite_minmax(F.reduce_view(x, 0 if g is None else None, g))
    want = torch.maximum(-lo, hi).reshape(F.param_shape(tuple(x.shape), 0 if g is None else None, g))
    got = M._finite_absmax_bits(x, 0 if g is None else None, g).reshape(want.shape).view(torch.float32)
    assert torch.equal(got, want)


def _weights(rows, cols, seed, specials):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 3)
    w[0, : min(cols, 32)] = 0.0  # an all-zero block
    if specials:
        w[1, 3], w[1, 0] = float("nan"), -0.0
        w[2, min(7, cols - 1)], w[2, min(8, cols - 1)] = float("inf"), float("-inf")
        w[3, :] = torch.randn(cols, generator=g) * 1e-40  # subnormal blocks
    return w


def _capture_forward_graphs():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def fw(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return graphs, aot_autograd(fw_compiler=fw)


def test_compiled_mx_weight_traces_no_frexp_and_one_reduction(monkeypatch):
    """The compiled training forward of an MXFP4 weight where the opaque op
    (qdsl.quantizers.weight_op.mx_plain) does not apply, the traced general path: no
    frexp/ldexp/pow (inductor ran frexp one element at a time and ldexp as a vector pow) and
    the block max-abs as one integer amax per block shape, not the observer's masked
    amin/amax/any."""
    monkeypatch.setattr(weight_op, "mx_plain", lambda q, x: None)
    torch._dynamo.reset()
    q = quantizer("fp4_e2m1", scale="pot", gran=group(32))
    proxy_grad.install(q)
    graphs, backend = _capture_forward_graphs()
    w = _weights(6, 40, 0, False).requires_grad_()
    torch.compile(lambda t: q(t), backend=backend, fullgraph=True)(w).sum().backward()
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert targets
    assert not [t for t in targets if any(k in t for k in ("frexp", "ldexp", "pow", "amin", "any"))], targets
    assert sum("amax" in t for t in targets) == 2  # the full blocks and the ragged last one


@pytest.mark.slow
@pytest.mark.parametrize("kind,shape", [("fp4_e2m1", (6, 40)), ("fp8_e4m3", (5, 27)), ("fp6_e2m3", (4, 96)),
                                        ("fp4_e2m1", (4, 8, 3, 3))])
@pytest.mark.parametrize("path", ["op", "traced"])
def test_inductor_mx_weight_equals_eager(kind, shape, path, monkeypatch):
    """Values bit for bit and gradients equal, for the same compiled function on several
    weights (ragged last blocks: 40 = 32 + 8, 27 < 32, 72 = 2·32 + 8), through the opaque
    op (qdsl::mx_weight_fq) and the traced general path (where the op does not apply)."""
    if path == "traced":
        monkeypatch.setattr(weight_op, "mx_plain", lambda q, x: None)
    torch._dynamo.reset()
    q = quantizer(kind, scale="pot", gran=group(32))
    proxy_grad.install(q)
    f = torch.compile(lambda t: q(t), backend="inductor", fullgraph=True)
    for seed in range(4):
        w = _weights(shape[0], int(np.prod(shape[1:])), seed, specials=seed > 0).reshape(shape)
        a, b = w.clone().requires_grad_(), w.clone().requires_grad_()
        ya, yb = f(a), q(b)
        assert _same(ya.detach(), yb.detach()), seed
        g = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        ya.backward(g)
        yb.backward(g)
        assert torch.equal(a.grad, b.grad), seed


@pytest.mark.slow
def test_inductor_fp8_activation_equals_eager():
    """A static fp8_e4m3 activation (the mxfp4 spec's input quantizer) in a compiled
    training forward: the bit-level element rounding, values and gradient mask."""
    torch._dynamo.reset()
    q = quantizer("fp8_e4m3", gran=Granularity(GranularityKind.TENSOR), role=Role.INPUT)
    proxy_grad.install(q)
    x = torch.randn(4, 3, 8, 8) * 50
    q.observing = True
    q(x)
    q.observing = False
    f = torch.compile(lambda t: q(t), backend="inductor", fullgraph=True)
    for seed in range(3):
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed)) * 50
        x[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 1e-40, 1e4])
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = f(a), q(b)
        assert _same(ya.detach(), yb.detach()), seed
        ya.sum().backward()
        yb.sum().backward()
        assert torch.equal(a.grad, b.grad), seed

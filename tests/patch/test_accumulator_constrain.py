"""``accumulator(bits=P, constrain=true)`` (qdsl.patch.constrain): after freeze no input in
the quantized input range can overflow P bits, checked by the exact bound and by running the
worst input (every code at the vertex that maximizes / minimizes each channel's sum)
through the integer graph (0 overflows; C++ == reference).  Without ``constrain`` the same
worst input overflows, so the test is not vacuous."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import qdsl
import qdsl.runtime as rt
from qdsl.graph.reference import execute
from qdsl.patch import get_handle
from qdsl.patch.accumulate import fits, reachable
from qdsl.patch.constrain import constraint_report

SPEC = """version 1
quantizer w = int(bits={wbits}, signed, narrow, symmetric, {gran}, observer=minmax, scale={scale})
quantizer a = int(bits=8, {sign}, {sym}, per_tensor, observer=minmax)
defaults {{
  weight = w
  input = a
  bias = int(bits=32, signed, symmetric, scale=input*weight)
  accumulator(bits={bits}, overflow=wrap{constrain})
}}
"""


def _frozen(n_in, n_out, bits, constrain, *, sign="unsigned", sym="asymmetric", gran="per_channel",
            scale="float", wbits=8, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(n_in, n_out))
    x = torch.randn(32, n_in) * 2 + (1.0 if sign == "unsigned" else 0.0)
    spec = SPEC.format(bits=bits, constrain=", constrain=true" if constrain else "", sign=sign, sym=sym,
                       gran=gran, scale=scale, wbits=wbits)
    qdsl.apply(model, qdsl.parse_spec(spec))
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    return model, x


def _worst_inputs(model) -> torch.Tensor:
    """Per output channel, the input (as float, on the input grid) reaching its largest and
    its smallest exact sum."""
    patch = get_handle(model).layers["0"]
    iq = patch.iq
    z = int(iq.zero_point.reshape(-1)[0])
    lo, hi = int(iq.qmin) - z, int(iq.qmax) - z
    w = qdsl.int_tensors(model)["0"].weight.to(torch.int64)
    up = torch.where(w > 0, hi, lo)
    down = torch.where(w > 0, lo, hi)
    codes = torch.cat([up, down]).double()
    return (codes * iq.scale.double()).float()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bits=st.integers(10, 16), n_in=st.integers(8, 96), n_out=st.integers(1, 6), seed=st.integers(0, 999),
       signed_input=st.booleans())
def test_constrained_layer_cannot_overflow(bits, n_in, n_out, seed, signed_input):
    kw = dict(sign="signed", sym="symmetric") if signed_input else {}
    model, x = _frozen(n_in, n_out, bits, True, seed=seed, **kw)
    patch = get_handle(model).layers["0"]
    ints = qdsl.int_tensors(model)["0"]
    z = int(patch.iq.zero_point.reshape(-1)[0])
    s_acc = patch.iq.scale.double() * patch.wq.scale.double()
    b = torch.round(patch.module.bias.detach().double() / s_acc).to(torch.int64)
    lo, hi = reachable(ints.weight.to(torch.int64), b, [(int(patch.iq.qmin) - z, int(patch.iq.qmax) - z)])
    assert bool(fits(lo, hi, bits).all())
    worst = _worst_inputs(model)
    graph = qdsl.export(model, worst)
    res = execute(graph, worst.numpy())
    assert res.overflow["0"] == 0
    if rt.available():
        np.testing.assert_array_equal(rt.CompiledGraph(graph).run(worst.numpy()), res.outputs[0])
    (cost,) = constraint_report(model)
    assert cost.fqn == "0" and 0 < cost.l1_kept <= 1 and cost.constrained <= cost.channels == n_out


def test_unconstrained_worst_input_overflows():
    model, _ = _frozen(64, 4, 14, False)
    worst = _worst_inputs(model)
    res = execute(qdsl.export(model, worst), worst.numpy())
    assert res.overflow["0"] > 0
    assert constraint_report(model) == []


@pytest.mark.parametrize("gran,scale", [("per_tensor", "float"), ("per_channel", "pot")])
def test_shared_and_power_of_two_scales_stay_valid(gran, scale):
    model, _ = _frozen(64, 4, 13, True, gran=gran, scale=scale)
    s = get_handle(model).layers["0"].wq.scale.double().reshape(-1)
    if scale == "pot":
        assert torch.equal(torch.exp2(torch.round(torch.log2(s))), s)
    else:
        assert s.numel() == 1
    worst = _worst_inputs(model)
    assert execute(qdsl.export(model, worst), worst.numpy()).overflow["0"] == 0
    (cost,) = constraint_report(model)
    assert cost.constrained == 4 and cost.l1_kept < 1


def test_constraint_keeps_loose_layers_unchanged():
    # a 32-bit accumulator never binds at fan-in 16: nothing is re-quantized
    model, _ = _frozen(16, 3, 32, True)
    (cost,) = constraint_report(model)
    assert cost.constrained == 0 and cost.l1_kept == 1.0 and cost.max_scale_factor == 1.0


def test_qat_trains_on_exact_sums_then_freeze_projects():
    # before freeze a constrained layer is not simulated (the projection removes every
    # overflow the training forward would see); a plain wrapping one is
    torch.manual_seed(0)
    outs = {}
    for constrain in (True, False):
        model = nn.Sequential(nn.Linear(64, 4))
        with torch.no_grad():
            model[0].weight.abs_()
        x = torch.rand(8, 64) * 4
        spec = SPEC.format(bits=12, constrain=", constrain=true" if constrain else "", sign="unsigned",
                           sym="asymmetric", gran="per_channel", scale="float", wbits=8)
        qdsl.apply(model, qdsl.parse_spec(spec))
        qdsl.calibrate(model, [x])
        model(x).sum().backward()
        outs[constrain] = get_handle(model).layers["0"].acc_sim.simulated
        assert model[0].weight_float.grad.abs().sum() > 0
    assert outs == {True: False, False: True}


def test_explain_shows_the_constraint():
    from qdsl.resolve.explain import format_value
    from qdsl.spec.model import Accumulator, Overflow

    assert format_value(Accumulator(16, Overflow.WRAP, True)) == "int16 (wrap, constrained)"
    assert format_value(Accumulator(16, Overflow.SATURATE)) == "int16 (saturate)"

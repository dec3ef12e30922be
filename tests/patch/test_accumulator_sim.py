"""The fake-quant model simulates the spec's accumulator (qdsl.patch.accumulate): with a
narrow ``accumulator(bits=P, overflow=wrap|saturate)`` its layer outputs equal the integer
graph's (reference executor, and C++ when built) on the same wrapped/saturated sums, and it
counts the same overflows.  Before, the fake-quant layer summed in float and never
overflowed (digits ResNet, 16-bit wrap: 11% top-1 agreement with its graph)."""

from __future__ import annotations

import warnings

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
from qdsl.parse import parse_text
from qdsl.patch.accumulate import saturate_sum, wrap_sum

SPEC = """version 1
quantizer w8 = int(bits={wbits}, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, {sign}, asymmetric, per_tensor, observer=minmax)
defaults {{
  weight = w8
  input = a8
  bias = int(bits=32, signed, symmetric, scale=input*weight)
  accumulator(bits={bits}, overflow={overflow})
}}
"""


class One(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


def _flow(layer: nn.Module, x: torch.Tensor, bits: int, overflow: str, wbits: int = 8, sign: str = "unsigned"):
    model = One(layer)
    qdsl.apply(model, qdsl.parse_spec(SPEC.format(bits=bits, overflow=overflow, wbits=wbits, sign=sign)))
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    graph = qdsl.export(model, x)
    with torch.no_grad():
        fq = model(x).numpy()
    return model, graph, fq


def test_wrap_and_saturate_match_python_integers():
    s = torch.tensor([-(1 << 20), -32769, -32768, -1, 0, 32767, 32768, 70000], dtype=torch.int64)
    for v, w, t in zip(s.tolist(), wrap_sum(s, 16).tolist(), saturate_sum(s, 16).tolist()):
        assert w == ((v + 32768) % 65536) - 32768
        assert t == min(max(v, -32768), 32767)
    assert torch.equal(wrap_sum(s, 64), s)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["linear", "conv1d", "conv2d"]), bits=st.integers(8, 14),
       overflow=st.sampled_from(["wrap", "saturate"]), bias=st.booleans(), seed=st.integers(0, 2**16),
       sign=st.sampled_from(["unsigned", "signed"]))
def test_fake_quant_equals_reference_under_forced_overflow(kind, bits, overflow, bias, seed, sign):
    torch.manual_seed(seed)
    cin = int(torch.randint(3, 9, ()))
    if kind == "linear":
        layer, x = nn.Linear(cin * 8, 5, bias=bias), torch.randn(4, cin * 8).abs() * 3
    elif kind == "conv1d":
        layer, x = nn.Conv1d(cin, 4, 3, padding=1, bias=bias), torch.randn(2, cin, 9).abs() * 3
    else:
        layer, x = nn.Conv2d(cin, 4, 3, padding=1, stride=2, bias=bias), torch.randn(2, cin, 7, 6).abs() * 3
    with torch.no_grad():  # same-signed weights so sums are large: overflow is forced
        layer.weight.abs_()
        if bias:
            layer.bias.uniform_(-1, 1)
    model, graph, fq = _flow(layer, x, bits, overflow, sign=sign)
    res = execute(graph, x.numpy())
    sim = get_handle(model).layers["layer"].acc_sim
    assert sim.simulated
    assert sim.overflows == res.overflow["layer"]
    # graph output: the wrapped/saturated accumulator rounded onto a power-of-two int32 grid
    # (half a step) and dequantized; fake-quant: the same integers times s_acc
    step = graph.ops[-1].attrs["scale"]
    np.testing.assert_allclose(fq, res.outputs[0], rtol=0, atol=0.5 * step * (1 + 1e-5))
    if rt.available():
        np.testing.assert_array_equal(rt.CompiledGraph(graph).run(x.numpy()), res.outputs[0])


@pytest.mark.parametrize("overflow", ["wrap", "saturate"])
def test_overflow_counts_and_output_codes_equal_reference(overflow):
    # an output quantizer after the overflowing sum: codes equal (within 1 LSB as usual)
    torch.manual_seed(0)
    layer = nn.Conv2d(8, 6, 3, padding=1)
    with torch.no_grad():
        layer.weight.abs_()
    x = torch.rand(3, 8, 6, 6) * 4
    spec = SPEC.format(bits=14, overflow=overflow, wbits=8, sign="unsigned").replace(
        "  input = a8\n", "  input = a8\n  output = a8\n")
    model = One(layer)
    qdsl.apply(model, qdsl.parse_spec(spec))
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    graph = qdsl.export(model, x)
    res = execute(graph, x.numpy())
    assert res.overflow["layer"] > 0
    with torch.no_grad():
        fq = model(x).numpy()
    s = get_handle(model).layers["layer"].oq.scale.item()
    diff = np.abs(np.round((fq - res.outputs[0]) / s))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_fast_path_when_no_input_can_overflow():
    # 8-bit x 8-bit, fan-in 8: at most 8·255·127 < 2^18 -> a 20-bit accumulator cannot overflow
    torch.manual_seed(0)
    layer = nn.Linear(8, 3)
    x = torch.randn(5, 8)
    model, graph, fq = _flow(layer, x, 20, "wrap")
    assert not get_handle(model).layers["layer"].acc_sim.simulated


def test_saturate_gradient_is_masked_and_wrap_is_straight_through():
    torch.manual_seed(0)
    for overflow in ("wrap", "saturate"):
        layer = nn.Linear(16, 2, bias=False)
        with torch.no_grad():
            layer.weight.abs_()
            layer.weight[1].mul_(1e-3)  # row 1 stays far inside 12 bits
        x = torch.rand(4, 16) * 3
        model = One(layer)
        qdsl.apply(model, qdsl.parse_spec(SPEC.format(bits=12, overflow=overflow, wbits=8, sign="unsigned")))
        qdsl.calibrate(model, [x])
        xg = x.clone().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = model(xg)
        sim = get_handle(model).layers["layer"].acc_sim
        assert sim.simulated and sim.overflows > 0
        y[:, 0].sum().backward()
        g_master = layer.weight_float.grad
        if overflow == "wrap":
            assert g_master[0].abs().sum() > 0  # the float layer's gradient passes the wrap
        else:
            assert g_master[0].abs().sum() == 0  # every row-0 output saturated: no gradient


@pytest.mark.parametrize("bits", [40, 64])
def test_wide_accumulators_take_the_fast_path_and_match(bits):
    torch.manual_seed(0)
    layer = nn.Conv2d(4, 3, 3, padding=1)
    x = torch.rand(2, 4, 5, 5)
    model, graph, fq = _flow(layer, x, bits, "wrap")
    assert [op.attrs["acc_bits"] for op in graph.ops if "acc_bits" in op.attrs] == [bits]
    sim = get_handle(model).layers["layer"].acc_sim
    assert (sim is None) if bits == 64 else not sim.simulated  # 64 bits: no hook at all
    res = execute(graph, x.numpy())
    np.testing.assert_allclose(fq, res.outputs[0], rtol=0, atol=0.5 * graph.ops[-1].attrs["scale"] * (1 + 1e-5))
    if rt.available():
        np.testing.assert_array_equal(rt.CompiledGraph(graph).run(x.numpy()), res.outputs[0])


def test_layer_it_cannot_simulate_is_named_in_a_warning():
    # no input quantizer on the layer: its input scale is not local, so no simulation
    spec = SPEC.format(bits=16, overflow="wrap", wbits=8, sign="unsigned").replace("  input = a8\n", "")
    spec = spec.replace("  bias = int(bits=32, signed, symmetric, scale=input*weight)\n", "")
    model = One(nn.Linear(8, 2))
    qdsl.apply(model, qdsl.parse_spec(spec))
    with pytest.warns(UserWarning, match="'layer': its 16-bit accumulator is not simulated"):
        model(torch.randn(3, 8))


def test_sums_beyond_exact_binary64_pass_the_float_output_through():
    """Power-of-two weights with wide exponents and dynamic signed inputs (hypothesis found it
    in test_check_apply_parity): the reachable sums leave exact binary64, so the default
    accumulator is not simulated and the forward runs (it raised a QdslError before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4 * 4, 5))
    spec = ("version 1\ndefaults {\n"
            "  weight = (kind=pot, signed, narrow, symmetric, scale=float, granularity=tensor, "
            "observer=minmax, rounding=half_even)\n"
            "  input = (kind=int, signed, narrow, symmetric, dynamic)\n}\n")
    qdsl.apply(model, parse_text(spec))
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        qdsl.calibrate(model, [x], progress=False)
    qdsl.freeze(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default 32-bit accumulator does not warn
        y = model(x)
    assert y.shape == (2, 5) and torch.isfinite(y).all()


def test_weight_scales_along_input_channels_pass_the_float_output_through():
    """``granularity=channel(1)`` on a conv weight gives one scale per *input* channel: there
    is no single s_x·s_w per output channel to simulate, so the layer passes its float output
    through (hypothesis found the shape error in test_check_apply_parity)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4 * 4, 5))
    spec = ("version 1\ndefaults {\n  weight = (kind=int, narrow)\n  input = (kind=int, narrow, dynamic)\n}\n"
            "rule type:Conv2d { weight = (kind=int, narrow, scale=float, granularity=channel(1)) }\n")
    qdsl.apply(model, parse_text(spec))
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        qdsl.calibrate(model, [x], progress=False)
    qdsl.freeze(model)
    y = model(x)
    assert y.shape == (2, 5) and torch.isfinite(y).all()

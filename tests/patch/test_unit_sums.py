"""A frozen XNOR/ternary layer without autograd sums its codes in binary32
(qdsl.patch.unit_sums) instead of running a binary64 conv: by default (``codes``) wherever it
applies, the formula ``float32(fl64(S·p) + b)`` of the exact integer sum ``S``; with
``QDSL_FROZEN_SUMS=certified`` only where that gives the binary64 conv's bits in any summation
order (power-of-two scales).  Before, every frozen eval forward ran the binary64 conv
(xnor CNN: ~5x the float forward)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import qdsl
import qdsl.qat
from qdsl.patch import get_handle
from qdsl.patch.unit_sums import MODE_ENV, certified
from qdsl.spec.diagnostics import QdslError

SPEC = """version 1
quantizer wb = {wkind}(signed, {wgran}, {scale}observer=mean_abs)
quantizer ab = {akind}(signed, per_tensor, {scale}observer=mean_abs)
defaults {{
  weight = wb
  input = ab
  {bias}
  {acc}
}}
"""


class Net(nn.Module):
    def __init__(self, c: int, k: int, out: int, bias: bool, groups: int, stride: int):
        super().__init__()
        self.conv = nn.Conv2d(c * groups, c * groups, k, stride=stride, padding=k // 2, groups=groups, bias=bias)
        self.act = nn.Hardtanh()
        self.fc = nn.Linear(c * groups, out, bias=bias)

    def forward(self, x):
        y = self.act(self.conv(x))
        return self.fc(y.mean(dim=(2, 3)))


def _frozen(net: nn.Module, x: torch.Tensor, wkind="binary", akind="binary", wgran="per_channel",
            bias="bias = int(bits=32, signed, symmetric, scale=input*weight)", acc="", pot=False):
    spec = SPEC.format(wkind=wkind, akind=akind, wgran=wgran, bias=bias, acc=acc, scale="scale=pot, " if pot else "")
    qdsl.apply(net, qdsl.parse_spec(spec))
    qdsl.calibrate(net, [x], progress=False)
    qdsl.freeze(net)
    return net.eval()


def _outputs(net: nn.Module, x: torch.Tensor, monkeypatch, mode: str | None) -> dict:
    """Every patched layer's output (and the dtype its module computed in), one no-grad forward
    (``mode`` None: the variable unset, the default)."""
    if mode is None:
        monkeypatch.delenv(MODE_ENV, raising=False)
    else:
        monkeypatch.setenv(MODE_ENV, mode)
    got, hooks = {}, []
    for name, m in net.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            hooks.append(m.register_forward_hook(lambda mod, a, out, n=name: got.__setitem__(n, out.detach().clone())))
            hooks.append(m.register_forward_pre_hook(lambda mod, a, n=name: got.__setitem__(n + ":in", a[0].dtype)))
    try:
        with torch.no_grad():
            got["out"] = net(x)
    finally:
        for h in hooks:
            h.remove()
    return got


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _formula(net: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """``float32(fl64(S·p_c) + b_c)`` of one frozen unit layer on its quantized input ``x``,
    with ``S`` the exact integer sum (int64 arithmetic on the codes)."""
    m = dict(net.named_modules())[name]
    w, b = m.weight.detach(), m.bias
    codes_w = torch.sign(w).to(torch.int64)
    codes_x = torch.sign(x).to(torch.int64)
    if isinstance(m, nn.Linear):
        s = codes_x @ codes_w.T
        view = (-1,)
    else:
        s = F.conv2d(codes_x.double(), codes_w.double(), None, m.stride, m.padding, m.dilation, m.groups)
        assert bool((s.abs() < 2**53).all())  # a sum of ±1: exact in binary64, any order
        view = (-1, 1, 1)
    p = torch.tensor(float(x.abs().max()), dtype=torch.float64) * w.reshape(w.shape[0], -1).abs().amax(1)
    y = s.double() * p.view(view)
    return (y if b is None else y + b.double().view(view)).float()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=st.integers(1, 9), k=st.sampled_from([1, 3]), out=st.integers(1, 7), bias=st.booleans(),
       groups=st.sampled_from([1, 2]), stride=st.sampled_from([1, 2]), n=st.integers(1, 4), hw=st.integers(3, 9),
       wkind=st.sampled_from(["binary", "ternary"]), wgran=st.sampled_from(["per_channel", "per_tensor"]),
       pot=st.booleans(), seed=st.integers(0, 2**16))
def test_frozen_unit_layers_give_the_binary64_bits(monkeypatch, c, k, out, bias, groups, stride, n, hw, wkind,
                                                   wgran, pot, seed):
    """Default mode: the cheap form exactly where certified (power-of-two scales here), the
    same bits as the binary64 conv on every layer; elsewhere the binary64 conv itself.  The
    ``codes`` mode: on every layer the formula of the exact sum (its value)."""
    torch.manual_seed(seed)
    net = Net(c, k, out, bias, groups, stride)
    x = torch.randn(n, c * groups, hw, hw)
    _frozen(net, x, wkind=wkind, wgran=wgran, pot=pot)
    h = get_handle(net)
    fast, slow = _outputs(net, x, monkeypatch, "certified"), _outputs(net, x, monkeypatch, "binary64")
    assert slow["conv:in"] is torch.float64
    for key in ("conv", "fc"):
        ops = h.layers[key].unit_sums._ops[1]
        assert (fast[key + ":in"] is torch.float32) == ops.certified
        if pot:
            assert ops.certified
    for key in ("conv", "fc", "out"):
        assert _bits_equal(fast[key], slow[key]), key
    got, inputs = {}, {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, f=f: inputs.__setitem__(f, a[0]), prepend=False)
             for f, m in (("conv", net.conv), ("fc", net.fc))]
    codes = _outputs(net, x, monkeypatch, "codes")
    for hk in hooks:
        hk.remove()
    for key in ("conv", "fc"):
        assert codes[key + ":in"] is torch.float32
    # the layer's quantized input (its codes reach the module): rebuild it from the binary64 run
    monkeypatch.setenv(MODE_ENV, "binary64")
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, f=f: seen.__setitem__(f, a[0].float()))
             for f, m in (("conv", net.conv), ("fc", net.fc))]
    with torch.no_grad():
        net(x)
    for hk in hooks:
        hk.remove()
    for key in ("conv", "fc"):  # values: a zero sum's sign is the BLAS's (-0 from one -1·0 product), as in binary64
        assert torch.equal(codes[key], _formula(net, key, seen[key])), key


def test_xnor_cnn_layers_sum_codes_by_default(monkeypatch):
    """The bundled xnor spec (48-bit products ``s_x·s_w``: not certified) sums its codes by
    default, within one binary32 unit of the binary64 conv (the binary64 conv's own
    partial-sum roundings; measured 1 in 21M differ); ``QDSL_FROZEN_SUMS=certified`` keeps the
    binary64 conv on its uncertified layers, bit for bit."""
    from qdsl.zoo.models import conv_bn_relu_net

    torch.manual_seed(0)
    net = conv_bn_relu_net(width=16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, 32, 32, generator=g)
    qdsl.apply(net, "specs/xnor-binary.qspec")
    qdsl.calibrate(net, [x], progress=False)
    qdsl.qat.prepare_qat(net)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    net(x).square().mean().backward()  # one QAT step: the scales leave the round values calibration gave
    opt.step()
    qdsl.freeze(net)
    net.eval()
    h = get_handle(net)
    unit = [f for f, p in h.layers.items() if p.unit_sums is not None]
    assert unit
    for batch in (x, torch.randn(16, 3, 32, 32, generator=g)):
        default, slow = _outputs(net, batch, monkeypatch, "certified"), _outputs(net, batch, monkeypatch, "binary64")
        codes = _outputs(net, batch, monkeypatch, "codes")
        unset = _outputs(net, batch, monkeypatch, None)
        assert all(unset[f + ":in"] is torch.float32 for f in unit)
        assert all(torch.equal(unset[f], codes[f]) for f in unit)
        certified_layers = {f for f in unit if h.layers[f].unit_sums._ops[1].certified}
        assert len(certified_layers) < len(unit)
        assert all(default[f + ":in"] is (torch.float32 if f in certified_layers else torch.float64) for f in unit)
        assert all(codes[f + ":in"] is torch.float32 for f in unit)
        for f in default:
            if not f.endswith(":in"):
                assert _bits_equal(default[f], slow[f]), f
        for f in unit:
            ulps = (codes[f].view(torch.int32).long() - slow[f].view(torch.int32).long()).abs()
            assert int(ulps.max()) <= 1, f


def test_unknown_mode_is_an_error(monkeypatch):
    torch.manual_seed(0)
    net = Net(4, 3, 3, True, 1, 1)
    x = torch.randn(2, 4, 5, 5)
    _frozen(net, x)
    monkeypatch.setenv(MODE_ENV, "fast")
    with pytest.raises(QdslError, match="QDSL_FROZEN_SUMS"), torch.no_grad():
        net(x)


def test_narrow_accumulator_that_can_overflow_keeps_the_binary64_conv(monkeypatch):
    """The accumulator check reads the layer's real input: when it may simulate, the
    binary64 conv runs (and the result is the simulated one, as before)."""
    torch.manual_seed(0)
    net = Net(8, 3, 4, True, 1, 1)
    x = torch.randn(4, 8, 6, 6)
    _frozen(net, x, acc="accumulator(bits=4, overflow=wrap)", pot=True)
    fast, slow = _outputs(net, x, monkeypatch, "codes"), _outputs(net, x, monkeypatch, "binary64")
    assert fast["conv:in"] is torch.float64
    assert get_handle(net).layers["conv"].acc_sim.simulated
    for key in ("conv", "fc", "out"):
        assert _bits_equal(fast[key], slow[key]), key


def test_autograd_keeps_the_binary64_conv(monkeypatch):
    torch.manual_seed(0)
    net = Net(4, 3, 3, True, 1, 1)
    x = torch.randn(2, 4, 5, 5)
    _frozen(net, x, pot=True)
    seen = []
    net.conv.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    monkeypatch.setenv(MODE_ENV, "certified")
    y = net(x.requires_grad_())
    y.sum().backward()
    assert seen == [torch.float64] and x.grad is not None
    with torch.no_grad():
        net(x)
    assert seen[-1] is torch.float32


def test_a_raising_forward_leaves_the_weights_in_place(monkeypatch):
    torch.manual_seed(0)
    net = Net(4, 3, 3, True, 1, 1)
    x = torch.randn(2, 4, 5, 5)
    _frozen(net, x, pot=True)
    monkeypatch.setenv(MODE_ENV, "certified")
    with torch.no_grad():
        ref = net(x)
    h = net.conv.register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")), prepend=True)
    with pytest.raises(RuntimeError), torch.no_grad():
        net(x)
    h.remove()
    with torch.no_grad():  # the next forward's pre-hook swaps the codes back first (as the binary64 shadows)
        assert _bits_equal(net(x), ref)
    assert net.conv.weight.dtype is torch.float64


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 600), e=st.integers(-30, 10), m=st.integers(1, 2**20), bm=st.integers(-2**20, 2**20),
       be=st.integers(-40, 10), seed=st.integers(0, 2**16))
def test_certified_sums_equal_the_binary64_conv_in_any_order(n, e, m, bm, be, seed):
    """Where ``certified`` holds, every summation order of the binary64 terms gives the same
    value, ``fl64(S·p) + b`` (the cheap form): shuffled orders and a blocked order."""
    p = np.ldexp(float(m), e)
    b = np.ldexp(float(bm), be)
    if not certified(np.array([p]), np.array([b]), n):
        return
    rng = np.random.default_rng(seed)
    codes = rng.choice([-1.0, 0.0, 1.0], size=n)
    terms = list(codes * p) + [b]
    fast = float(np.float64(codes.sum()) * p + b)
    for _ in range(3):
        rng.shuffle(terms)
        acc = 0.0
        for t in terms:
            acc += t
        assert acc == fast
    blocks = [sum(terms[i:i + 7]) for i in range(0, len(terms), 7)]
    assert sum(blocks) == fast


def test_certified_fails_for_48_bit_products():
    p = np.float64(np.float32(0.4766176)) * np.float64(np.float32(0.0317))  # the xnor CNN's kind of scales
    assert not certified(np.array([p]), None, 288)
    assert certified(np.array([0.375]), np.array([0.5]), 288)
    assert not certified(np.array([1.0]), np.array([2.0**-60]), 4)  # the bias is off the terms' grid
    # F.conv2d in binary64 with certified operands: equal to the formula bit for bit
    w = torch.tensor([[[[1.0, -1.0], [1.0, 1.0]]]], dtype=torch.float64) * 0.375
    x = torch.sign(torch.randn(2, 1, 5, 5, generator=torch.Generator().manual_seed(0))).double()
    s = F.conv2d(x, torch.sign(w))
    assert torch.equal(F.conv2d(x, w, torch.tensor([0.5], dtype=torch.float64)), s * 0.375 + 0.5)

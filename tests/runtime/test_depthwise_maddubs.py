"""The NHWC depthwise conv on its vpmaddubsw kernel (ConvParams::dwq, DwNhwcQuadKernel in
csrc/kernels/x86/dwconv_nhwc_u8s8_avx2.cc): U8 codes whose weight pairs cannot saturate
int16 (7-bit activations with any int8 weights), four taps per step, 32 channels per step.
It equals the Python reference executor bit for bit on every kernel path this CPU has, and
the plan says which convs take it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Tensor  # noqa: E402
from qdsl.graph.requant import make_rescale  # noqa: E402

from tests.runtime.test_depthwise_conv import _with_threads  # noqa: E402
from tests.runtime.test_graph import PATHS, _check, _rand  # noqa: E402


def _stage7(rng, channels, ties, hi):
    """A FIXED_SINGLE stage (the register stage's kind) onto U8 codes clamped to [qmin, hi]:
    hi = 127 makes the next conv's input 7-bit.  `ties`: scales of 1, 3 or 5 x 2^-j, so many
    sums land exactly on rounding ties (the exact recompute)."""
    n = channels if rng.random() < 0.7 else 1
    if ties:
        scales = rng.choice([1.0, 3.0, 5.0], n) * 2.0 ** -rng.integers(4, 10, n).astype(np.float64)
    else:
        scales = rng.uniform(1e-4, 0.05, n)
    zp = int(rng.integers(0, 8)) if rng.random() < 0.7 else int(rng.integers(0, hi + 1))
    qmin = zp if rng.random() < 0.5 else int(rng.integers(0, zp + 1))  # ReLU: the clamp at zp
    return OutputStage(make_rescale(scales, int(rng.integers(0, 4)), allow_pot=False, single=True), zp, qmin,
                       hi).attrs()


def _chain(rng, *, c, hw, layers, ties, first_hi=127, wlim=None):
    """x (U8) -> dw -> t1 -> dw -> ... -> y, every conv O == C with a FIXED_SINGLE stage onto
    U8: the first stage clamps to first_hi (127: every later conv reads 7-bit codes), the rest
    to 127 or 255 (the last conv's output, read by nothing).  layers: (kh, kw, stride,
    padding, dilation) each.  Weights: int8, a fifth at -128 (pair sums at the saturation
    edge, 2 x 127 x 128), or within [-wlim, wlim]."""
    h, w = hw
    tensors, ops, src = [Tensor("x", DType.U8, (-1, c, h, w))], [], "x"
    for i, (kh, kw, s, pad, dil) in enumerate(layers):
        oh, ow = (h + 2 * pad - dil * (kh - 1) - 1) // s + 1, (w + 2 * pad - dil * (kw - 1) - 1) // s + 1
        if oh < 1 or ow < 1:  # the window must fit the padded input
            pad = dil * max(kh, kw)
            oh, ow = (h + 2 * pad - dil * (kh - 1) - 1) // s + 1, (w + 2 * pad - dil * (kw - 1) - 1) // s + 1
        if wlim is None:
            wt = rng.integers(-128, 128, (c, 1, kh, kw))
            wt[rng.random(wt.shape) < 0.2] = -128
        else:
            wt = rng.integers(-wlim, wlim + 1, (c, 1, kh, kw))
        hi = first_hi if i == 0 else (127 if i < len(layers) - 1 or rng.random() < 0.5 else 255)
        in_zp = int(rng.integers(0, 128))
        attrs = {"stride": [s, s], "padding": [pad, pad], "dilation": [dil, dil], "groups": c, "in_zp": in_zp,
                 "w_zp": [0], "acc_bits": 32, "overflow": 0, **_stage7(rng, c, ties, hi)}
        name = "y" if i == len(layers) - 1 else f"t{i + 1}"
        tensors += [Tensor(f"w{i}", DType.I8, wt.shape, wt),
                    Tensor(f"b{i}", DType.I32, (c,), rng.integers(-90000, 90000, c)),
                    Tensor(name, DType.U8, (-1, c, oh, ow))]
        ops.append(Op(OpType.CONV2D, f"dw{i}", [src, f"w{i}", f"b{i}"], [name], attrs))
        src, h, w = name, oh, ow
    return IntegerGraph(tensors, ["x"], ["y"], ops).validate()


def _x7(rng, shape):
    """U8 codes in 0..255 for the graph input, a third of them at 127 or 255 (the largest codes)."""
    x = _rand(rng, DType.U8, shape)
    x[rng.random(shape) < 0.3] = rng.choice([127, 255])
    return x


KERNELS = [(3, 3), (3, 3), (5, 5), (1, 1), (2, 2), (3, 1), (1, 2), (3, 2), (7, 7)]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), threads=st.sampled_from([1, 2]), ties=st.booleans())
def test_depthwise_maddubs_matches_reference(seed, threads, ties):
    """Chains of depthwise convs whose inner tensors are NHWC 7-bit codes (every layout pair:
    NCHW in / NHWC out, NHWC both, NHWC in / NCHW out): channel counts off the 32-channel
    steps (1..15, a lone 16-channel half, 17..31 past a whole step), kernels with 1..49 taps
    (a lone last tap, two or three last taps, whole quads), strides 1 and 2, padding,
    dilation, batch 1..3, codes at the 7-bit maximum, weights at -128, ReLU clamps, ties."""
    rng = np.random.default_rng(seed)
    c = int(rng.choice([1, 3, 16, 17, 32, 33, 48, 63, 96]))
    layers = []
    for _ in range(int(rng.integers(2, 4))):
        kh, kw = KERNELS[int(rng.integers(len(KERNELS)))]
        layers.append((kh, kw, int(rng.choice([1, 2])), int(rng.integers(0, 3)), int(rng.choice([1, 1, 1, 2]))))
    hw = [int(v) for v in rng.choice([1, 2, 3, 5, 8, 13, 17], 2)]
    graph = _chain(rng, c=c, hw=hw, layers=layers, ties=ties)
    x = _x7(rng, (int(rng.integers(1, 4)), c, *hw))
    cg = _with_threads(threads, lambda: _check(graph, x))
    if "avx2" in PATHS:
        cg.run(x, path="avx2")
        plan = {p["name"]: p for p in cg.plan()}
        # every conv after the first reads 7-bit codes: the vpmaddubsw kernel, NHWC input
        assert all(plan[op.name]["depthwise_maddubs"] for op in graph.ops[1:])
        assert plan["dw0"]["nhwc_output"] and not plan[graph.ops[-1].name]["nhwc_output"]


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_depthwise_maddubs_only_where_exact(seed):
    """A conv reading full-range U8 codes (up to 255) with weights whose pair sums can pass
    32767 / 255 (|w0| + |w1| > 128): one vpmaddubsw pair could saturate, so it keeps the int16
    kernel (and still equals the reference); small weights (|w| <= 64, pairs <= 128) are exact
    at 255 and take the vpmaddubsw kernel."""
    rng = np.random.default_rng(seed)
    big = _chain(rng, c=24, hw=(9, 9), layers=[(3, 3, 1, 1, 1), (3, 3, 1, 1, 1)], ties=False, first_hi=255)
    small = _chain(rng, c=24, hw=(9, 9), layers=[(3, 3, 1, 1, 1), (3, 3, 1, 1, 1)], ties=False, first_hi=255,
                   wlim=64)
    for graph, quad in ((big, False), (small, True)):
        x = _x7(rng, (2, 24, 9, 9))
        cg = _check(graph, x)
        if "avx2" in PATHS:
            plan = {p["name"]: p for p in cg.plan()}
            # (EVEX VNNI: the quad kernel is vpdpbusd, exact for any codes, so both take it)
            assert plan["dw1"]["depthwise_maddubs"] is (quad or rt.kernels.evex_vnni())


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31), stride=st.sampled_from([1, 2]))
def test_depthwise_maddubs_threaded_matches_reference(seed, stride):
    """MobileNet-sized layers (57 x 57, 32/96 channels: the pool splits output rows across 2
    threads, bands of rows within a task), 3x3 and 5x5, 7-bit codes with a ReLU6-style clamp."""
    rng = np.random.default_rng(seed)
    c = int(rng.choice([32, 96]))
    graph = _chain(rng, c=c, hw=(57, 57), layers=[(3, 3, 1, 1, 1), (3, 3, stride, 1, 1), (5, 5, 1, 2, 1)],
                   ties=False)
    x = _x7(rng, (2, c, 57, 57))
    for threads in (1, 2):
        _with_threads(threads, lambda: _check(graph, x))


def mobilenet_v2_7bit():
    """A torchvision-shaped MobileNetV2 (qdsl.zoo widths, 3 x 32 x 32) with the bundled
    int8-default spec and 7-bit activations, calibrated and exported: (graph, a batch of 3)."""
    import torch

    import qdsl
    from tests.export.tv_models import FACTORIES

    torch.manual_seed(0)
    model = FACTORIES["mobilenet_v2"]().eval()
    qdsl.apply(model, "specs/int8-default.qspec", overrides=["input.bits=7", "output.bits=7"])
    calib = torch.randn(8, 3, 32, 32)
    qdsl.calibrate(model, [calib[:4], calib[4:]], progress=False)
    qdsl.freeze(model)
    graph = qdsl.export(model, calib[:2])
    return graph, torch.randn(3, 3, 32, 32).numpy()


def test_mobilenet_v2_7bit_graph_matches_reference():
    """A torchvision-shaped MobileNetV2 (qdsl.zoo widths, 3 x 32 x 32) quantized with the
    bundled int8-default spec and 7-bit activations, exported: the C++ runtime equals the
    reference executor on every path, and on AVX2 its depthwise convs (reading the expansion
    convs' ReLU6 outputs: 7-bit codes) take the vpmaddubsw kernel where they run channels-last."""
    graph, x = mobilenet_v2_7bit()
    cg = _check(graph, x)
    if "avx2" in PATHS:
        cg.run(x, path="avx2")
        names = {op.name for op in graph.ops if op.type is OpType.CONV2D and op.attrs["groups"] > 1}
        dw = [p for p in cg.plan() if p["name"] in names]
        # (the small widths' early 1x1 convs have too few output channels for the implicit GEMM,
        # so the depthwise convs between them stay NCHW; from features.11 on they run NHWC)
        assert len(dw) == 17 and all(p["depthwise_maddubs"] for p in dw)
        assert sum(p["nhwc_output"] for p in dw) >= 5

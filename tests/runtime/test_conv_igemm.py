"""The AVX2 implicit-GEMM conv (csrc/runtime/ops/conv_igemm.cc: NHWC rows read in place through
row pointers, output stage and fused residual ADD in the epilogue) equals the Python reference
executor bit for bit, on every kernel path this CPU has.  It runs for groups-1 convs with at
least 8 input channels whose int8 weights keep every vpmaddubsw pair sum within int16 for the
input's codes: weights within +-64 for full-range U8/I8 inputs, any int8 weights behind a
7-bit clamp.  Shapes cover 1x1/3x3/7x7 kernels, strides 1/2, padding, dilation, channel counts
off the 4/16 multiples (C padded to 4, N tails of a 16-channel panel), M tails of the 6-row
strips, I8/U8/I32 outputs with clamps, batch > 1, and 1 and 2 threads (2 threads split the
output channels too when an image has few position blocks)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Tensor  # noqa: E402

from tests.runtime.test_graph import _check, _rand, _stage  # noqa: E402


def _attrs(rng, cout, out, k, stride, pad, dil=1, in_zp=3):
    lo, hi = (-(2**31), 2**31 - 1) if out is DType.I32 else out.range
    return {"stride": [stride, stride], "padding": [pad, pad], "dilation": [dil, dil], "groups": 1, "in_zp": in_zp,
            "w_zp": [0], "acc_bits": 32, "overflow": 0,
            **_stage(rng, cout, lo, hi, pot=False if out is DType.I32 else None)}


def _weights(rng, cout, cin, k, mag):
    return np.clip(rng.integers(-127, 128, (cout, cin, k, k)), -mag, mag).astype(np.int8)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The thread count for every example of the test (the same for all of them)."""
    before = rt.get_num_threads()
    rt.set_num_threads(request.param)
    yield request.param
    rt.set_num_threads(before)


_FIXTURE_OK = [HealthCheck.function_scoped_fixture]


@settings(max_examples=25, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), k=st.sampled_from([1, 1, 3, 3, 7]), stride=st.sampled_from([1, 2]),
       xdtype=st.sampled_from([DType.U8, DType.U8, DType.I8]), out=st.sampled_from([DType.U8, DType.I8, DType.I32]),
       bias=st.booleans())
def test_igemm_conv_matches_reference(threads, seed, k, stride, xdtype, out, bias):
    rng = np.random.default_rng(seed)
    cin = int(rng.choice([8, 13, 16, 30, 64]))
    cout = int(rng.choice([1, 7, 16, 17, 40, 64]))
    h, w = int(rng.integers(k, k + 12)), int(rng.integers(k, k + 20))
    pad = int(rng.integers(0, k // 2 + 2))
    dil = int(rng.choice([1, 1, 2])) if k > 1 and h + 2 * pad > 2 * (k - 1) and w + 2 * pad > 2 * (k - 1) else 1
    wt = _weights(rng, cout, cin, k, 64)
    in_zp = int(rng.integers(*xdtype.range))
    attrs = _attrs(rng, cout, out, k, stride, pad, dil, in_zp)
    oh, ow = ((n + 2 * pad - dil * (k - 1) - 1) // stride + 1 for n in (h, w))
    tensors = [Tensor("x", xdtype, (-1, cin, h, w)), Tensor("w", DType.I8, wt.shape, wt)]
    ins = ["x", "w"]
    if bias:
        tensors.append(Tensor("b", DType.I32, (cout,), rng.integers(-5000, 5000, cout)))
        ins.append("b")
    tensors.append(Tensor("y", out, (-1, cout, oh, ow)))
    graph = IntegerGraph(tensors, ["x"], ["y"], [Op(OpType.CONV2D, "conv", ins, ["y"], attrs)]).validate()
    _check(graph, _rand(rng, xdtype, (int(rng.integers(1, 4)), cin, h, w)))


@settings(max_examples=12, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), hw=st.sampled_from([7, 14, 15]), c=st.sampled_from([24, 64]),
       down=st.booleans(), pot=st.booleans())
def test_igemm_residual_block_matches_reference(threads, seed, hw, c, down, pot):
    """A ResNet block on 7-bit activations: x -> CLAMP(0, 127) -> conv1 (3x3, U8 clamped to
    0..127) -> conv2 (3x3, I32) + shortcut -> ADD (U8, 0..127) -> conv3 (1x1) -> y.  The
    shortcut is the block input, or a 1x1 stride-2 conv (I32) when `down`, which then takes the
    ADD into its epilogue.  Full-range int8 weights: the 7-bit clamps make them exact on the
    vpmaddubsw kernel.  The tensors between the convs and the ADD are kept NHWC (PlanNhwc), the
    graph input and output NCHW."""
    rng = np.random.default_rng(seed)
    s = 2 if down else 1
    o = (hw - 1) // s + 1
    w1, w2 = _weights(rng, c, c, 3, 127), _weights(rng, c, c, 3, 127)
    wd, w3 = _weights(rng, c, c, 1, 127), _weights(rng, 17, c, 1, 127)
    x_shape, y_shape = (-1, c, hw, hw), (-1, c, o, o)
    tensors = [Tensor("x", DType.U8, x_shape), Tensor("xc", DType.U8, x_shape),
               Tensor("w1", DType.I8, w1.shape, w1), Tensor("w2", DType.I8, w2.shape, w2),
               Tensor("wd", DType.I8, wd.shape, wd), Tensor("w3", DType.I8, w3.shape, w3),
               Tensor("b2", DType.I32, (c,), rng.integers(-3000, 3000, c)),
               Tensor("a", DType.U8, y_shape), Tensor("r", DType.I32, y_shape), Tensor("sum", DType.U8, y_shape),
               Tensor("y", DType.U8, (-1, 17, o, o))]
    a_attrs = _attrs(rng, c, DType.U8, 3, s, 1, in_zp=0)
    a_attrs["out_max"] = 127
    a_attrs["out_zp"] = min(a_attrs["out_zp"], 127)
    a_attrs["out_min"] = min(a_attrs["out_min"], a_attrs["out_zp"])
    clamp = Op(OpType.CLAMP, "clamp", ["x"], ["xc"], {"out_min": 0, "out_max": 127})
    ops = [clamp, Op(OpType.CONV2D, "conv1", ["xc", "w1"], ["a"], a_attrs),
           Op(OpType.CONV2D, "conv2", ["a", "w2", "b2"], ["r"], _attrs(rng, c, DType.I32, 3, 1, 1, in_zp=0))]
    other = "xc"
    if down:
        tensors.append(Tensor("d", DType.I32, y_shape))
        ops.append(Op(OpType.CONV2D, "down", ["xc", "wd"], ["d"], _attrs(rng, c, DType.I32, 1, 2, 0, in_zp=0)))
        other = "d"
    in_rq = {"in_zp": [0, 0 if down else 5], "in_kind": [1, 1] if pot else [2, 2],
             "in_multiplier": [1, 1] if pot else [int(v) for v in rng.integers(1 << 30, 1 << 31, 2)],
             "in_shift": [0, 0] if pot else [-6, -4], "in_rounding": [int(v) for v in rng.integers(0, 4, 2)]}
    ops.append(Op(OpType.ADD, "add", ["r", other], ["sum"], {**in_rq, "pre_shift": 0, **_stage(rng, 1, 0, 127)}))
    ops.append(Op(OpType.CONV2D, "conv3", ["sum", "w3"], ["y"], _attrs(rng, 17, DType.U8, 1, 1, 0, in_zp=0)))
    graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
    _check(graph, _rand(rng, DType.U8, (int(rng.integers(1, 3)), c, hw, hw)))

"""The AVX2 implicit-GEMM conv (csrc/runtime/ops/conv_igemm.cc: NHWC rows read in place through
row pointers, output stage and fused residual ADD in the epilogue) equals the Python reference
executor bit for bit, on every kernel path this CPU has.  It runs for groups-1 convs with at
least 8 input channels, on the shapes where it pays, and here (QDSL_IGEMM_ALL) on all of them,
with one of two kernel kinds: the vpmaddubsw one when the int8 weights keep every pair sum
within int16 for the input's codes (weights within +-64 for full-range U8/I8 inputs, any int8
weights behind a 7-bit clamp), else the int16 one (exact 8-bit: full-range codes, any weights
with |W - w_zp| <= 511).  Shapes
cover 1x1/3x3/7x7 kernels, strides 1/2, padding, dilation, channel counts off the 4/16
multiples (C padded to 4, N tails of a 16-channel panel), M tails of the 6-row strips,
I8/U8/I32 outputs with clamps, batch > 1, and 1 and 2 threads (2 threads split the output
channels too when an image has few position blocks)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Rescale, RescaleKind, Tensor  # noqa: E402
from qdsl.graph.requant import make_rescale  # noqa: E402

from tests.runtime.test_graph import PATHS, _check, _rand, _stage  # noqa: E402

# The AVX2 path runs the vpmaddubsw kind as EVEX vpdpbusd (AVX512_VNNI CPUs, e.g. Zen 4; kernels
# .evex_vnni()), exact for any codes: int8 weights then take that kind on full-range codes too.
EVEX = rt.available() and rt.kernels.evex_vnni()


def _layouts(cg, x, kinds=None):
    """Per op name: (runs the implicit-GEMM conv, output stored NHWC) after an AVX2 run (the
    NHWC plan is per kernel path); None where this CPU has no AVX2.  `kinds`: a dict that gets
    each implicit-GEMM conv's kernel kind (True: the int16 one)."""
    if "avx2" not in PATHS:
        return None
    cg.run(x, path="avx2")
    plan = cg.plan()
    if kinds is not None:
        kinds.update({p["name"]: p["implicit_gemm_int16"] for p in plan if p.get("implicit_gemm")})
    return {p["name"]: (p.get("implicit_gemm"), p["nhwc_output"]) for p in plan}


def _register_stage(cg):
    """Per op name: whether its output stage is prepared for the kernel's registers."""
    return {p["name"]: p.get("register_stage") for p in cg.plan()}


@pytest.fixture(scope="module", autouse=True)
def _every_shape():
    """QDSL_IGEMM_ALL=1: the implicit-GEMM conv for every eligible shape, not only those where
    it is the faster conv (conv_prepare.cc PrepareIgemm), so small shapes test it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QDSL_IGEMM_ALL", "1")
        yield


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


def _one_conv(rng, k, stride, xdtype, out, bias, wmag, in_zp, w_zp=0):
    """A random conv of kernel k (odd C and O, padding, dilation) in a graph of its own, checked
    against the reference on every path; returns (layouts, kinds) as _layouts gives them."""
    cin = int(rng.choice([8, 13, 16, 30, 64]))
    cout = int(rng.choice([1, 7, 16, 17, 40, 64]))
    h, w = int(rng.integers(k, k + 12)), int(rng.integers(k, k + 20))
    pad = int(rng.integers(0, k // 2 + 2))
    dil = int(rng.choice([1, 1, 2])) if k > 1 and h + 2 * pad > 2 * (k - 1) and w + 2 * pad > 2 * (k - 1) else 1
    wt = _weights(rng, cout, cin, k, wmag)
    if wmag > 64:  # one pair (channels 0 and 1 of tap 0) that vpmaddubsw cannot sum in int16
        wt[:, :2, 0, 0] = 127 if w_zp <= 0 else -128
    attrs = _attrs(rng, cout, out, k, stride, pad, dil, in_zp)
    attrs["w_zp"] = [w_zp]
    oh, ow = ((n + 2 * pad - dil * (k - 1) - 1) // stride + 1 for n in (h, w))
    tensors = [Tensor("x", xdtype, (-1, cin, h, w)), Tensor("w", DType.I8, wt.shape, wt)]
    ins = ["x", "w"]
    if bias:
        tensors.append(Tensor("b", DType.I32, (cout,), rng.integers(-50000, 50000, cout)))
        ins.append("b")
    tensors.append(Tensor("y", out, (-1, cout, oh, ow)))
    graph = IntegerGraph(tensors, ["x"], ["y"], [Op(OpType.CONV2D, "conv", ins, ["y"], attrs)]).validate()
    x = _rand(rng, xdtype, (int(rng.integers(1, 4)), cin, h, w))
    x.reshape(-1)[:2] = xdtype.range  # both ends of the codes
    kinds = {}
    return _layouts(_check(graph, x), x, kinds), kinds


@settings(max_examples=25, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), k=st.sampled_from([1, 1, 3, 3, 7]), stride=st.sampled_from([1, 2]),
       xdtype=st.sampled_from([DType.U8, DType.U8, DType.I8]), out=st.sampled_from([DType.U8, DType.I8, DType.I32]),
       bias=st.booleans())
def test_igemm_conv_matches_reference(threads, seed, k, stride, xdtype, out, bias):
    rng = np.random.default_rng(seed)
    in_zp = int(rng.integers(*xdtype.range))
    layouts, kinds = _one_conv(rng, k, stride, xdtype, out, bias, 64, in_zp)
    assert layouts is None or layouts["conv"] == (True, False)  # the graph output stays NCHW
    assert layouts is None or not kinds["conv"]  # weights within +-64: the vpmaddubsw kind


@settings(max_examples=30, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), k=st.sampled_from([1, 1, 3, 3, 7]), stride=st.sampled_from([1, 2]),
       xdtype=st.sampled_from([DType.U8, DType.U8, DType.I8]), out=st.sampled_from([DType.U8, DType.I8, DType.I32]),
       bias=st.booleans(), zp_at=st.sampled_from(["lo", "hi", "mid", "zero"]), w_zp=st.sampled_from([0, 0, -90, 100]))
def test_igemm_int16_conv_matches_reference(threads, seed, k, stride, xdtype, out, bias, zp_at, w_zp):
    """Exact 8-bit: full-range U8/I8 codes and full-range int8 weights (with a weight zero point,
    W - w_zp leaves int8: up to 227 or -227) run the int16 kernel kind (int8 W - w_zp on a CPU
    with EVEX VNNI: the vpdpbusd one, exact for any codes); input zero points at
    the dtype's ends (0 and 255 for U8, -128 and 127 for I8), padding taps read them too."""
    rng = np.random.default_rng(seed)
    lo, hi = xdtype.range
    in_zp = {"lo": lo, "hi": hi, "mid": int(rng.integers(lo, hi + 1)), "zero": 0}[zp_at]
    layouts, kinds = _one_conv(rng, k, stride, xdtype, out, bias, 127, in_zp, w_zp)
    # (W - w_zp in int8, w_zp 0, on EVEX VNNI: the vpdpbusd kind, exact for these codes too)
    assert layouts is None or (layouts["conv"] == (True, False) and kinds["conv"] == (w_zp != 0 or not EVEX))


@settings(max_examples=12, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), hw=st.sampled_from([7, 14, 15]), c=st.sampled_from([24, 64]),
       down=st.booleans(), pot=st.booleans(), bits=st.sampled_from([7, 8]))
def test_igemm_residual_block_matches_reference(threads, seed, hw, c, down, pot, bits):
    """A ResNet block on 7-bit activations: x -> CLAMP(0, 127) -> conv1 (3x3, U8 clamped to
    0..127) -> conv2 (3x3, I32) + shortcut -> ADD (U8, 0..127) -> conv3 (1x1) -> y.  The
    shortcut is the block input, or a 1x1 stride-2 conv (I32) when `down`, which then takes the
    ADD into its epilogue.  Full-range int8 weights: the 7-bit clamps make them exact on the
    vpmaddubsw kernel.  The tensors between the convs are kept NHWC (PlanNhwc), and the ADD's
    when its shortcut is a conv; the graph input and output stay NCHW.  bits == 8: the same
    block with every clamp at 0..255 (exact 8-bit), on the int16 kernel kind."""
    top = 2**bits - 1
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
    a_attrs["out_max"] = top
    a_attrs["out_zp"] = min(a_attrs["out_zp"], top)
    a_attrs["out_min"] = min(a_attrs["out_min"], a_attrs["out_zp"])
    clamp = Op(OpType.CLAMP, "clamp", ["x"], ["xc"], {"out_min": 0, "out_max": top})
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
    ops.append(Op(OpType.ADD, "add", ["r", other], ["sum"], {**in_rq, "pre_shift": 0, **_stage(rng, 1, 0, top)}))
    ops.append(Op(OpType.CONV2D, "conv3", ["sum", "w3"], ["y"], _attrs(rng, 17, DType.U8, 1, 1, 0, in_zp=0)))
    graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
    x = _rand(rng, DType.U8, (int(rng.integers(1, 3)), c, hw, hw))
    kinds = {}
    layouts = _layouts(_check(graph, x), x, kinds)
    if layouts is not None:
        assert set(kinds.values()) == {bits == 8 and not EVEX}
        assert layouts["clamp"] == (None, False)  # read by the convs: they transpose it in
        assert layouts["conv1"] == (True, True)
        # the ADD keeps its tensors in one layout: NCHW when it reads the clamp's output
        assert layouts["conv2"] == (True, down) and layouts["add"] == (None, down)
        assert not down or layouts["down"] == (True, True)
        assert layouts["conv3"] == (True, False)


@settings(max_examples=10, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), pool=st.sampled_from([OpType.MAXPOOL2D, OpType.AVGPOOL2D]),
       last=st.sampled_from([OpType.GLOBAL_AVGPOOL, OpType.AVGPOOL2D]), cin=st.sampled_from([3, 4]))
def test_igemm_pools_keep_nhwc_matches_reference(threads, seed, pool, last, cin):
    """A ResNet's ends: stem conv -> pool, which writes NHWC for the implicit-GEMM conv and the
    ADD reading it -> conv (I32) + pool output -> ADD -> a pool reading NHWC (GLOBAL_AVGPOOL:
    [N][C][1][1], the same in both layouts; AVGPOOL2D: transposed back to the NCHW graph
    output).  The stem: 3 input channels run the implicit-GEMM conv by kernel rows (NHWC
    output for either pool), 4 the gathered NCHW path (NHWC output for a max pool only)."""
    rng = np.random.default_rng(seed)
    c, hw = 16, 18
    ws, w1 = _weights(rng, c, cin, 3, 127), _weights(rng, c, c, 3, 127)
    mid = (hw - 1) // 2 + 1
    s_shape, p_shape = (-1, c, hw, hw), (-1, c, mid, mid)
    y_shape = (-1, c, 1, 1) if last is OpType.GLOBAL_AVGPOOL else (-1, c, mid - 2, mid - 2)
    s_attrs = _attrs(rng, c, DType.U8, 3, 1, 1, in_zp=0)
    s_attrs.update(out_zp=0, out_min=0, out_max=127)
    pool_attrs = {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1]}
    if pool is OpType.MAXPOOL2D:
        pool_attrs["dilation"] = [1, 1]
    else:
        pool_attrs.update(in_zp=0, **_stage(rng, 1, 0, 127))
        pool_attrs.update(out_zp=0, out_min=0, out_max=127)
    last_attrs = {"in_zp": 0, **_stage(rng, c if last is OpType.GLOBAL_AVGPOOL else 1, 0, 255)}
    if last is OpType.AVGPOOL2D:
        last_attrs.update(kernel=[3, 3], stride=[1, 1], padding=[0, 0])
    in_rq = {"in_zp": [0, 0], "in_kind": [2, 2], "in_multiplier": [int(v) for v in rng.integers(1 << 30, 1 << 31, 2)],
             "in_shift": [-6, -1], "in_rounding": [int(v) for v in rng.integers(0, 4, 2)]}
    tensors = [Tensor("x", DType.U8, (-1, cin, hw, hw)), Tensor("ws", DType.I8, ws.shape, ws),
               Tensor("w1", DType.I8, w1.shape, w1), Tensor("s", DType.U8, s_shape), Tensor("p", DType.U8, p_shape),
               Tensor("r", DType.I32, p_shape), Tensor("sum", DType.U8, p_shape), Tensor("y", DType.U8, y_shape)]
    ops = [Op(OpType.CONV2D, "stem", ["x", "ws"], ["s"], s_attrs), Op(pool, "pool", ["s"], ["p"], pool_attrs),
           Op(OpType.CONV2D, "conv", ["p", "w1"], ["r"], _attrs(rng, c, DType.I32, 3, 1, 1, in_zp=0)),
           Op(OpType.ADD, "add", ["r", "p"], ["sum"], {**in_rq, "pre_shift": 0, **_stage(rng, 1, 0, 127)}),
           Op(last, "last", ["sum"], ["y"], last_attrs)]
    graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
    x = _rand(rng, DType.U8, (int(rng.integers(1, 3)), cin, hw, hw))
    layouts = _layouts(_check(graph, x), x)
    if layouts is not None:
        if cin == 3:  # kernel rows (implicit_gemm_rows), NHWC for both pools
            assert layouts["stem"] == (True, True)
        else:  # 4 input channels: the gathered conv, which writes NHWC for a max pool only
            assert layouts["stem"] == (False, pool is OpType.MAXPOOL2D)
        assert layouts["pool"][1] and layouts["conv"] == (True, True) and layouts["add"][1]
        assert not layouts["last"][1]


@settings(max_examples=10, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), hw=st.sampled_from([5, 9, 14]), c=st.sampled_from([8, 16, 24]),
       stride=st.sampled_from([1, 2]), bits=st.sampled_from([7, 8]))
def test_igemm_inverted_residual_keeps_nhwc_matches_reference(threads, seed, hw, c, stride, bits):
    """A MobileNetV2 block on 7-bit activations, NHWC end to end: stem (1x1, the block input)
    -> expansion (1x1, 6x wider) -> depthwise 3x3 (conv_dw_nhwc.cc) -> projection (1x1) and,
    at stride 1, + the block input -> ADD (the projection takes it into its epilogue) -> head
    (1x1) -> y.  As in exported MobileNetV2s, the ADD reads the block input from a twin of the
    stem (the same conv with an I32 stage), which the stem's run computes from the same
    accumulators.  Every tensor between the stem and the head stays NHWC on the AVX2 path.
    bits == 8: every clamp at 0..255 (exact 8-bit), the 1x1 convs on the int16 kernel kind."""
    top = 2**bits - 1
    rng = np.random.default_rng(seed)
    e = 6 * c
    o = (hw - 1) // stride + 1
    ws, we, wp, wh = (_weights(rng, n, m, 1, 127) for n, m in ((c, c), (e, c), (c, e), (17, c)))
    wd = _weights(rng, e, 1, 3, 127)
    a_shape, e_shape, d_shape, p_shape = (-1, c, hw, hw), (-1, e, hw, hw), (-1, e, o, o), (-1, c, o, o)
    residual = stride == 1
    p_dtype = DType.I32 if residual else DType.U8
    tensors = [Tensor("x", DType.U8, a_shape), Tensor("xc", DType.U8, a_shape),
               Tensor("ws", DType.I8, ws.shape, ws), Tensor("we", DType.I8, we.shape, we),
               Tensor("wd", DType.I8, wd.shape, wd), Tensor("wp", DType.I8, wp.shape, wp),
               Tensor("wh", DType.I8, wh.shape, wh), Tensor("bd", DType.I32, (e,), rng.integers(-3000, 3000, e)),
               Tensor("a", DType.U8, a_shape), Tensor("ex", DType.U8, e_shape), Tensor("dw", DType.U8, d_shape),
               Tensor("p", p_dtype, p_shape), Tensor("y", DType.U8, (-1, 17, o, o))]

    def seven_bit(k, n, groups=1, s=1):
        attrs = _attrs(rng, n, DType.U8, k, s, k // 2, in_zp=0)
        attrs.update(out_zp=0, out_min=0, out_max=top, groups=groups)
        return attrs

    p_attrs = _attrs(rng, c, DType.I32, 1, 1, 0, in_zp=0) if residual else seven_bit(1, c)
    ops = [Op(OpType.CLAMP, "clamp", ["x"], ["xc"], {"out_min": 0, "out_max": top}),
           Op(OpType.CONV2D, "stem", ["xc", "ws"], ["a"], seven_bit(1, c)),
           Op(OpType.CONV2D, "expand", ["a", "we"], ["ex"], seven_bit(1, e)),
           Op(OpType.CONV2D, "dw", ["ex", "wd", "bd"], ["dw"], seven_bit(3, e, groups=e, s=stride)),
           Op(OpType.CONV2D, "project", ["dw", "wp"], ["p"], p_attrs)]
    head_in = "p"
    if residual:
        tensors += [Tensor("sum", DType.U8, p_shape), Tensor("a32", DType.I32, a_shape)]
        ops.insert(2, Op(OpType.CONV2D, "stem_i32", ["xc", "ws"], ["a32"], _attrs(rng, c, DType.I32, 1, 1, 0, in_zp=0)))
        in_rq = {"in_zp": [0, 0], "in_kind": [2, 2],
                 "in_multiplier": [int(v) for v in rng.integers(1 << 30, 1 << 31, 2)],
                 "in_shift": [-6, -1], "in_rounding": [int(v) for v in rng.integers(0, 4, 2)]}
        ops.append(Op(OpType.ADD, "add", ["p", "a32"], ["sum"], {**in_rq, "pre_shift": 0, **_stage(rng, 1, 0, top)}))
        head_in = "sum"
    ops.append(Op(OpType.CONV2D, "head", [head_in, "wh"], ["y"], seven_bit(1, 17)))
    graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
    x = _rand(rng, DType.U8, (int(rng.integers(1, 3)), c, hw, hw))
    kinds = {}
    layouts = _layouts(_check(graph, x), x, kinds)
    if layouts is not None:
        assert set(kinds.values()) == {bits == 8 and not EVEX}
        assert all(layouts[n] == (True, True) for n in ("stem", "expand", "project"))
        assert layouts["dw"][1] and (not residual or (layouts["add"][1] and layouts["stem_i32"] == (True, True)))
        assert layouts["head"] == (True, False)


@settings(max_examples=30, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), k=st.sampled_from([1, 1, 3]), stride=st.sampled_from([1, 2]),
       xdtype=st.sampled_from([DType.U8, DType.U8, DType.I8]), out=st.sampled_from([DType.U8, DType.I8]),
       per_tensor=st.booleans(), rounding=st.integers(0, 3), left=st.booleans(), ties=st.booleans())
def test_igemm_stage_from_registers_matches_reference(threads, seed, k, stride, xdtype, out, per_tensor, rounding,
                                                      left, ties):
    """conv -> head: the conv's I8/U8 output is stored NHWC (the head reads it), so with a
    FIXED_SINGLE stage whose right shifts are all in [0, 31] its kernel applies the stage to
    the sums in registers (IgemmStageKernel, csrc/requant/stage_f32_avx2.h) and stores codes;
    per channel or per tensor, every rounding, zero points and clamps, channel counts off the
    16-channel panels (a partial last panel), M tails.  `left`: one scale > 1 (a left shift),
    which the register stage does not take: the int32 tiles and the stage after them run.
    `ties`: scales of 1, 3 or 5 x 2^-6..2^-11, so about one sum in 2^k lands exactly on a
    rounding tie and most 32-code groups (two rows of a panel) take the exact recompute."""
    rng = np.random.default_rng(seed)
    cin = int(rng.choice([8, 13, 16, 30]))
    cout = int(rng.choice([16, 17, 23, 40, 64]))
    h, w = int(rng.integers(k, k + 14)), int(rng.integers(k, k + 20))
    pad = k // 2
    n_scales = 1 if per_tensor else cout
    if ties:
        scales = rng.choice([1.0, 3.0, 5.0], n_scales) * 2.0 ** -rng.integers(6, 12, n_scales).astype(np.float64)
    else:
        scales = rng.uniform(1e-4, 0.05, n_scales)
    if left:
        scales[0] = 3.0
    lo, hi = out.range
    zp = int(rng.integers(lo, hi + 1))
    qmin = zp if rng.random() < 0.3 else int(rng.integers(lo, zp + 1))
    stage = OutputStage(make_rescale(scales, rounding, allow_pot=False, single=True), zp, qmin, hi)
    attrs = {"stride": [stride, stride], "padding": [pad, pad], "dilation": [1, 1], "groups": 1,
             "in_zp": int(rng.integers(*xdtype.range)), "w_zp": [0], "acc_bits": 32, "overflow": 0, **stage.attrs()}
    oh, ow = ((n + 2 * pad - k) // stride + 1 for n in (h, w))
    wt, wh = _weights(rng, cout, cin, k, 64), _weights(rng, 17, cout, 1, 64)
    tensors = [Tensor("x", xdtype, (-1, cin, h, w)), Tensor("w", DType.I8, wt.shape, wt),
               Tensor("b", DType.I32, (cout,), rng.integers(-5000, 5000, cout)), Tensor("wh", DType.I8, wh.shape, wh),
               Tensor("a", out, (-1, cout, oh, ow)), Tensor("y", DType.U8, (-1, 17, oh, ow))]
    ops = [Op(OpType.CONV2D, "conv", ["x", "w", "b"], ["a"], attrs),
           Op(OpType.CONV2D, "head", ["a", "wh"], ["y"], _attrs(rng, 17, DType.U8, 1, 1, 0, in_zp=0))]
    graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
    x = _rand(rng, xdtype, (int(rng.integers(1, 4)), cin, h, w))
    cg = _check(graph, x)
    layouts = _layouts(cg, x)
    if layouts is not None:
        assert layouts["conv"] == (True, True) and layouts["head"] == (True, False)
        assert _register_stage(cg)["conv"] == (not left)


@settings(max_examples=30, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), k=st.sampled_from([1, 3]), c=st.sampled_from([8, 16, 17, 40]),
       other=st.sampled_from([DType.U8, DType.I8, DType.I32]), sum_dtype=st.sampled_from([DType.U8, DType.I8]),
       exported=st.booleans(), pre=st.sampled_from([0, 0, 1, 3]))
def test_igemm_fused_add_stage_matches_reference(threads, seed, k, c, other, sum_dtype, exported, pre):
    """stem (1x1) -> conv (k x k, I32) + shortcut -> ADD -> head (1x1), every tensor but x and
    y NHWC: the conv takes the ADD into its epilogue, where its int32 stage and the ADD run as
    one float estimate with an exact recompute near rounding boundaries
    (csrc/requant/stage_add_f32.h; plan: fused_add_stage).  The shortcut is the stem's U8/I8
    output, or an int32 one (a 1x1 conv with an I32 stage, as in downsampling blocks and
    exported MobileNetV2s).  `exported`: the stages an export writes (the conv's int32 stage
    a left shift with a FIXED_SINGLE multiplier, the ADD's conv input POT 0, its output POT
    right shift), which the estimate must take; else random stages of every kind and rounding
    (taken or not).  Output shifts down to 6 put many sums near rounding boundaries (the
    recompute)."""
    rng = np.random.default_rng(seed)
    h, w = int(rng.integers(k, k + 12)), int(rng.integers(k, k + 14))
    cin = int(rng.choice([8, 13, 24]))
    cs = cin if other is DType.I32 else c  # the stem's channels (an 8-bit shortcut: the conv's)
    ws, wc, wo, wh = (_weights(rng, n, m, kk, 127) for n, m, kk in ((cs, cin, 1), (c, cs, k), (c, cs, 1), (9, c, 1)))
    s_dtype = other if other is not DType.I32 else DType.U8
    slo, shi = s_dtype.range
    stem = _attrs(rng, cs, s_dtype, 1, 1, 0, in_zp=0)
    stem.update(out_min=max(slo, 0) if s_dtype is DType.U8 else slo, out_max=min(shi, 127))
    stem["out_zp"] = int(np.clip(stem["out_zp"], stem["out_min"], stem["out_max"]))
    lo, hi = sum_dtype.range
    if exported:
        def i32_stage(n):
            r = Rescale(RescaleKind.FIXED_SINGLE, tuple(int(v) for v in rng.integers(1 << 30, 1 << 31, n)),
                        (-7,) * n, int(rng.integers(0, 4)))
            return OutputStage(r, 0, -(2**31), 2**31 - 1).attrs()
        shift = int(rng.integers(6, 17))  # (6: about a fifth of the lanes near a boundary, recomputed)
        in_rq = {"in_zp": [0, 0 if other is DType.I32 else int(stem["out_zp"])], "in_kind": [1, 1 if other is DType.I32 else 2],
                 "in_multiplier": [1, 1 if other is DType.I32 else int(rng.integers(1 << 30, 1 << 31))],
                 "in_shift": [0, 0 if other is DType.I32 else -shift + int(rng.integers(-2, 3))],
                 "in_rounding": [0, int(rng.integers(0, 4))]}
        zp = int(rng.integers(lo, hi + 1))
        out_stage = OutputStage(Rescale(RescaleKind.POT, (1,), (shift,), int(rng.integers(0, 4))), zp,
                                zp if rng.random() < 0.5 else lo, hi).attrs()
    else:
        def i32_stage(n):
            return _stage(rng, n, -(2**31), 2**31 - 1, pot=False)
        kinds = [int(v) for v in rng.integers(0, 3, 2)]
        other_zp = int(rng.integers(-3, 4)) if other is DType.I32 else int(rng.integers(*s_dtype.range))
        in_rq = {"in_zp": [int(rng.integers(-3, 4)), other_zp], "in_kind": kinds,
                 "in_multiplier": [1 if kd == 1 else int(rng.integers(1 << 30, 1 << 31)) for kd in kinds],
                 "in_shift": [int(rng.integers(-8, 3)) for _ in kinds],
                 "in_rounding": [0 if kd == 0 else int(rng.integers(0, 4)) for kd in kinds]}
        out_stage = _stage(rng, 1, lo, hi)
    conv = {"stride": [1, 1], "padding": [k // 2] * 2, "dilation": [1, 1], "groups": 1, "in_zp": 0, "w_zp": [0],
            "acc_bits": 32, "overflow": 0, **i32_stage(c)}
    shape = (-1, c, h, w)
    tensors = [Tensor("x", DType.U8, (-1, cin, h, w)), Tensor("s", s_dtype, (-1, cs, h, w)),
               Tensor("ws", DType.I8, ws.shape, ws), Tensor("wc", DType.I8, wc.shape, wc),
               Tensor("wo", DType.I8, wo.shape, wo), Tensor("wh", DType.I8, wh.shape, wh),
               Tensor("bc", DType.I32, (c,), rng.integers(-3000, 3000, c)), Tensor("r", DType.I32, shape),
               Tensor("sum", sum_dtype, shape), Tensor("y", DType.U8, (-1, 9, h, w))]
    ops = [Op(OpType.CONV2D, "stem", ["x", "ws"], ["s"], stem)]
    short = "s"
    if other is DType.I32:  # produced before the conv, so the conv takes the ADD
        tensors.append(Tensor("o", DType.I32, shape))
        ops.append(Op(OpType.CONV2D, "short", ["s", "wo"], ["o"],
                      {**conv, "padding": [0, 0], **i32_stage(c)}))
        short = "o"
    ops.append(Op(OpType.CONV2D, "conv", ["s", "wc", "bc"], ["r"], conv))
    slot = int(rng.integers(0, 2))
    ops.append(Op(OpType.ADD, "add", ["r", short][::1 - 2 * slot], ["sum"],
                  {**{key: val[::1 - 2 * slot] for key, val in in_rq.items()}, "pre_shift": pre, **out_stage}))
    ops.append(Op(OpType.CONV2D, "head", ["sum", "wh"], ["y"], _attrs(rng, 9, DType.U8, 1, 1, 0, in_zp=0)))
    graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
    x = _rand(rng, DType.U8, (int(rng.integers(1, 3)), cin, h, w))
    cg = _check(graph, x)
    layouts = _layouts(cg, x)
    if layouts is not None:
        assert layouts["conv"] == (True, True) and layouts["add"][1]
        if exported and pre == 0:
            assert {p["name"]: p.get("fused_add_stage") for p in cg.plan()}["conv"]


@settings(max_examples=30, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), k=st.sampled_from([3, 5, 7]), stride=st.sampled_from([1, 2]),
       xdtype=st.sampled_from([DType.U8, DType.I8]), sdtype=st.sampled_from([DType.U8, DType.U8, DType.I8]),
       after=st.sampled_from(["conv", "conv", "output"]))
def test_gathered_stem_nhwc_max_pool_matches_reference(threads, seed, k, stride, xdtype, sdtype, after):
    """A ResNet's stem: conv (1-7 input channels) -> MAXPOOL2D -> conv.  With 1 or 4 input
    channels the stem is the gathered-panel conv, which writes its codes NHWC
    (conv::GatheredWritesNhwc: per tile, transposed) because its one reader is a max pool that
    writes NHWC, and the pool then takes the max of whole NHWC pixels (pool.cc MaxRowNhwc);
    after == "output": the pool output is the graph output (NCHW), so the stem stays NCHW too.
    With 2, 3, 5, 6 or 7 it is the implicit-GEMM conv by kernel rows (implicit_gemm_rows), NHWC
    output either way.  Odd channel counts, image sizes and batches, strides, padding, bias,
    pool windows 2/3 with strides 1/2, padding and dilation."""
    rng = np.random.default_rng(seed)
    cin, c = int(rng.integers(1, 8)), int(rng.choice([8, 13, 17, 24, 64]))
    h, w = int(rng.integers(k + 2, k + 30)), int(rng.integers(k + 2, k + 40))
    pad = int(rng.integers(0, k // 2 + 1))
    sh, sw = ((n + 2 * pad - k) // stride + 1 for n in (h, w))
    pk = int(rng.choice([2, 3]))
    ps, pp = int(rng.choice([1, 2])), int(rng.integers(0, pk // 2 + 1))
    if min(sh, sw) + 2 * pp < pk:  # a window wider than the padded stem output: no pool output
        pp = pk // 2
    pd = int(rng.choice([1, 1, 2])) if pp == 0 and min(sh, sw) > 2 * pk else 1
    ph, pw = ((n + 2 * pp - pd * (pk - 1) - 1) // ps + 1 for n in (sh, sw))
    ws, w1 = _weights(rng, c, cin, k, 127), _weights(rng, 11, c, 3, 127)
    s_attrs = _attrs(rng, c, sdtype, k, stride, pad, in_zp=int(rng.integers(*xdtype.range)))
    tensors = [Tensor("x", xdtype, (-1, cin, h, w)), Tensor("ws", DType.I8, ws.shape, ws),
               Tensor("b", DType.I32, (c,), rng.integers(-20000, 20000, c)), Tensor("w1", DType.I8, w1.shape, w1),
               Tensor("s", sdtype, (-1, c, sh, sw)), Tensor("p", sdtype, (-1, c, ph, pw)),
               Tensor("y", DType.U8, (-1, 11, ph, pw))]
    ops = [Op(OpType.CONV2D, "stem", ["x", "ws", "b"], ["s"], s_attrs),
           Op(OpType.MAXPOOL2D, "pool", ["s"], ["p"],
              {"kernel": [pk, pk], "stride": [ps, ps], "padding": [pp, pp], "dilation": [pd, pd]})]
    if after == "conv":
        ops.append(Op(OpType.CONV2D, "conv", ["p", "w1"], ["y"],
                      _attrs(rng, 11, DType.U8, 3, 1, 1, in_zp=int(rng.integers(*sdtype.range)))))
    else:
        tensors.pop()
    graph = IntegerGraph(tensors, ["x"], ["y" if after == "conv" else "p"], ops).validate()
    x = _rand(rng, xdtype, (int(rng.integers(1, 4)), cin, h, w))
    x.reshape(-1)[:2] = xdtype.range
    layouts = _layouts(_check(graph, x), x)
    if layouts is not None:
        nhwc = after == "conv"
        if cin in (1, 4):  # (one input channel: a depthwise conv too, which runs on NCHW planes)
            assert layouts["stem"] == (False, nhwc and cin > 1) and layouts["pool"] == (None, nhwc)
        else:
            assert layouts["stem"] == (True, True) and layouts["pool"] == (None, nhwc)


@settings(max_examples=40, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), cin=st.sampled_from([2, 3, 3, 5, 6, 7, 13, 4]), k=st.sampled_from([3, 5, 7, 7, 1]),
       stride=st.sampled_from([1, 2, 2, 3]), xdtype=st.sampled_from([DType.U8, DType.U8, DType.I8]),
       out=st.sampled_from([DType.U8, DType.I8, DType.I32]), bits=st.sampled_from([7, 8]),
       w_zp=st.sampled_from([0, 0, 0, -90]))
def test_igemm_kernel_rows_match_reference(threads, seed, cin, k, stride, xdtype, out, bits, w_zp):
    """Kernel rows as taps (ConvParams::ig_rows: input channels off the multiples of 4, kw > 1,
    column dilation 1, e.g. a 7 x 7 x 3 RGB stem): each tap reads one kernel row's kw * C bytes
    of a zero-point padded NHWC copy, K padded to 4 per kernel row.  Odd channel counts and
    image sizes, strides 1-3, padding up to past the kernel's half, row dilation (column
    dilation 2 and 1 x 1 kernels: per-tap rows), batch 1-3, U8/I8 inputs with 7-bit or
    full-range codes and zero points anywhere, U8/I8/I32 outputs, bias, a weight zero point
    that takes W - w_zp out of int8 (the int16 kind); equals the reference on every path (the
    AVX2 one on this CPU's vpdpbusd kernels; QDSL_EVEX_VNNI=0 in test_igemm_vnni.py reruns it
    on the vpmaddubsw ones), and the plan says which form ran."""
    rng = np.random.default_rng(seed)
    c = int(rng.choice([8, 16, 17, 24, 64]))
    h, w = int(rng.integers(k, k + 16)), int(rng.integers(k, k + 24))
    pad = int(rng.integers(0, k // 2 + 2))
    dh = int(rng.choice([1, 1, 2])) if k > 1 and h + 2 * pad > 2 * (k - 1) else 1
    dw = int(rng.choice([1, 1, 1, 2])) if k > 1 and w + 2 * pad > 2 * (k - 1) else 1
    wt = _weights(rng, c, cin, k, 127)
    lo, hi = xdtype.range
    top = lo + 127 if bits == 7 else hi  # 7-bit codes: the 128 lowest
    in_zp = int(rng.integers(lo, top + 1))
    attrs = _attrs(rng, c, out, k, stride, pad, in_zp=in_zp)
    attrs.update(dilation=[dh, dw], w_zp=[w_zp])
    oh, ow = ((n + 2 * pad - d * (k - 1) - 1) // stride + 1 for n, d in ((h, dh), (w, dw)))
    tensors = [Tensor("x", xdtype, (-1, cin, h, w)), Tensor("w", DType.I8, wt.shape, wt),
               Tensor("b", DType.I32, (c,), rng.integers(-50000, 50000, c)), Tensor("y", out, (-1, c, oh, ow))]
    graph = IntegerGraph(tensors, ["x"], ["y"], [Op(OpType.CONV2D, "conv", ["x", "w", "b"], ["y"], attrs)]).validate()
    x = rng.integers(lo, top + 1, (int(rng.integers(1, 4)), cin, h, w)).astype(xdtype.numpy)
    x.reshape(-1)[:2] = (lo, top)
    cg = _check(graph, x)
    if "avx2" in PATHS:
        cg.run(x, path="avx2")
        plan = cg.plan()[0]
        rows = cin % 4 != 0 and k > 1 and dw == 1
        # (fewer than 8 input channels per tap: the gathered-panel conv)
        assert plan["implicit_gemm"] is (rows or cin >= 8) and plan.get("implicit_gemm_rows", False) is rows


@pytest.mark.parametrize("reader", ["maxpool", "depthwise", "output"])
def test_rgb_stem_by_kernel_rows_only_before_a_max_pool(monkeypatch, reader):
    """Without QDSL_IGEMM_ALL, an RGB stem (3 input channels, 7 x 7 stride 2, 32 outputs) runs
    the implicit-GEMM conv by kernel rows only when max pools read its output (a ResNet's stem,
    NHWC into the pool); before a depthwise conv (a MobileNetV2 stem's reader) or as a graph
    output it stays on the gathered-panel conv (prepare.cc KeepRowStems).  Equal to the
    reference on every path either way."""
    monkeypatch.delenv("QDSL_IGEMM_ALL")
    rng = np.random.default_rng(5)
    c, hw = 32, 23
    ws = _weights(rng, c, 3, 7, 127)
    sh = (hw + 6 - 7) // 2 + 1
    s_attrs = _attrs(rng, c, DType.U8, 7, 2, 3, in_zp=0)
    s_attrs.update(out_zp=0, out_min=0, out_max=127)
    tensors = [Tensor("x", DType.U8, (-1, 3, hw, hw)), Tensor("ws", DType.I8, ws.shape, ws),
               Tensor("s", DType.U8, (-1, c, sh, sh))]
    ops = [Op(OpType.CONV2D, "stem", ["x", "ws"], ["s"], s_attrs)]
    out = "s"
    if reader == "maxpool":
        ph = (sh + 2 - 3) // 2 + 1
        tensors.append(Tensor("p", DType.U8, (-1, c, ph, ph)))
        ops.append(Op(OpType.MAXPOOL2D, "pool", ["s"], ["p"],
                      {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1], "dilation": [1, 1]}))
        w1 = _weights(rng, c, c, 3, 127)
        tensors += [Tensor("w1", DType.I8, w1.shape, w1), Tensor("y", DType.U8, (-1, c, ph, ph))]
        ops.append(Op(OpType.CONV2D, "conv", ["p", "w1"], ["y"], _attrs(rng, c, DType.U8, 3, 1, 1, in_zp=0)))
        out = "y"
    elif reader == "depthwise":
        wd = _weights(rng, c, 1, 3, 127)
        d_attrs = _attrs(rng, c, DType.U8, 3, 1, 1, in_zp=0)
        d_attrs["groups"] = c
        tensors += [Tensor("wd", DType.I8, wd.shape, wd), Tensor("y", DType.U8, (-1, c, sh, sh))]
        ops.append(Op(OpType.CONV2D, "dw", ["s", "wd"], ["y"], d_attrs))
        out = "y"
    graph = IntegerGraph(tensors, ["x"], [out], ops).validate()
    x = rng.integers(0, 128, (2, 3, hw, hw)).astype(np.uint8)
    cg = _check(graph, x)
    if "avx2" in PATHS:
        cg.run(x, path="avx2")
        stem = cg.plan()[0]
        assert stem["implicit_gemm"] is (reader == "maxpool")
        assert stem.get("implicit_gemm_rows", False) is (reader == "maxpool")
        assert stem["nhwc_output"] is (reader == "maxpool")


@pytest.mark.parametrize("k,stride,dil,pad", [(3, 1, 1, 1), (3, 2, 1, 1), (3, 1, 2, 2), (3, 2, 2, 1), (5, 1, 1, 2),
                                              (5, 2, 2, 3), (1, 2, 1, 0), (3, 1, 1, 0), (7, 2, 1, 3)])
def test_igemm_row_tables_at_the_image_edges_match_reference(threads, k, stride, dil, pad):
    """The row pointer tables (conv_igemm.cc): a position whose taps all fall inside the image
    takes its first tap's row plus fixed tap offsets, the others test each tap.  Widths from
    the kernel's reach to a few past it put the last inside position at the edge and one
    short of it; 9 rows give 60-position blocks that start mid-row; batch 2."""
    rng = np.random.default_rng(k * 100 + stride * 10 + dil + pad)
    cin, cout = 16, 24
    reach = dil * (k - 1) + 1
    wt = _weights(rng, cout, cin, k, 64)
    for w in range(max(1, reach - 2 * pad), reach + 2 * stride + 3):
        h = max(9, reach)
        oh, ow = ((n + 2 * pad - reach) // stride + 1 for n in (h, w))
        if ow < 1:
            continue
        attrs = _attrs(rng, cout, DType.U8, k, stride, pad, dil, in_zp=5)
        tensors = [Tensor("x", DType.U8, (-1, cin, h, w)), Tensor("w", DType.I8, wt.shape, wt),
                   Tensor("y", DType.U8, (-1, cout, oh, ow))]
        graph = IntegerGraph(tensors, ["x"], ["y"], [Op(OpType.CONV2D, "conv", ["x", "w"], ["y"], attrs)]).validate()
        x = _rand(rng, DType.U8, (2, cin, h, w))
        kinds = {}
        layouts = _layouts(_check(graph, x), x, kinds)
        assert layouts is None or (layouts["conv"] == (True, False) and not kinds["conv"])

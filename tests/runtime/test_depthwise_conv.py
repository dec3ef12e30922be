"""Depthwise convs (groups == in_channels, depth multiplier >= 1) run on the depthwise
kernels (csrc/runtime/ops/conv_dw.cc: AVX2 for stride 1/2 without column dilation,
portable loops otherwise) and equal the Python reference executor bit for bit on every
kernel path this CPU has, with 1 and 2 threads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import DType, GraphFormatError, OpType, Tensor  # noqa: E402

from tests.runtime.test_graph import PATHS, _check, _graph, _rand, _stage  # noqa: E402


def _depthwise_graph(rng, *, c, mult, k, spatial, stride, padding, dilation, xdtype, out, wdtype=DType.I8,
                     bias=True, w_zp=False, acc_bits=32, wmag=None):
    rank = len(k)
    cout = c * mult
    w = _rand(rng, wdtype, (cout, 1, *k))
    if wmag is not None:
        w = np.clip(w, -wmag, wmag)
    lo, hi = wdtype.range
    attrs = {
        "stride": list(stride), "padding": list(padding), "dilation": list(dilation), "groups": c,
        "in_zp": int(rng.integers(*xdtype.range)),
        "w_zp": [int(v) for v in rng.integers(lo, hi + 1, cout)] if w_zp else [0],
        "acc_bits": acc_bits, "overflow": int(rng.integers(0, 2)),
    }
    olo, ohi = (-(2**31), 2**31 - 1) if out is DType.I32 else out.range
    attrs.update(_stage(rng, cout, olo, ohi, pot=False if out is DType.I32 else None))
    consts = [Tensor("w", wdtype, w.shape, w)]
    if bias:
        consts.append(Tensor("b", DType.I32, (cout,), rng.integers(-20000, 20000, cout)))
    op = OpType.CONV1D if rank == 1 else OpType.CONV2D
    return _graph(op, [("x", xdtype, (-1, c, *spatial))], attrs, out, consts)


def _with_threads(n, fn):
    before = rt.get_num_threads()
    try:
        rt.set_num_threads(n)
        return fn()
    finally:
        rt.set_num_threads(before)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), rank=st.sampled_from([2, 2, 2, 1]), xdtype=st.sampled_from([DType.I8, DType.U8]),
       out=st.sampled_from([DType.U8, DType.I8, DType.I32]), ksize=st.sampled_from([1, 2, 3, 3, 5, 5, 7]),
       mult=st.sampled_from([1, 1, 2, 3]), threads=st.sampled_from([1, 2]))
def test_depthwise_conv_matches_reference(seed, rank, xdtype, out, ksize, mult, threads):
    rng = np.random.default_rng(seed)
    k = [ksize] * rank if rng.random() < 0.8 else [int(rng.integers(1, 6)) for _ in range(rank)]
    # odd sizes, 1x1 images (padding makes the window fit), widths around the 16-output blocks
    spatial = [int(rng.choice([1, 2, 5, 7, 8, 15, 16, 17, 31, 33])) for _ in range(rank)]
    stride = [int(rng.choice([1, 1, 2, 2, 3])) for _ in range(rank)]
    padding = [int(rng.integers(0, k[i] // 2 + 2)) for i in range(rank)]
    dilation = [1 if rng.random() < 0.75 else 2 for _ in range(rank)]
    c = int(rng.choice([1, 2, 3, 8, 17, 32]))
    try:
        graph = _depthwise_graph(rng, c=c, mult=mult, k=k, spatial=spatial, stride=stride, padding=padding,
                                 dilation=dilation, xdtype=xdtype, out=out, bias=bool(rng.random() < 0.8),
                                 w_zp=bool(rng.random() < 0.3), wmag=int(rng.choice([128, 3])))
    except GraphFormatError:
        return  # drawn geometry is invalid (window larger than the padded input)
    x = _rand(rng, xdtype, (int(rng.integers(1, 4)), c, *spatial))
    _with_threads(threads, lambda: _check(graph, x))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), wdtype=st.sampled_from([DType.I8, DType.U8, DType.I4, DType.U4]),
       acc_bits=st.sampled_from([12, 16, 20]), out=st.sampled_from([DType.U8, DType.I32]))
def test_depthwise_conv_narrow_accumulator_matches_reference(seed, wdtype, acc_bits, out):
    """Accumulators narrower than the sums can get: each sum goes through the exact
    wrap/saturate rule and the overflow counts equal the reference's."""
    rng = np.random.default_rng(seed)
    xdtype = DType.U8 if rng.random() < 0.5 else DType.I8
    graph = _depthwise_graph(rng, c=int(rng.integers(1, 10)), mult=int(rng.integers(1, 3)), k=[3, 3],
                             spatial=[int(rng.integers(3, 20)), int(rng.integers(3, 20))],
                             stride=[int(rng.integers(1, 3))] * 2, padding=[1, 1], dilation=[1, 1], xdtype=xdtype,
                             out=out, wdtype=wdtype, w_zp=bool(rng.random() < 0.5), acc_bits=acc_bits)
    _check(graph, _rand(rng, xdtype, (2, graph.tensors[0].shape[1], *graph.tensors[0].shape[2:])))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31), stride=st.sampled_from([1, 2]), ksize=st.sampled_from([3, 5]),
       batch=st.sampled_from([1, 2]))
def test_depthwise_conv_threaded_matches_reference(seed, stride, ksize, batch):
    """Layers big enough for the pool to split planes across 2 threads (small ones run
    serially in the caller), MobileNetV2-like: U8 activations, ReLU6-style clamp."""
    rng = np.random.default_rng(seed)
    c = int(rng.choice([24, 40]))
    graph = _depthwise_graph(rng, c=c, mult=1, k=[ksize, ksize], spatial=[57, 57], stride=[stride] * 2,
                             padding=[ksize // 2] * 2, dilation=[1, 1], xdtype=DType.U8, out=DType.U8)
    x = _rand(rng, DType.U8, (batch, c, 57, 57))
    for threads in (1, 2):
        _with_threads(threads, lambda: _check(graph, x))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), out2=st.sampled_from([DType.U8, DType.I8, DType.I32]))
def test_depthwise_twin_convs_match_reference(seed, out2):
    """Two depthwise convs with the same input, weights, bias and geometry but their own
    output stage: the first one's run writes both outputs (the second is skipped)."""
    from qdsl.graph.ir import IntegerGraph, Op
    from qdsl.graph.reference import execute

    rng = np.random.default_rng(seed)
    c, mult, hw = int(rng.choice([2, 5, 16])), int(rng.choice([1, 2])), int(rng.choice([5, 8, 12]))
    cout = c * mult
    w = _rand(rng, DType.I8, (cout, 1, 3, 3))
    base = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": c, "in_zp": int(rng.integers(0, 256)),
            "w_zp": [0], "acc_bits": 32, "overflow": 0}
    a1 = dict(base, **_stage(rng, cout, 0, 255))
    lo, hi = (-(2**31), 2**31 - 1) if out2 is DType.I32 else out2.range
    a2 = dict(base, **_stage(rng, cout, lo, hi, pot=False if out2 is DType.I32 else None))
    consts = [Tensor("w", DType.I8, w.shape, w), Tensor("b", DType.I32, (cout,), rng.integers(-5000, 5000, cout))]
    ops = [Op(OpType.CONV2D, "c1", ["x", "w", "b"], ["y1"], a1), Op(OpType.CONV2D, "c2", ["x", "w", "b"], ["y2"], a2)]
    tensors = [Tensor("x", DType.U8, (-1, c, hw, hw)), *consts, Tensor("y1", DType.U8, (-1, cout, hw, hw)),
               Tensor("y2", out2, (-1, cout, hw, hw))]
    graph = IntegerGraph(tensors, ["x"], ["y1", "y2"], ops).validate()
    cg = rt.CompiledGraph(graph)
    for path in PATHS:  # a fresh input per run: a skipped twin would leave the last run's output
        xs = _rand(rng, DType.U8, (int(rng.integers(1, 4)), c, hw, hw))
        want = execute(graph, [xs]).outputs
        for g, w_ in zip(cg.run(xs, path=path), want):
            np.testing.assert_array_equal(g, w_, err_msg=f"path {path}")


def _single_stage(rng, channels, lo, hi, ties=False):
    """A FIXED_SINGLE stage (right shifts in [0, 31]: the one kernels apply from registers),
    per channel or per tensor, any rounding, a zero point and clamps.  `ties`: scales of 1, 3
    or 5 x 2^-4..2^-9, so about one sum in 2^k is an exact rounding tie (the kernels' exact
    recompute runs on most 32-channel groups)."""
    from qdsl.graph.ir import OutputStage
    from qdsl.graph.requant import make_rescale

    n = channels if rng.random() < 0.7 else 1
    if ties:
        scales = rng.choice([1.0, 3.0, 5.0], n) * 2.0 ** -rng.integers(4, 10, n).astype(np.float64)
    else:
        scales = rng.uniform(1e-4, 0.05, n)
    zp = int(rng.integers(lo, hi + 1))
    qmin = zp if rng.random() < 0.3 else int(rng.integers(lo, zp + 1))
    return OutputStage(make_rescale(scales, int(rng.integers(0, 4)), allow_pot=False, single=True), zp, qmin,
                       hi).attrs()


def _dw_chain_graph(rng, *, c, xdtype, mid_dtype, layers, extra_reader, mid_output, hw=None, single=False,
                    ties=False):
    """x -> dw conv -> t1 -> dw conv -> t2 ... -> y: the tensors between two depthwise convs
    are kept NHWC (PlanNhwc) unless another op reads them (extra_reader: a 1x1 dense conv of
    t1 as a second graph output) or they are graph outputs (mid_output: t1)."""
    from qdsl.graph.ir import IntegerGraph, Op

    h, w = hw or [int(v) for v in rng.choice([1, 2, 3, 5, 7, 8, 13, 17], 2)]
    tensors, ops = [Tensor("x", xdtype, (-1, c, h, w))], []
    src, src_dtype = "x", xdtype
    for i, (k, stride, pad) in enumerate(layers):
        pad = min(pad, k // 2 + 1)
        oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        if oh < 1 or ow < 1:
            pad = k  # the window must fit the padded input
            oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        out = DType.U8 if i == len(layers) - 1 and rng.random() < 0.5 else mid_dtype
        wt = _rand(rng, DType.I8, (c, 1, k, k))
        attrs = {"stride": [stride] * 2, "padding": [pad] * 2, "dilation": [1, 1], "groups": c,
                 "in_zp": int(rng.integers(*src_dtype.range)), "w_zp": [0], "acc_bits": 32, "overflow": 0}
        attrs.update(_single_stage(rng, c, *out.range, ties) if single else _stage(rng, c, *out.range))
        name = "y" if i == len(layers) - 1 else f"t{i + 1}"
        tensors += [Tensor(f"w{i}", DType.I8, wt.shape, wt), Tensor(f"b{i}", DType.I32, (c,), rng.integers(-9000, 9000, c)),
                    Tensor(name, out, (-1, c, oh, ow))]
        ops.append(Op(OpType.CONV2D, f"dw{i}", [src, f"w{i}", f"b{i}"], [name], attrs))
        src, src_dtype, h, w = name, out, oh, ow
    outputs = ["y"]
    if extra_reader:
        t1 = next(t for t in tensors if t.name == "t1")
        wd = _rand(rng, DType.I8, (3, c, 1, 1))
        attrs = {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1,
                 "in_zp": int(rng.integers(*t1.dtype.range)), "w_zp": [0], "acc_bits": 32, "overflow": 0}
        attrs.update(_stage(rng, 3, -128, 127))
        tensors += [Tensor("wd", DType.I8, wd.shape, wd), Tensor("z", DType.I8, (-1, 3, *t1.shape[2:]))]
        ops.append(Op(OpType.CONV2D, "dense", ["t1", "wd"], ["z"], attrs))
        outputs.append("z")
    if mid_output:
        outputs.append("t1")
    return IntegerGraph(tensors, ["x"], outputs, ops).validate()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), xdtype=st.sampled_from([DType.U8, DType.I8]),
       mid_dtype=st.sampled_from([DType.U8, DType.I8]), threads=st.sampled_from([1, 2]),
       extra_reader=st.sampled_from([False, False, True]), mid_output=st.sampled_from([False, False, True]))
def test_depthwise_chain_nhwc_matches_reference(seed, xdtype, mid_dtype, threads, extra_reader, mid_output):
    """Chains of depthwise convs (O == C, the fast stage): the tensors between them are NHWC
    on the fast paths, so the convs read and write every layout pair (NCHW in / NHWC out,
    NHWC both, NHWC in / NCHW out); 3x3 and 5x5, stride 1 and 2, padding 0..2, channel counts
    around the 16-channel steps, tiny and odd planes, batch > 1, clamps, I8 and U8."""
    rng = np.random.default_rng(seed)
    c = int(rng.choice([1, 3, 8, 16, 17, 24, 33]))
    layers = [(int(rng.choice([3, 5])), int(rng.choice([1, 2])), int(rng.integers(0, 3)))
              for _ in range(int(rng.integers(2, 4)))]
    graph = _dw_chain_graph(rng, c=c, xdtype=xdtype, mid_dtype=mid_dtype, layers=layers,
                            extra_reader=extra_reader, mid_output=mid_output)
    x = _rand(rng, xdtype, (int(rng.integers(1, 4)), c, *graph.tensors[0].shape[2:]))
    _with_threads(threads, lambda: _check(graph, x))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), xdtype=st.sampled_from([DType.U8, DType.I8]),
       mid_dtype=st.sampled_from([DType.U8, DType.I8]), threads=st.sampled_from([1, 2]), ties=st.booleans())
def test_depthwise_nhwc_stage_from_registers_matches_reference(seed, xdtype, mid_dtype, threads, ties):
    """Chains of depthwise convs with FIXED_SINGLE stages (per channel or per tensor, every
    rounding, zero points, clamps): the NHWC depthwise kernel applies the stage to its sums in
    registers (DwNhwcStageKernel, csrc/requant/stage_f32_avx2.h) and stores codes; channel
    counts off the 16-channel steps (a partial last block, a lone last 16-channel block of a
    32-channel group, 48: three blocks), 3x3 and 5x5, strides 1 and 2; `ties`: scales that put
    many sums exactly on rounding ties (the exact recompute)."""
    rng = np.random.default_rng(seed)
    c = int(rng.choice([1, 3, 16, 17, 32, 33, 48]))
    layers = [(int(rng.choice([3, 5])), int(rng.choice([1, 2])), int(rng.integers(0, 3)))
              for _ in range(int(rng.integers(2, 4)))]
    graph = _dw_chain_graph(rng, c=c, xdtype=xdtype, mid_dtype=mid_dtype, layers=layers, extra_reader=False,
                            mid_output=False, single=True, ties=ties)
    x = _rand(rng, xdtype, (int(rng.integers(1, 4)), c, *graph.tensors[0].shape[2:]))
    cg = _with_threads(threads, lambda: _check(graph, x))
    if "avx2" in PATHS:
        cg.run(x, path="avx2")
        plan = {p["name"]: p for p in cg.plan()}
        assert all(plan[op.name]["register_stage"] for op in graph.ops)
        assert plan["dw0"]["nhwc_output"] and not plan[graph.ops[-1].name]["nhwc_output"]


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31), stride=st.sampled_from([1, 2]))
def test_depthwise_chain_nhwc_threaded_matches_reference(seed, stride):
    """MobileNet-sized NHWC depthwise convs (many rows: the pool splits output rows across 2
    threads, bands of rows within a task), U8 activations with a ReLU6-style clamp."""
    rng = np.random.default_rng(seed)
    graph = _dw_chain_graph(rng, c=int(rng.choice([32, 40])), xdtype=DType.U8, mid_dtype=DType.U8,
                            layers=[(3, 1, 1), (3, stride, 1), (5, 1, 2)], extra_reader=False, mid_output=False,
                            hw=(57, 57))
    x = _rand(rng, DType.U8, (2, *graph.tensors[0].shape[1:]))
    for threads in (1, 2):
        _with_threads(threads, lambda: _check(graph, x))

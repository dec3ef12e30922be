"""Int8 convs on the shapes where the optimized conv paths change strategy (AMX implicit
GEMM: row tiles of 16 positions, 64-byte K segments per kernel row or per tap, 16-channel
panels; VNNI/AVX2 im2col paths) equal the Python reference executor bit for bit, on every
kernel path this CPU has."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import DType, GraphFormatError, OpType, Tensor  # noqa: E402

from qdsl.graph import execute  # noqa: E402
from tests.runtime.test_graph import PATHS, _check, _graph, _rand, _stage  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), rank=st.sampled_from([1, 2, 2]), xdtype=st.sampled_from([DType.I8, DType.U8]),
       out=st.sampled_from([DType.I8, DType.U8, DType.I32]), bias=st.booleans(),
       wmag=st.sampled_from([128, 128, 64, 16, 8]))
def test_int8_conv_geometry_matches_reference(seed, rank, xdtype, out, bias, wmag):
    # wmag < 128: weights clipped to +-wmag, so AVX2 runs its vpmaddubsw conv kernels
    # (S = 1, 4, 8 int16 pair sums per widening) with many pairs at the bound
    rng = np.random.default_rng(seed)
    cin = int(rng.choice([1, 3, 16, 17, 32, 40, 64, 70]))
    cout = int(rng.choice([1, 8, 16, 17, 33, 48]))
    k = [int(rng.integers(1, 6)) for _ in range(rank)]
    spatial = [int(rng.choice([1, 5, 8, 15, 16, 17, 33])) + k[i] for i, _ in enumerate(range(rank))]
    w = _rand(rng, DType.I8, (cout, cin, *k))
    if wmag < 128:
        w = np.clip(w, -wmag, wmag)
    attrs = {
        "stride": [int(rng.integers(1, 4)) for _ in range(rank)], "padding": [int(rng.integers(0, 4)) for _ in range(rank)],
        "dilation": [int(rng.integers(1, 3)) for _ in range(rank)], "groups": 1,
        "in_zp": int(rng.integers(*xdtype.range)), "w_zp": [0], "acc_bits": 32, "overflow": 0,
    }
    lo, hi = (-(2**31), 2**31 - 1) if out is DType.I32 else out.range
    attrs.update(_stage(rng, cout, lo, hi, pot=False if out is DType.I32 else None))
    consts = [Tensor("w", DType.I8, w.shape, w)]
    if bias:
        consts.append(Tensor("b", DType.I32, (cout,), rng.integers(-5000, 5000, cout)))
    op = OpType.CONV1D if rank == 1 else OpType.CONV2D
    try:
        graph = _graph(op, [("x", xdtype, (-1, cin, *spatial))], attrs, out, consts)
    except GraphFormatError:
        return  # drawn geometry is invalid (window larger than the padded input)
    _check(graph, _rand(rng, xdtype, (int(rng.integers(1, 4)), cin, *spatial)))


def _conv_attrs(rng, cout, out_dtype):
    lo, hi = (-(2**31), 2**31 - 1) if out_dtype is DType.I32 else out_dtype.range
    return {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1, "in_zp": 3, "w_zp": [0],
            "acc_bits": 32, "overflow": 0, **_stage(rng, cout, lo, hi, pot=False if out_dtype is DType.I32 else None)}


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), order=st.sampled_from(["input", "conv_first", "conv_second"]),
       pot=st.booleans(), ow=st.sampled_from([8, 16, 19]))
def test_residual_add_fused_into_conv_matches_reference(seed, order, pot, ow):
    """A conv whose I32 output feeds only an ADD computes the ADD in its epilogue on the AMX
    path (the executor skips the ADD).  The ADD's other input is the graph input, or a
    second conv run before or after this one; all paths equal the reference."""
    from qdsl.graph.ir import IntegerGraph, Op

    rng = np.random.default_rng(seed)
    c = 16
    shape = (-1, c, 9, ow)
    w1, w2 = (rng.integers(-127, 128, (c, c, 3, 3)).astype(np.int8) for _ in range(2))
    tensors = [Tensor("x", DType.U8, shape), Tensor("w1", DType.I8, w1.shape, w1), Tensor("w2", DType.I8, w2.shape, w2),
               Tensor("a", DType.I32, shape), Tensor("b", DType.I32, shape), Tensor("y", DType.U8, shape)]
    conv_a = Op(OpType.CONV2D, "a", ["x", "w1"], ["a"], _conv_attrs(rng, c, DType.I32))
    conv_b = Op(OpType.CONV2D, "b", ["x", "w2"], ["b"], _conv_attrs(rng, c, DType.I32))
    in_rq = {"in_zp": [0, 0], "in_kind": [1, 1] if pot else [2, 2], "in_multiplier": [1, 1] if pot else
             [int(v) for v in rng.integers(1 << 30, 1 << 31, 2)], "in_shift": [0, 0] if pot else [-2, 0],
             "in_rounding": [int(v) for v in rng.integers(0, 4, 2)]}
    other = "x" if order == "input" else "b"
    if order == "input":
        in_rq["in_zp"] = [0, 3]
        tensors = [t for t in tensors if t.name != "b"]
    inputs = ["a", other]
    if rng.random() < 0.5:  # the conv as the second ADD input, rescales swapped with it
        inputs = [other, "a"]
        in_rq = {k: list(reversed(v)) for k, v in in_rq.items()}
    add = Op(OpType.ADD, "add", inputs, ["y"], {**in_rq, "pre_shift": 0, **_stage(rng, 1, 0, 255)})
    ops = {"input": [conv_a, add], "conv_first": [conv_a, conv_b, add], "conv_second": [conv_b, conv_a, add]}[order]
    graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
    _check(graph, _rand(rng, DType.U8, (2, c, 9, ow)))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), ow=st.sampled_from([8, 16, 21]), stride=st.sampled_from([1, 2]),
       fuse=st.booleans())
def test_nhwc_chain_matches_reference(seed, ow, stride, fuse):
    """x -> conv a (U8) -> conv b (I32) -> ADD(b, a) -> conv c -> y: on AMX runs a, b and the
    ADD's output are kept NHWC (only AMX convs and the ADD read them), b takes the ADD when
    its output is I32; c reads NHWC and writes the NCHW graph output."""
    from qdsl.graph.ir import IntegerGraph, Op

    rng = np.random.default_rng(seed)
    c = 16
    shape = (-1, c, 10, ow)
    ws = [rng.integers(-127, 128, (c, c, 3, 3)).astype(np.int8) for _ in range(3)]
    b_dtype = DType.I32 if fuse else DType.U8
    c_attrs = _conv_attrs(rng, c, DType.U8)
    c_attrs["stride"] = [stride, stride]
    out_shape = (-1, c, (10 - 1) // stride + 1, (ow - 1) // stride + 1)
    tensors = [Tensor("x", DType.U8, shape)] + [Tensor(f"w{i}", DType.I8, w.shape, w) for i, w in enumerate(ws)] + [
        Tensor("a", DType.U8, shape), Tensor("b", b_dtype, shape), Tensor("s", DType.U8, shape),
        Tensor("y", DType.U8, out_shape)]
    in_rq = {"in_zp": [0, 3], "in_kind": [1, 2], "in_multiplier": [1, int(rng.integers(1 << 30, 1 << 31))],
             "in_shift": [0, -3], "in_rounding": [int(v) for v in rng.integers(0, 4, 2)]}
    ops = [Op(OpType.CONV2D, "a", ["x", "w0"], ["a"], _conv_attrs(rng, c, DType.U8)),
           Op(OpType.CONV2D, "b", ["a", "w1"], ["b"], _conv_attrs(rng, c, b_dtype)),
           Op(OpType.ADD, "add", ["b", "a"], ["s"], {**in_rq, "pre_shift": 0, **_stage(rng, 1, 0, 255)}),
           Op(OpType.CONV2D, "c", ["s", "w2"], ["y"], c_attrs)]
    graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
    _check(graph, _rand(rng, DType.U8, (int(rng.integers(1, 4)), c, 10, ow)))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), xdtype=st.sampled_from([DType.I8, DType.U8, DType.I32]))
def test_global_avgpool_every_input_dtype(seed, xdtype):
    """GLOBAL_AVGPOOL reads I8/U8 and wide I32 inputs (per-dtype sums, planes in parallel);
    an I32 input comes from a conv (graph inputs are never I32)."""
    from qdsl.graph.ir import IntegerGraph, Op

    rng = np.random.default_rng(seed)
    c = int(rng.integers(1, 40))
    shape = (-1, c, int(rng.integers(1, 20)), int(rng.integers(1, 20)))
    pool_attrs = {"in_zp": 0, **_stage(rng, c, 0, 255)}
    if xdtype is DType.I32:
        w = rng.integers(-127, 128, (c, c, 1, 1)).astype(np.int8)
        conv = {**_conv_attrs(rng, c, DType.I32), "padding": [0, 0]}
        tensors = [Tensor("x", DType.U8, shape), Tensor("w", DType.I8, w.shape, w), Tensor("h", DType.I32, shape),
                   Tensor("y", DType.U8, (-1, c, 1, 1))]
        ops = [Op(OpType.CONV2D, "conv", ["x", "w"], ["h"], conv),
               Op(OpType.GLOBAL_AVGPOOL, "pool", ["h"], ["y"], pool_attrs)]
        graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
        xdtype = DType.U8
    else:
        pool_attrs["in_zp"] = int(rng.integers(*xdtype.range))
        graph = _graph(OpType.GLOBAL_AVGPOOL, [("x", xdtype, shape)], pool_attrs, DType.U8)
    _check(graph, _rand(rng, xdtype, (int(rng.integers(1, 4)), *shape[1:])))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), out2=st.sampled_from([DType.U8, DType.I8, DType.I32]))
def test_twin_convs_share_accumulators(seed, out2):
    """Two convs with the same input, weights, bias and geometry but their own output stage
    (the exporter's requantized + I32 residual pair): the im2col path computes the second
    from the first one's accumulators; both outputs must equal the reference."""
    from qdsl.graph.ir import IntegerGraph, Op

    rng = np.random.default_rng(seed)
    cin, cout, hw = int(rng.choice([1, 3, 16])), int(rng.choice([8, 16, 17])), int(rng.choice([5, 8, 12]))
    w = _rand(rng, DType.I8, (cout, cin, 3, 3))
    b = rng.integers(-5000, 5000, cout)
    base = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1, "in_zp": int(rng.integers(0, 256)),
            "w_zp": [0], "acc_bits": 32, "overflow": 0}
    a1 = dict(base, **_stage(rng, cout, 0, 255))
    lo, hi = (-(2**31), 2**31 - 1) if out2 is DType.I32 else out2.range
    a2 = dict(base, **_stage(rng, cout, lo, hi, pot=False if out2 is DType.I32 else None))
    x = Tensor("x", DType.U8, (-1, cin, hw, hw))
    consts = [Tensor("w", DType.I8, w.shape, w), Tensor("b", DType.I32, (cout,), b)]
    ops = [Op(OpType.CONV2D, "c1", ["x", "w", "b"], ["y1"], a1), Op(OpType.CONV2D, "c2", ["x", "w", "b"], ["y2"], a2)]
    tensors = [x, *consts, Tensor("y1", DType.U8, (-1, cout, hw, hw)), Tensor("y2", out2, (-1, cout, hw, hw))]
    graph = IntegerGraph(tensors, ["x"], ["y1", "y2"], ops).validate()
    cg = rt.CompiledGraph(graph)
    for path in PATHS:  # a fresh input per run: a skipped twin would leave the last run's output
        xs = _rand(rng, DType.U8, (int(rng.integers(1, 40)), cin, hw, hw))
        want = execute(graph, [xs]).outputs
        got = cg.run(xs, path=path)
        for g, w_ in zip(got, want):
            np.testing.assert_array_equal(g, w_, err_msg=f"path {path}")


@pytest.mark.parametrize("k,hw", [(1, 1), (1, 7), (1, 15), (1, 17), (3, 9), (2, 20)])
@pytest.mark.parametrize("xdtype", [DType.U8, DType.I8])
@pytest.mark.parametrize("batch", [1, 3])
def test_unpadded_stride1_conv_reads_input_in_place(k, hw, xdtype, batch):
    """Stride-1 convs without padding (every 1x1 conv) on U8 inputs read the input images
    in place instead of a padded copy (conv_im2col.cc PadImagesU8); I8 inputs still take the
    flipped copy.  Bias, a FIXED_SINGLE or POT stage, images that end panels mid-row, and
    several images per GEMM: equal to the reference on every path."""
    rng = np.random.default_rng(k * 1000 + hw * 10 + batch)
    cin, cout = 17, 24
    w = _rand(rng, DType.I8, (cout, cin, k, k))
    attrs = {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1,
             "in_zp": int(rng.integers(*xdtype.range)), "w_zp": [0], "acc_bits": 32, "overflow": 0,
             **_stage(rng, cout, 0, 255)}
    consts = [Tensor("w", DType.I8, w.shape, w), Tensor("b", DType.I32, (cout,), rng.integers(-5000, 5000, cout))]
    graph = _graph(OpType.CONV2D, [("x", xdtype, (-1, cin, hw, hw))], attrs, DType.U8, consts)
    _check(graph, _rand(rng, xdtype, (batch, cin, hw, hw)))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), hw=st.sampled_from([7, 14, 28]), batch=st.sampled_from([1, 2, 3]),
       wmag=st.sampled_from([64, 128]), xdtype=st.sampled_from([DType.I8, DType.U8]))
def test_resnet_plane_sizes_gather_runs_match_reference(seed, hw, batch, wmag, xdtype):
    """ResNet's 3x3 convs on 7/14/28 planes: the AVX2 panel gathers load a panel that
    crosses output row ends as one vector per row piece merged by blends (up to four),
    else by bytes (the padding columns of the last panel), several panels per gather;
    weight strips of 6 and 5 rows; wmag 64: the vpmaddubsw kernel, 128: the int16 one."""
    rng = np.random.default_rng(seed)
    cin, cout = 16, 23
    w = np.clip(_rand(rng, DType.I8, (cout, cin, 3, 3)), -wmag, wmag)
    attrs = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1,
             "in_zp": int(rng.integers(*xdtype.range)), "w_zp": [0], "acc_bits": 32, "overflow": 0,
             **_stage(rng, cout, *DType.U8.range)}
    graph = _graph(OpType.CONV2D, [("x", xdtype, (-1, cin, hw, hw))], attrs, DType.U8,
                   [Tensor("w", DType.I8, w.shape, w)])
    _check(graph, _rand(rng, xdtype, (batch, cin, hw, hw)))

"""The C++ runtime equals the Python reference executor on hand-built graphs of every op,
and corrupt graphs or mismatched inputs raise Python exceptions (never a crash)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, OutputStage, Rescale, Tensor  # noqa: E402
from qdsl.graph.qgraph import graph_to_bytes  # noqa: E402
from qdsl.graph.reference import GraphInputError, execute  # noqa: E402
from qdsl.graph.requant import make_rescale  # noqa: E402
from qdsl.graph.validate import infer_output  # noqa: E402
from qdsl.spec.diagnostics import QdslError  # noqa: E402

from qdsl.runtime import kernels as K  # noqa: E402

PATHS = [p for p in ("ref", "portable", "avx2", "avxvnni", "avx512", "amx") if p in K.paths()["cpu"]]
_RAN: list = []


def _graph(op_type, inputs, attrs, out_dtype=DType.I8, consts=(), validate=True):
    acts = [Tensor(n, d, s) for n, d, s in inputs]
    op = Op(op_type, "layer", [t.name for t in acts] + [t.name for t in consts], ["y"], attrs)
    _, shape = infer_output(0, op, acts + list(consts), Tensor("y", out_dtype, (1,)))
    graph = IntegerGraph(acts + list(consts) + [Tensor("y", out_dtype, shape)], [t.name for t in acts], ["y"], [op])
    return graph.validate() if validate else graph


def _stage(rng, channels=1, lo=-128, hi=127, pot=None):
    pot = rng.random() < 0.5 if pot is None else pot
    if pot:
        r = Rescale(1, (1,) * channels, tuple(int(s) for s in rng.integers(0, 12, channels)), int(rng.integers(0, 4)))
    else:
        single = bool(rng.random() < 0.5)  # FIXED (gemmlowp) or FIXED_SINGLE (one rounding)
        r = make_rescale(rng.uniform(1e-4, 0.05, channels), int(rng.integers(0, 4)) if single else 0,
                         allow_pot=False, single=single)
    zp = int(rng.integers(lo, hi + 1)) if rng.random() < 0.5 else max(lo, 0)
    relu = rng.random() < 0.3
    return OutputStage(r, zp, zp if relu else lo, hi).attrs()


def _rand(rng, dtype, shape):
    lo, hi = dtype.range
    if dtype is DType.BIN:
        return rng.choice([-1, 1], size=shape).astype(np.int8)
    return rng.integers(lo, hi + 1, size=shape).astype(dtype.numpy if dtype.bits >= 8 else np.int8)


def _decoy(x):
    x = np.asarray(x)
    if x.dtype.kind == "f":
        return (-0.5 * x).astype(x.dtype)
    return (x.view(np.uint8) ^ np.uint8(0x5A)).view(x.dtype).reshape(x.shape)


def _check(graph, *xs):
    want = execute(graph, list(xs))
    cg = rt.CompiledGraph(graph)
    for path in PATHS:
        # a decoy run first: an op a path wrongly skips would otherwise leave the previous
        # path's (correct) output in its buffer and pass
        cg.run(*[_decoy(x) for x in xs], path=path)
        got = cg.run(*xs, path=path)
        got = got if isinstance(got, tuple) else (got,)
        for g, w in zip(got, want.outputs):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w, err_msg=f"path {path}")
        counts = cg.overflow_counts()
        assert {k: v for k, v in counts.items() if k in want.overflow} == want.overflow
    return cg


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), rank=st.sampled_from([1, 2]), wdtype=st.sampled_from(
    [DType.I8, DType.U8, DType.I4, DType.U4, DType.I2, DType.BIN]), xdtype=st.sampled_from([DType.I8, DType.U8]),
    depthwise=st.booleans(), acc_bits=st.sampled_from([32, 32, 16, 12]), bin_out=st.booleans())
def test_conv_matches_reference(seed, rank, wdtype, xdtype, depthwise, acc_bits, bin_out):
    rng = np.random.default_rng(seed)
    groups = int(rng.choice([1, 2])) if not depthwise else 0
    cin = int(rng.integers(1, 5)) * (groups or 1)
    if depthwise:
        groups = cin
    cout = groups * int(rng.integers(1, 4))
    k = [int(rng.integers(1, 4)) for _ in range(rank)]
    spatial = [int(rng.integers(max(k) + 2, 12)) for _ in range(rank)]
    w = _rand(rng, wdtype, (cout, cin // groups, *k))
    lo, hi = wdtype.range
    w_zp = [0] if wdtype is DType.BIN else [int(v) for v in rng.integers(lo, hi + 1, cout)] if rng.random() < 0.3 else [0]
    attrs = {
        "stride": [int(rng.integers(1, 3)) for _ in range(rank)], "padding": [int(rng.integers(0, 3)) for _ in range(rank)],
        "dilation": [int(rng.integers(1, 3)) for _ in range(rank)], "groups": groups,
        "in_zp": int(rng.integers(*xdtype.range)), "w_zp": w_zp, "acc_bits": acc_bits, "overflow": int(rng.integers(0, 2)),
    }
    out_dtype = DType.BIN if bin_out else DType.U8
    if not bin_out:
        attrs.update(_stage(rng, cout, 0, 255))
    consts = [Tensor("w", wdtype, w.shape, w), Tensor("b", DType.I32, (cout,), rng.integers(-500, 500, cout))]
    op = OpType.CONV1D if rank == 1 else OpType.CONV2D
    try:
        graph = _graph(op, [("x", xdtype, (-1, cin, *spatial))], attrs, out_dtype, consts)
    except GraphFormatError:
        return  # drawn geometry is invalid (window larger than the padded input)
    _check(graph, _rand(rng, xdtype, (3, cin, *spatial)))
    _RAN.append(1)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), rank=st.sampled_from([0, 1, 2]), bin_out=st.booleans())
def test_binary_conv_and_linear_match_reference(seed, rank, bin_out):
    rng = np.random.default_rng(seed)
    cin, cout = int(rng.integers(1, 70)), int(rng.integers(1, 9))
    attrs = {"acc_bits": 32, "overflow": 0}
    if rank == 0:
        op, shape, w = OpType.BLINEAR, (-1, cin), _rand(rng, DType.BIN, (cout, cin))
    else:
        k = [int(rng.integers(1, 4)) for _ in range(rank)]
        shape = (-1, cin, *[int(rng.integers(4, 9)) for _ in range(rank)])
        w = _rand(rng, DType.BIN, (cout, cin, *k))
        attrs.update({"stride": [1] * rank, "padding": [int(rng.integers(0, 2)) for _ in range(rank)],
                      "dilation": [1] * rank, "groups": 1})
        op = OpType.BCONV1D if rank == 1 else OpType.BCONV2D
    if not bin_out:
        attrs.update(_stage(rng, cout))
    graph = _graph(op, [("x", DType.BIN, shape)], attrs, DType.BIN if bin_out else DType.I8,
                   [Tensor("w", DType.BIN, w.shape, w)], validate=False)
    # BIN graph inputs are not allowed: binarize a float input first
    x = rng.standard_normal((2, *shape[1:])).astype(np.float32)
    chain = _chain_binarize(graph, shape)
    _check(chain, x)


def _chain_binarize(graph, shape):
    xf = Tensor("xf", DType.F32, shape)
    xb = Tensor("x", DType.BIN, shape)
    ops = [Op(OpType.BINARIZE, "bin", ["xf"], ["x"], {"zero_point": 0})] + list(graph.ops)
    tensors = [xf] + [t if t.name != "x" else xb for t in graph.tensors]
    return IntegerGraph(tensors, ["xf"], list(graph.outputs), ops).validate()


def test_linear_quantize_dequantize_chain():
    rng = np.random.default_rng(1)
    w = _rand(rng, DType.I8, (10, 33))
    tensors = [Tensor("x", DType.F32, (-1, 33)), Tensor("q", DType.U8, (-1, 33)),
               Tensor("w", DType.I8, w.shape, w), Tensor("h", DType.U8, (-1, 10)), Tensor("y", DType.F32, (-1, 10))]
    ops = [
        Op(OpType.QUANTIZE, "q", ["x"], ["q"], {"scale": 0.05, "zero_point": 128, "qmin": 0, "qmax": 255, "rounding": 1}),
        Op(OpType.LINEAR, "fc", ["q", "w"], ["h"], {"in_zp": 128, "w_zp": [0], "acc_bits": 32, "overflow": 0,
                                                  **OutputStage(make_rescale(0.003), 3, 3, 255).attrs()}),
        Op(OpType.DEQUANTIZE, "dq", ["h"], ["y"], {"scale": 0.1, "zero_point": 3}),
    ]
    graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
    x = rng.standard_normal((5, 33)).astype(np.float32) * 4
    x[0, :4] = [np.nan, np.inf, -np.inf, 0.025]
    _check(graph, x)


@pytest.mark.parametrize("rounding", [0, 1, 2, 3])
def test_quantize_rounding_modes(rounding):
    graph = _graph(OpType.QUANTIZE, [("x", DType.F32, (-1, 64))],
                   {"scale": 0.5, "zero_point": -3, "qmin": -128, "qmax": 127, "rounding": rounding})
    x = (np.arange(-32, 32, dtype=np.float32) / 4).reshape(1, 64)
    _check(graph, x)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_elementwise_and_pool_ops_match_reference(seed):
    rng = np.random.default_rng(seed)
    shape = (-1, int(rng.integers(1, 5)), int(rng.integers(3, 9)), int(rng.integers(3, 9)))
    x = _rand(rng, DType.U8, (2, *shape[1:]))
    x2 = _rand(rng, DType.I8, (2, *shape[1:]))
    two = [("x", DType.U8, shape), ("x2", DType.I8, shape)]
    in_rq = lambda pot: {  # noqa: E731
        "in_zp": [int(rng.integers(0, 256)), int(rng.integers(-128, 128))],
        "in_kind": [1, 1] if pot else [0, 0],
        "in_multiplier": [1, 1] if pot else [int(v) for v in rng.integers(1 << 30, 1 << 31, 2)],
        "in_shift": [int(v) for v in rng.integers(-2, 3, 2)] if pot else [int(v) for v in rng.integers(0, 3, 2)],
        "in_rounding": [int(v) for v in rng.integers(0, 4, 2)] if pot else [0, 0]}
    pot = bool(rng.random() < 0.5)
    _check(_graph(OpType.ADD, two, {**in_rq(pot), "pre_shift": 0 if pot else 20, **_stage(rng)}), x, x2)
    cat = in_rq(pot)
    _check(_graph(OpType.CONCAT, two, {**cat, "axis": int(rng.integers(1, 4)), "out_zp": 1, "out_min": -100,
                                       "out_max": 120}), x, x2)
    _check(_graph(OpType.REQUANTIZE, [("x", DType.U8, shape)], {"in_zp": 9, **_stage(rng, shape[1])}), x)
    _check(_graph(OpType.CLAMP, [("x", DType.U8, shape)], {"out_min": 10, "out_max": 200}, DType.U8), x)
    k, s = [int(v) for v in rng.integers(1, 4, 2)], [int(v) for v in rng.integers(1, 3, 2)]
    p = [int(rng.integers(0, k[0] // 2 + 1)), int(rng.integers(0, k[1] // 2 + 1))]
    _check(_graph(OpType.MAXPOOL2D, [("x", DType.U8, shape)], {"kernel": k, "stride": s, "padding": p,
                                                               "dilation": [1, 1]}, DType.U8), x)
    _check(_graph(OpType.AVGPOOL2D, [("x", DType.U8, shape)], {"kernel": k, "stride": s, "padding": p, "in_zp": 4,
                                                               **_stage(rng)}), x)
    _check(_graph(OpType.MAXPOOL1D, [("x", DType.U8, shape[:3])], {"kernel": k[:1], "stride": s[:1], "padding": p[:1],
                                                                   "dilation": [1]}, DType.U8), x[:, :, :, 0])
    _check(_graph(OpType.GLOBAL_AVGPOOL, [("x", DType.U8, shape)], {"in_zp": 7, **_stage(rng)}), x)
    _check(_graph(OpType.RESHAPE, [("x", DType.U8, shape)], {"shape": [int(np.prod(shape[1:]))]}, DType.U8), x)
    _check(_graph(OpType.BINARIZE, [("x", DType.U8, shape)], {"zero_point": 100}, DType.BIN), x)
    _check(_graph(OpType.DEQUANTIZE, [("x", DType.U8, shape)], {"scale": 0.37, "zero_point": 100}, DType.F32), x)


def test_narrow_accumulator_overflow_counts():
    rng = np.random.default_rng(2)
    w = np.full((4, 50), 127, np.int8)
    for mode in (0, 1):
        graph = _graph(OpType.LINEAR, [("x", DType.U8, (-1, 50))], {"in_zp": 0, "w_zp": [0], "acc_bits": 16,
                                                                     "overflow": mode, **_stage(rng, pot=True)},
                       consts=[Tensor("w", DType.I8, w.shape, w)])
        x = np.full((3, 50), 255, np.uint8)
        x[1] = 1
        cg = _check(graph, x)
        assert cg.overflow_counts()["layer"] == 8


def _small_graph_bytes():
    rng = np.random.default_rng(4)
    w = _rand(rng, DType.I4, (3, 2, 3, 3))
    g = _graph(OpType.CONV2D, [("x", DType.U8, (-1, 2, 6, 6))],
               {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1, "in_zp": 3, "w_zp": [0],
                "acc_bits": 32, "overflow": 0, **_stage(rng, 3)}, consts=[Tensor("w", DType.I4, w.shape, w)])
    return graph_to_bytes(g)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_corrupt_bytes_raise_not_crash(data):
    blob = bytearray(_small_graph_bytes())
    action = data.draw(st.sampled_from(["truncate", "flip", "flip_fix_crc"]))
    if action == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    else:
        pos = data.draw(st.integers(0, len(blob) - 5))
        blob[pos] ^= 1 << data.draw(st.integers(0, 7))
        if action == "flip_fix_crc":  # get past the checksum to exercise the table parser
            import zlib

            blob[-4:] = zlib.crc32(bytes(blob[:-4])).to_bytes(4, "little")
    try:
        cg = rt.CompiledGraph(bytes(blob))
    except QdslError:
        return
    # a flip that still parses (e.g. in a weight value) must still run safely
    cg.run(np.zeros((1, 2, 6, 6), np.uint8))


def test_bad_inputs_raise():
    cg = rt.CompiledGraph(_small_graph_bytes())
    with pytest.raises(GraphInputError, match="expects shape"):
        cg.run(np.zeros((1, 3, 6, 6), np.uint8))
    with pytest.raises(GraphInputError, match="values must be in"):
        cg.run(np.full((1, 2, 6, 6), 300, np.int32))
    with pytest.raises(GraphInputError, match="integers"):
        cg.run(np.zeros((1, 2, 6, 6), np.float32))
    with pytest.raises(GraphInputError, match="input"):
        cg.run()
    with pytest.raises(GraphFormatError, match="magic"):
        rt.CompiledGraph(b"X" * 100)


def test_run_graph_cpp_backend_and_batch_change():
    from qdsl.runtime.run import run_graph

    blob = _small_graph_bytes()
    for batch in (1, 4, 2):
        x = np.random.default_rng(batch).integers(0, 256, (batch, 2, 6, 6)).astype(np.uint8)
        np.testing.assert_array_equal(run_graph(blob, x, backend="cpp"), run_graph(blob, x, backend="reference"))


def test_conv_examples_were_not_all_rejected():
    test_conv_matches_reference()
    assert len(_RAN) >= 10, f"only {len(_RAN)} conv geometries were valid"


@pytest.mark.parametrize("a_bits", [4, 7, 8])
def test_proven_activation_ranges_pick_the_kernels(a_bits):
    """The validator carries each activation's proven range (QUANTIZE qmin/qmax, stage
    out_min/out_max, CLAMP; unchanged through MAXPOOL and RESHAPE) into the convs: with
    a_bits-bit activations, full-range int8 weights take the exact vpmaddubsw kernel on
    AVX2 (S = 32767 // (max code * 254)).  Inputs saturate the quantizer so the codes reach
    the bound, and every path must still equal the reference."""
    rng = np.random.default_rng(a_bits)
    hi = (1 << a_bits) - 1
    w1 = np.where(rng.random((8, 3, 3, 3)) < 0.5, 127, -127).astype(np.int8)
    w2 = np.where(rng.random((8, 8, 3, 3)) < 0.5, 127, -127).astype(np.int8)
    w3 = np.where(rng.random((5, 8 * 4 * 4)) < 0.5, 127, -127).astype(np.int8)
    conv = {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1, "w_zp": [0], "acc_bits": 32,
            "overflow": 0}
    stage = OutputStage(make_rescale(0.0004), 0, 0, hi).attrs()  # ReLU to a_bits bits
    tensors = [Tensor("x", DType.F32, (-1, 3, 8, 8)), Tensor("q", DType.U8, (-1, 3, 8, 8)),
               Tensor("c", DType.U8, (-1, 3, 8, 8)), Tensor("w1", DType.I8, w1.shape, w1),
               Tensor("h1", DType.U8, (-1, 8, 8, 8)), Tensor("w2", DType.I8, w2.shape, w2),
               Tensor("h2", DType.U8, (-1, 8, 8, 8)), Tensor("p", DType.U8, (-1, 8, 4, 4)),
               Tensor("r", DType.U8, (-1, 128)), Tensor("w3", DType.I8, w3.shape, w3), Tensor("y", DType.I8, (-1, 5))]
    ops = [
        Op(OpType.QUANTIZE, "q", ["x"], ["q"], {"scale": 0.01, "zero_point": 0, "qmin": 0, "qmax": 255, "rounding": 1}),
        Op(OpType.CLAMP, "clamp", ["q"], ["c"], {"out_min": 0, "out_max": hi}),
        Op(OpType.CONV2D, "conv1", ["c", "w1"], ["h1"], {**conv, "in_zp": 0, **stage}),
        Op(OpType.CONV2D, "conv2", ["h1", "w2"], ["h2"], {**conv, "in_zp": 0, **stage}),
        Op(OpType.MAXPOOL2D, "pool", ["h2"], ["p"], {"kernel": [2, 2], "stride": [2, 2], "padding": [0, 0],
                                                    "dilation": [1, 1]}),
        Op(OpType.RESHAPE, "flat", ["p"], ["r"], {"shape": [128]}),
        Op(OpType.LINEAR, "fc", ["r", "w3"], ["y"], {"in_zp": 0, "w_zp": [0], "acc_bits": 32, "overflow": 0,
                                                   **OutputStage(make_rescale(0.0001), 0, -128, 127).attrs()}),
    ]
    graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
    x = rng.uniform(-1, 4, (6, 3, 8, 8)).astype(np.float32)
    x[:, :, :4] = 100.0  # saturates: codes at the bound
    cg = _check(graph, x)
    plan = {p["name"]: p for p in cg.plan()}
    assert plan["clamp"]["input_range"] == (0, 255)
    for name in ("conv1", "conv2", "fc"):
        assert plan[name]["input_range"] == (0, hi), name
        assert plan[name]["maddubs_steps"] == min(8, 32767 // (hi * 254)), name
    assert "maddubs_steps" not in plan["pool"]
    assert plan["q"]["input_range"] is None  # F32


@pytest.mark.parametrize("rounding", [0, 1, 2, 3])
@pytest.mark.parametrize("other", ["i32", "u8_single", "u8_pot", "i8_single_pre"])
@pytest.mark.parametrize("swap", [False, True])
def test_add_shapes_the_exporter_emits(rounding, other, swap):
    """ADD as exporters emit it (the AVX2 fast loop): an I32 residual accumulator taken as
    is (POT shift 0), plus another I32 one or an 8-bit input rescaled up to the accumulator
    scale (FIXED_SINGLE with a left shift, or POT), then a POT or FIXED_SINGLE output stage,
    all with one rounding; the inputs in both orders, 200 elements (vector body and tail)."""
    rng = np.random.default_rng(rounding * 10 + len(other) + swap)
    n_feat, n_out = 23, 40
    i32_stage = OutputStage(Rescale(1, (1,), (0,), 0), 0, -(2**31), 2**31 - 1).attrs()
    w1, w2 = _rand(rng, DType.I8, (n_out, n_feat)), _rand(rng, DType.I8, (n_out, n_feat))
    tensors = [Tensor("x", DType.F32, (-1, n_feat)), Tensor("q", DType.U8, (-1, n_feat)),
               Tensor("w1", DType.I8, w1.shape, w1), Tensor("w2", DType.I8, w2.shape, w2),
               Tensor("a", DType.I32, (-1, n_out))]
    lin = {"in_zp": 128, "w_zp": [0], "acc_bits": 32, "overflow": 0}
    ops = [Op(OpType.QUANTIZE, "q", ["x"], ["q"], {"scale": 0.05, "zero_point": 128, "qmin": 0, "qmax": 255,
                                                 "rounding": 1}),
           Op(OpType.LINEAR, "fa", ["q", "w1"], ["a"], {**lin, **i32_stage})]
    if other == "i32":
        tensors.append(Tensor("b", DType.I32, (-1, n_out)))
        ops.append(Op(OpType.LINEAR, "fb", ["q", "w2"], ["b"], {**lin, **i32_stage}))
        kind, mult, shift, zp, pre = 1, 1, 0, 0, 0
    else:
        dt = DType.I8 if other.startswith("i8") else DType.U8
        lo, hi = dt.range
        tensors.append(Tensor("b", dt, (-1, n_out)))
        ops.append(Op(OpType.LINEAR, "fb", ["q", "w2"], ["b"],
                      {**lin, **OutputStage(make_rescale(0.004), 7 if dt is DType.U8 else -3, lo, hi).attrs()}))
        single = other.endswith("single") or other.endswith("single_pre")
        kind, mult, shift = (2, int(rng.integers(1 << 30, 1 << 31)), -6) if single else (1, 1, -5)
        zp, pre = (7, 0) if dt is DType.U8 else (-3, 2 if other.endswith("pre") else 0)
    tensors.append(Tensor("y", DType.U8, (-1, n_out)))
    ins = ["b", "a"] if swap else ["a", "b"]
    per = [(0, 1, 1, 0, rounding), (zp, kind, mult, shift, rounding)]
    if swap:
        per.reverse()
    out = OutputStage(Rescale(1, (1,), (11,), rounding) if rounding % 2 else make_rescale(2.0**-11 * 1.37, rounding,
                                                                                          allow_pot=False, single=True),
                      128, 0, 255).attrs()
    ops.append(Op(OpType.ADD, "add", ins, ["y"], {
        "in_zp": [p[0] for p in per], "in_kind": [p[1] for p in per], "in_multiplier": [p[2] for p in per],
        "in_shift": [p[3] for p in per], "in_rounding": [p[4] for p in per], "pre_shift": pre, **out}))
    graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
    x = rng.standard_normal((5, n_feat)).astype(np.float32) * 3
    _check(graph, x)


@pytest.mark.parametrize("rounding", [0, 1, 2, 3])
@pytest.mark.parametrize("kinds", [(2, 1), (1, 2), (2, 2), (1, 1)])
def test_add_of_two_8bit_inputs_rounds_each_like_the_reference(rounding, kinds):
    """Two U8 inputs scaled down with ties (FIXED_SINGLE 2^30 / 2^33 = 1/4, POT shift 2), the
    output stage near 1: each input's rounding shows in the output."""
    rng = np.random.default_rng(rounding * 7 + kinds[0] * 3 + kinds[1])
    x = rng.integers(0, 256, (3, 70)).astype(np.uint8)
    x2 = rng.integers(0, 256, (3, 70)).astype(np.uint8)
    rescale = {2: (1 << 30, 2), 1: (1, 2)}  # (multiplier, shift): x / 4 either way
    out = OutputStage(Rescale(1, (1,), (0,), rounding) if kinds[0] == 1 else
                      make_rescale(1.0, rounding, allow_pot=False, single=True), 64, 0, 255).attrs()
    attrs = {"in_zp": [3, 250], "in_kind": list(kinds), "in_multiplier": [rescale[k][0] for k in kinds],
             "in_shift": [rescale[k][1] for k in kinds], "in_rounding": [rounding, rounding], "pre_shift": 0, **out}
    graph = _graph(OpType.ADD, [("x", DType.U8, (-1, 70)), ("x2", DType.U8, (-1, 70))], attrs, DType.U8)
    got = _check(graph, x, x2).run(x, x2)
    assert 20 < len(np.unique(got)) and (got > 0).mean() > 0.3  # not all clamped


@pytest.mark.parametrize("bad", [b"la\xffer", b"la\xc0\x80r", b"l\xed\xa0\x80r", b"\xf4\x90\x80\x80r",
                                 b"lay\xe2\x82", b"\x80ayer"],
                         ids=["ff", "overlong", "surrogate", "above-10ffff", "truncated", "continuation"])
def test_non_utf8_names_are_rejected_by_both_loaders(bad, tmp_path):
    import zlib

    from qdsl.graph.qgraph import load_graph

    blob = bytearray(_small_graph_bytes())
    key = len(b"layer").to_bytes(4, "little") + b"layer"  # the op name, length-prefixed
    at = blob.index(key) + 4
    blob[at:at + 5] = bad
    blob[-4:] = zlib.crc32(bytes(blob[:-4])).to_bytes(4, "little")
    path = tmp_path / "bad-name.qgraph"
    path.write_bytes(bytes(blob))
    with pytest.raises(GraphFormatError, match="not valid UTF-8"):
        load_graph(path)
    with pytest.raises(GraphFormatError, match="op name is not valid UTF-8"):
        rt.CompiledGraph(path.read_bytes())


def test_utf8_names_load_in_both_loaders():
    from qdsl.graph.qgraph import graph_from_bytes

    name = "schicht-ü€𝄞"  # 2-, 3- and 4-byte sequences
    x_t, y_t = Tensor("x", DType.U8, (-1, 2, 3)), Tensor("y", DType.U8, (-1, 6))
    g = IntegerGraph([x_t, y_t], ["x"], ["y"], [Op(OpType.RESHAPE, name, ["x"], ["y"], {"shape": [6]})]).validate()
    blob = graph_to_bytes(g)
    assert graph_from_bytes(blob).ops[0].name == name
    cg = rt.CompiledGraph(blob)
    assert cg.op_names == [name]
    x = np.random.default_rng(4).integers(0, 255, (2, 2, 3)).astype(np.uint8)
    assert np.array_equal(cg.run(x), execute(g, x).outputs[0])

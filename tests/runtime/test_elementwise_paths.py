"""ADD with any parameters the format allows (docs/qgraph.md §4.4 and §4.1: every rescale
kind, POT shifts -31..62, pre_shift 0..31, I8/U8/I32 operands with any zero point) and the
vectorized stream ops (QUANTIZE of float input, REQUANTIZE, CLAMP, DEQUANTIZE) equal the
Python reference executor bit for bit on every kernel path this CPU has.  Sizes straddle
the 8- and 16-lane vector widths so tails run too."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Rescale, Tensor  # noqa: E402

from tests.runtime.test_graph import _check, _graph, _rand, _stage  # noqa: E402

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _any_rescale(rng) -> Rescale:
    """A per-tensor rescale of any kind with parameters anywhere in the legal ranges."""
    kind = int(rng.integers(0, 3))
    if kind == 1:  # POT: s in [-31, 62], edges likely
        s = int(rng.choice([-31, -8, -1, 0, 1, 5, 16, 30, 31, 32, 33, 40, 62, int(rng.integers(-31, 63))]))
        return Rescale(1, (1,), (s,), int(rng.integers(0, 4)))
    m = int(rng.choice([0, 1, 1 << 30, INT32_MAX, int(rng.integers(0, 2**31))]))
    s = int(rng.choice([-31, -5, 0, 3, 17, 31, int(rng.integers(-31, 32))]))
    return Rescale(kind, (m,), (s,), int(rng.integers(0, 4)) if kind == 2 else 0)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), d0=st.sampled_from([DType.I8, DType.U8, DType.I32]),
       d1=st.sampled_from([DType.I8, DType.U8, DType.I32]), out=st.sampled_from([DType.I8, DType.U8]))
def test_add_any_parameters_matches_reference(seed, d0, d1, out):
    rng = np.random.default_rng(seed)
    c = int(rng.integers(1, 4))
    shape = (-1, c, int(rng.integers(1, 6)), int(rng.choice([1, 7, 8, 9, 16, 17, 33])))
    tensors, ops, names, x_dtypes = [], [], [], {}
    for k, d in enumerate((d0, d1)):
        xd = DType.I8 if d is DType.I32 else d
        x = f"x{k}"
        tensors.append(Tensor(x, xd, shape))
        x_dtypes[x] = xd
        if d is DType.I32:  # an I32 operand is a conv's output: a 1x1 conv with a wide stage
            w = rng.integers(-127, 128, (c, c, 1, 1)).astype(np.int8)
            st_ = OutputStage(Rescale(1, (1,) * c, tuple(int(v) for v in rng.integers(-20, 3, c)), int(rng.integers(0, 4))),
                              0, INT32_MIN, INT32_MAX)
            tensors += [Tensor(f"w{k}", DType.I8, w.shape, w), Tensor(f"a{k}", DType.I32, shape)]
            ops.append(Op(OpType.CONV2D, f"conv{k}", [x, f"w{k}"], [f"a{k}"],
                          {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1, "in_zp": 0,
                           "w_zp": [0], "acc_bits": 32, "overflow": 0, **st_.attrs()}))
            names.append(f"a{k}")
        else:
            names.append(x)
    lo_hi = [(INT32_MIN, INT32_MAX) if d is DType.I32 else d.range for d in (d0, d1)]
    zps = [int(rng.choice([0, lo, hi, int(rng.integers(lo, hi + 1))])) for lo, hi in lo_hi]
    rs = [_any_rescale(rng) for _ in range(2)]
    lo, hi = out.range
    ozp = int(rng.integers(lo, hi + 1))
    omin = int(rng.integers(lo, hi + 1))
    stage = OutputStage(_any_rescale(rng), ozp, omin, int(rng.integers(omin, hi + 1)))
    attrs = {"in_zp": zps, "in_kind": [int(r.kind) for r in rs], "in_multiplier": [r.multiplier[0] for r in rs],
             "in_shift": [r.shift[0] for r in rs], "in_rounding": [r.rounding for r in rs],
             "pre_shift": int(rng.choice([0, 0, 1, 20, 23, 24, 31, int(rng.integers(0, 32))])), **stage.attrs()}
    tensors.append(Tensor("y", out, shape))
    ops.append(Op(OpType.ADD, "add", names, ["y"], attrs))
    graph = IntegerGraph(tensors, ["x0", "x1"], ["y"], ops).validate()
    b = int(rng.integers(1, 4))
    _check(graph, *(_rand(rng, x_dtypes[f"x{k}"], (b, *shape[1:])) for k in range(2)))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), rounding=st.integers(0, 3), out=st.sampled_from([DType.I8, DType.U8]))
def test_quantize_matches_reference(seed, rounding, out):
    rng = np.random.default_rng(seed)
    n = int(rng.choice([1, 7, 8, 9, 31, 100, 1000]))
    scale = float(rng.choice([0.5, 0.25, 1.0, 3.0, float(rng.uniform(1e-3, 2.0))]))
    lo, hi = out.range
    graph = _graph(OpType.QUANTIZE, [("x", DType.F32, (-1, n))],
                   {"scale": scale, "zero_point": int(rng.integers(lo, hi + 1)), "qmin": lo, "qmax": hi,
                    "rounding": rounding}, out)
    # ties (k/2 * scale), values just beside them, huge values, inf and NaN
    x = (rng.integers(-600, 600, n) / 2 * scale).astype(np.float32)
    x = np.where(rng.random(n) < 0.3, np.nextafter(x, np.float32(np.inf) * np.sign(rng.random(n) - 0.5)), x)
    x = np.where(rng.random(n) < 0.1, rng.standard_normal(n).astype(np.float32) * 1e30, x).astype(np.float32)
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.49999997, -0.49999997, 2.5, -2.5], np.float32)
    x[: min(n, 8)] = special[: min(n, 8)]
    _check(graph, x.reshape(1, n))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), xdtype=st.sampled_from([DType.I8, DType.U8]), out=st.sampled_from([DType.I8, DType.U8]),
       per_channel=st.booleans())
def test_requantize_clamp_dequantize_match_reference(seed, xdtype, out, per_channel):
    rng = np.random.default_rng(seed)
    shape = (-1, int(rng.integers(1, 5)), int(rng.integers(1, 6)), int(rng.choice([1, 7, 8, 16, 17, 40])))
    x = _rand(rng, xdtype, (int(rng.integers(1, 3)), *shape[1:]))
    lo, hi = out.range
    _check(_graph(OpType.REQUANTIZE, [("x", xdtype, shape)],
                  {"in_zp": int(rng.integers(*xdtype.range)), **_stage(rng, shape[1] if per_channel else 1, lo, hi)},
                  out), x)
    a, b = sorted(int(v) for v in rng.integers(*xdtype.range, 2))
    _check(_graph(OpType.CLAMP, [("x", xdtype, shape)], {"out_min": a, "out_max": b}, xdtype), x)
    _check(_graph(OpType.DEQUANTIZE, [("x", xdtype, shape)], {"scale": float(rng.uniform(1e-3, 1)),
                                                               "zero_point": int(rng.integers(*xdtype.range))},
                  DType.F32), x)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), out=st.sampled_from([DType.I8, DType.U8]), axis=st.sampled_from([1, 2, 3]))
def test_concat_any_rescales_matches_reference(seed, out, axis):
    rng = np.random.default_rng(seed)
    base = [int(rng.integers(1, 4)), int(rng.integers(1, 5)), int(rng.choice([1, 7, 16, 17, 40]))]
    dts = [DType.I8 if rng.random() < 0.5 else DType.U8 for _ in range(int(rng.integers(2, 4)))]
    shapes = []
    for _ in dts:
        s = list(base)
        s[axis - 1] = int(rng.integers(1, 5))
        shapes.append((-1, *s))
    rs = [_any_rescale(rng) for _ in dts]
    lo, hi = out.range
    omin = int(rng.integers(lo, hi + 1))
    attrs = {"axis": axis, "in_zp": [int(rng.integers(*d.range)) for d in dts], "in_kind": [int(r.kind) for r in rs],
             "in_multiplier": [r.multiplier[0] for r in rs], "in_shift": [r.shift[0] for r in rs],
             "in_rounding": [r.rounding for r in rs], "out_zp": int(rng.integers(lo, hi + 1)), "out_min": omin,
             "out_max": int(rng.integers(omin, hi + 1))}
    graph = _graph(OpType.CONCAT, [(f"x{i}", d, s) for i, (d, s) in enumerate(zip(dts, shapes))], attrs, out)
    b = int(rng.integers(1, 3))
    _check(graph, *(_rand(rng, d, (b, *s[1:])) for d, s in zip(dts, shapes)))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), xdtype=st.sampled_from([DType.I8, DType.U8, DType.I32]), rank=st.sampled_from([1, 2]),
       is_max=st.booleans())
def test_pools_any_geometry_match_reference(seed, xdtype, rank, is_max):
    """Max/avg pools (windows clipped at the padding once per op) on I8/U8 inputs and, for
    average pools, I32 inputs from a conv; kernels, strides, dilations and padding up to
    kernel/2, planes of 1..~600 outputs over the thread pool."""
    rng = np.random.default_rng(seed)
    if is_max and xdtype is DType.I32:
        xdtype = DType.I8
    c = int(rng.integers(1, 5))
    spatial = [int(rng.integers(3, 26)) for _ in range(rank)]
    k = [int(rng.integers(1, 4)) for _ in range(rank)]
    attrs = {"kernel": k, "stride": [int(rng.integers(1, 3)) for _ in range(rank)],
             "padding": [int(rng.integers(0, kk // 2 + 1)) for kk in k]}
    if is_max:
        attrs["dilation"] = [int(rng.integers(1, 3)) for _ in range(rank)]
        op_type = OpType.MAXPOOL1D if rank == 1 else OpType.MAXPOOL2D
    else:
        attrs.update(in_zp=0 if xdtype is DType.I32 else int(rng.integers(*xdtype.range)), **_stage(rng, c))
        op_type = OpType.AVGPOOL1D if rank == 1 else OpType.AVGPOOL2D
    shape = (-1, c, *spatial)
    b = int(rng.integers(1, 3))
    if xdtype is not DType.I32:
        try:
            graph = _graph(op_type, [("x", xdtype, shape)], attrs, DType.I8 if not is_max else xdtype)
        except Exception:  # the drawn window does not fit the input
            return
        _check(graph, _rand(rng, xdtype, (b, *shape[1:])))
        return
    from qdsl.graph.validate import infer_output

    xu = (-1, c, *spatial)
    w = rng.integers(-127, 128, (c, c) + (1,) * rank).astype(np.int8)
    conv = Op(OpType.CONV1D if rank == 1 else OpType.CONV2D, "conv", ["x", "w"], ["a"],
              {"stride": [1] * rank, "padding": [0] * rank, "dilation": [1] * rank, "groups": 1, "in_zp": 0,
               "w_zp": [0], "acc_bits": 32, "overflow": 0,
               **OutputStage(Rescale(1, (1,), (int(rng.integers(-12, 1)),), 0), 0, INT32_MIN, INT32_MAX).attrs()})
    pool = Op(op_type, "pool", ["a"], ["y"], attrs)
    tensors = [Tensor("x", DType.U8, xu), Tensor("w", DType.I8, w.shape, w), Tensor("a", DType.I32, xu)]
    try:
        _, yshape = infer_output(1, pool, tensors, Tensor("y", DType.I8, (1,)))
    except Exception:
        return
    graph = IntegerGraph(tensors + [Tensor("y", DType.I8, yshape)], ["x"], ["y"], [conv, pool]).validate()
    _check(graph, _rand(rng, DType.U8, (b, *xu[1:])))


@pytest.mark.parametrize("w", [1, 2, 3, 4, 5, 17])
@pytest.mark.parametrize("sw", [1, 2])
@pytest.mark.parametrize("xdtype", [DType.U8, DType.I8])
def test_maxpool_3wide_windows_clipped_on_both_sides(w, sw, xdtype):
    """MAXPOOL2D with a 3x3 window and padding 1 (ResNet's stem pool; pool.cc's separable
    form with its fixed 3-wide loop) on rows so narrow that windows are clipped on the left,
    on the right, or on both sides at once; values at the dtype's ends."""
    rng = np.random.default_rng(w * 10 + sw)
    shape = (2, 3, 7, w)
    x = _rand(rng, xdtype, shape)
    x[0, 0, 0, 0] = np.iinfo(x.dtype).min
    x[1, 2, -1, -1] = np.iinfo(x.dtype).max
    graph = _graph(OpType.MAXPOOL2D, [("x", xdtype, (-1, *shape[1:]))],
                   {"kernel": [3, 3], "stride": [2, sw], "padding": [1, 1], "dilation": [1, 1]}, xdtype)
    _check(graph, x)

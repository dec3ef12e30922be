"""The C++ RESIZE, CONCAT (any axis, rank 2-4) and LUT_CHANNEL ops equal the reference
executor bit for bit on random graphs (hypothesis: shapes, dtypes, zero points, per-tensor and
per-channel rescales, every kernel path), and the C++ loader rejects malformed ones."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph import execute, graph_to_bytes  # noqa: E402
from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, Rounding, Tensor  # noqa: E402
from qdsl.graph.ops.resize import MAX_FRAC_BITS  # noqa: E402
from qdsl.graph.requant import make_rescale  # noqa: E402
from qdsl.runtime import kernels as K  # noqa: E402

PATHS = [p for p in ("ref", "portable", "avx2", "avxvnni", "avx512", "amx") if p in K.paths()["cpu"]]
_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _agree(g: IntegerGraph, x: np.ndarray) -> None:
    want = execute(g, x).outputs[0]
    cg = rt.CompiledGraph(g)
    for path in PATHS:
        np.testing.assert_array_equal(cg.run(x, path=path), want, err_msg=f"path {path}")


def _values(rng, dtype: DType, shape) -> np.ndarray:
    lo, hi = dtype.range
    if dtype is DType.I32:  # accumulators: mostly moderate, some at the int32 extremes
        v = rng.integers(-(1 << 20), 1 << 20, shape)
        mask = rng.random(shape) < 0.05
        v[mask] = rng.choice([lo, hi], int(mask.sum()))
        return v.astype(np.int32)
    return rng.integers(lo, hi + 1, shape).astype(dtype.numpy)


def _stage(draw, rng, out_dtype: DType, channels: int, scale: float) -> dict:
    per_channel = draw(st.booleans()) and channels > 1
    factors = scale * np.exp(rng.uniform(-1, 1, channels if per_channel else 1))
    rounding = draw(st.sampled_from([Rounding.HALF_AWAY, Rounding.HALF_EVEN, Rounding.FLOOR]))
    pot = draw(st.booleans())
    if pot:
        factors = 2.0 ** np.round(np.log2(factors))
    rs = make_rescale(factors if per_channel else float(factors[0]), rounding, pot, single=True)
    lo, hi = out_dtype.range
    a, b = sorted(rng.integers(lo, hi + 1, 2).tolist())
    return dict(**rs.attrs(), out_zp=int(rng.integers(lo, hi + 1)), out_min=int(a), out_max=int(b))


@st.composite
def resize_cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rank = draw(st.sampled_from([1, 2]))
    x_dtype = draw(st.sampled_from([DType.I8, DType.U8, DType.I32]))
    y_dtype = draw(st.sampled_from([DType.I8, DType.U8]))
    n, c = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    in_sp = [draw(st.integers(1, 9)) for _ in range(rank)]
    out_sp = [draw(st.integers(1, 12)) for _ in range(rank)]
    nearest = draw(st.booleans())
    f = 0 if nearest else draw(st.integers(0, MAX_FRAC_BITS))
    index = [int(i) for L, O in zip(in_sp, out_sp) for i in rng.integers(0, L, O)]
    weight = [0] * sum(out_sp) if nearest else [int(w) for w in rng.integers(0, (1 << f) + 1, sum(out_sp))]
    lo, hi = x_dtype.range
    in_zp = 0 if x_dtype is DType.I32 else int(rng.integers(lo, hi + 1))
    # the stage maps the 2^(F·rank)-weighted sum back to about one output step per input step
    # (an accumulator of a 1x1 conv: up to 255·127·C, a few hundred steps per output step)
    scale = 2.0 ** (-f * rank) * (2.0 ** -9 if x_dtype is DType.I32 else 1.0)
    attrs = dict(size=tuple(out_sp), index=tuple(index), weight=tuple(weight), frac_bits=f, in_zp=in_zp,
                 **_stage(draw, rng, y_dtype, c, scale))
    x = Tensor("x", x_dtype, (-1, c, *in_sp))
    y = Tensor("y", y_dtype, (-1, c, *out_sp))
    tensors, ops = [x, y], [Op(OpType.RESIZE, "up", ["x"], ["y"], attrs)]
    if x_dtype is DType.I32:  # a layer's raw accumulator (graph inputs are F32/I8/U8)
        tensors, ops = _raw_accumulator(rng, x) + tensors, _raw_ops(x) + ops
    g = IntegerGraph(tensors, [tensors[0].name], ["y"], ops).validate()
    return g, _values(rng, tensors[0].dtype, (n, c, *in_sp))


def _raw_accumulator(rng, x: Tensor) -> list[Tensor]:
    """An I8 input and a random 1×1 conv weight whose int32 accumulator is ``x``."""
    c, rank = x.shape[1], len(x.shape) - 2
    w = rng.integers(-127, 128, (c, c) + (1,) * rank).astype(np.int64)
    return [Tensor("x8", DType.I8, x.shape), Tensor("w", DType.I8, w.shape, w)]


def _raw_ops(x: Tensor) -> list[Op]:
    rank = len(x.shape) - 2
    a = dict(stride=(1,) * rank, padding=(0,) * rank, dilation=(1,) * rank, groups=1, acc_bits=32, overflow=0,
             in_zp=0, w_zp=(0,), rq_kind=1, rq_multiplier=(1,), rq_shift=(0,), rq_rounding=0, out_zp=0,
             out_min=-(2**31), out_max=2**31 - 1)
    return [Op(OpType.CONV2D if rank == 2 else OpType.CONV1D, "layer", ["x8", "w"], [x.name], a)]


@_SETTINGS
@given(resize_cases())
def test_resize_cpp_equals_reference(case):
    _agree(*case)


@st.composite
def concat_cases(draw):
    """A CONCAT of 1-3 graph inputs (each its own dtype, zero point and rescale) along ``axis``."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rank = draw(st.integers(2, 4))
    axis = draw(st.integers(1, rank - 1))
    y_dtype = draw(st.sampled_from([DType.I8, DType.U8]))
    base = [draw(st.integers(1, 6)) for _ in range(rank - 1)]
    tensors, rescales, zps = [], [], []
    for i in range(draw(st.integers(1, 3))):
        dt = draw(st.sampled_from([DType.I8, DType.U8]))
        shape = list(base)
        shape.insert(axis - 1, draw(st.integers(1, 20)))
        tensors.append(Tensor(f"x{i}", dt, (-1, *shape)))
        pot = draw(st.booleans())
        factor = float(np.exp(rng.uniform(-1, 1)))
        factor = 2.0 ** round(np.log2(factor)) if pot else factor
        rescales.append(make_rescale(factor, draw(st.sampled_from([Rounding.HALF_AWAY, Rounding.HALF_EVEN])), pot,
                                     single=True))
        zps.append(int(rng.integers(dt.range[0], dt.range[1] + 1)))
    out_shape = list(base)
    out_shape.insert(axis - 1, sum(t.shape[axis] for t in tensors))
    lo, hi = y_dtype.range
    a, b = sorted(rng.integers(lo, hi + 1, 2).tolist())
    attrs = dict(axis=axis, in_zp=tuple(zps), in_kind=tuple(int(r.kind) for r in rescales),
                 in_multiplier=tuple(r.multiplier[0] for r in rescales), in_shift=tuple(r.shift[0] for r in rescales),
                 in_rounding=tuple(int(r.rounding) for r in rescales), out_zp=int(rng.integers(lo, hi + 1)),
                 out_min=int(a), out_max=int(b))
    y = Tensor("y", y_dtype, (-1, *out_shape))
    g = IntegerGraph(tensors + [y], [t.name for t in tensors], ["y"],
                     [Op(OpType.CONCAT, "cat", [t.name for t in tensors], ["y"], attrs)]).validate()
    n = draw(st.integers(1, 3))
    return g, [_values(rng, t.dtype, (n, *t.shape[1:])) for t in tensors]


@_SETTINGS
@given(concat_cases())
def test_concat_any_axis_cpp_equals_reference(case):
    g, xs = case
    want = execute(g, xs).outputs[0]
    cg = rt.CompiledGraph(g)
    for path in PATHS:
        np.testing.assert_array_equal(cg.run(xs, path=path), want, err_msg=f"path {path}")


@_SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.integers(2, 4), st.sampled_from([DType.I8, DType.U8]),
       st.sampled_from([DType.I8, DType.U8]))
def test_lut_channel_cpp_equals_reference(seed, channels, rank, x_dtype, y_dtype):
    rng = np.random.default_rng(seed)
    lo, hi = y_dtype.range
    table = tuple(int(v) for v in rng.integers(lo, hi + 1, 256 * channels))
    shape = (channels,) + tuple(int(d) for d in rng.integers(1, 7, rank - 2))
    g = IntegerGraph([Tensor("x", x_dtype, (-1, *shape)), Tensor("y", y_dtype, (-1, *shape))], ["x"], ["y"],
                     [Op(OpType.LUT_CHANNEL, "act", ["x"], ["y"], {"table": table})]).validate()
    _agree(g, _values(rng, x_dtype, (int(rng.integers(1, 4)), *shape)))


def _unchecked(g: IntegerGraph, monkeypatch) -> bytes:
    monkeypatch.setattr("qdsl.graph.qgraph.validate_graph", lambda graph: None)  # write it unchecked
    return graph_to_bytes(g)


def _resize_attrs(**kw):
    a = dict(size=(4,), index=(0, 0, 1, 1), weight=(0, 0, 0, 0), frac_bits=0, in_zp=0, rq_kind=1, rq_multiplier=(1,),
             rq_shift=(0,), rq_rounding=0, out_zp=0, out_min=-128, out_max=127)
    a.update(kw)
    return a


@pytest.mark.parametrize("attrs,msg", [
    (_resize_attrs(index=(0, 0, 2, 1)), r"index 2 of spatial axis 0 outside \[0, 2\)"),
    (_resize_attrs(weight=(0, 3, 0, 0), frac_bits=1), r"weight 3 outside \[0, 2\^frac_bits\]"),
    (_resize_attrs(frac_bits=12), r"frac_bits 12 outside \[0, 11\]"),
    (_resize_attrs(index=(0, 0, 1)), "'index' and 'weight' need 4 entries"),
])
def test_malformed_resize_is_rejected_by_the_cpp_loader(attrs, msg, monkeypatch):
    g = IntegerGraph([Tensor("x", DType.I8, (-1, 2, 2)), Tensor("y", DType.I8, (-1, 2, 4))], ["x"], ["y"],
                     [Op(OpType.RESIZE, "up", ["x"], ["y"], attrs)])
    with pytest.raises(GraphFormatError, match=msg):
        rt.CompiledGraph(_unchecked(g, monkeypatch))
    with pytest.raises(GraphFormatError):
        g.validate()  # the Python validator refuses it too


def test_malformed_lut_channel_is_rejected_by_the_cpp_loader(monkeypatch):
    g = IntegerGraph([Tensor("x", DType.I8, (-1, 3, 2)), Tensor("y", DType.I8, (-1, 3, 2))], ["x"], ["y"],
                     [Op(OpType.LUT_CHANNEL, "act", ["x"], ["y"], {"table": (0,) * 512})])
    with pytest.raises(GraphFormatError, match="'table' must have 768 entries"):
        rt.CompiledGraph(_unchecked(g, monkeypatch))


def test_an_unassigned_opcode_is_refused_by_both_loaders():
    # an opcode below the largest that no op holds (one another branch reserved) has an empty
    # row in the generated C++ tables: the loaders refuse it like any unknown code
    from qdsl.graph.qgraph import graph_from_bytes

    gaps = [i for i in range(1, max(OpType) + 1) if i not in OpType._value2member_map_]
    if not gaps:
        pytest.skip("no unassigned opcode below the largest")
    x, y = Tensor("x", DType.I8, (-1, 4)), Tensor("y", DType.I8, (-1, 4))
    g = IntegerGraph([x, y], ["x"], ["y"], [Op(OpType.CLAMP, "layer", ["x"], ["y"], {"out_min": -3, "out_max": 5})])
    blob = bytearray(graph_to_bytes(g.validate()))
    at = blob.index(struct.pack("<HHI", int(OpType.CLAMP), 0, 5) + b"layer")
    blob[at:at + 2] = struct.pack("<H", gaps[0])
    blob[-4:] = struct.pack("<I", zlib.crc32(bytes(blob[:-4])) & 0xFFFFFFFF)
    with pytest.raises(GraphFormatError, match="op code|opcode"):
        graph_from_bytes(bytes(blob))
    with pytest.raises(GraphFormatError, match="unknown opcode"):
        rt.CompiledGraph(bytes(blob))


@_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), rank=st.integers(2, 4), parts=st.integers(1, 3))
def test_concat_of_signs_cpp_equals_reference(seed, rank, parts):
    # BIN inputs into a BIN output (identity rescales, clamp [-1, 1]): a binary layer reading a
    # torch.cat of binary results (the C++ op refused BIN before)
    rng = np.random.default_rng(seed)
    axis = int(rng.integers(1, rank))
    base = [int(v) for v in rng.integers(1, 6, rank - 1)]
    ins, signs, ops = [], [], []
    for i in range(parts):  # a graph input is never BIN: BINARIZE int8 inputs first
        shape = list(base)
        shape.insert(axis - 1, int(rng.integers(1, 9)))
        ins.append(Tensor(f"x{i}", DType.I8, (-1, *shape)))
        signs.append(Tensor(f"b{i}", DType.BIN, (-1, *shape)))
        ops.append(Op(OpType.BINARIZE, f"bin{i}", [f"x{i}"], [f"b{i}"], {"zero_point": 0}))
    out_shape = list(base)
    out_shape.insert(axis - 1, sum(t.shape[axis] for t in signs))
    attrs = dict(axis=axis, in_zp=(0,) * parts, in_kind=(1,) * parts, in_multiplier=(1,) * parts,
                 in_shift=(0,) * parts, in_rounding=(0,) * parts, out_zp=0, out_min=-1, out_max=1)
    y = Tensor("y", DType.BIN, (-1, *out_shape))
    ops.append(Op(OpType.CONCAT, "cat", [t.name for t in signs], ["y"], attrs))
    g = IntegerGraph(ins + signs + [y], [t.name for t in ins], ["y"], ops).validate()
    n = int(rng.integers(1, 3))
    xs = [rng.integers(-128, 128, size=(n, *t.shape[1:])).astype(np.int8) for t in ins]
    want = execute(g, xs).outputs[0]
    np.testing.assert_array_equal(want, np.concatenate([np.where(x < 0, -1, 1) for x in xs], axis=axis))
    cg = rt.CompiledGraph(g)
    for path in PATHS:
        np.testing.assert_array_equal(cg.run(xs, path=path), want, err_msg=f"path {path}")


@pytest.mark.parametrize("change", [{"in_shift": (0, 1)}, {"in_zp": (0, 1)}, {"out_min": 0}])
def test_a_bin_concat_that_moves_a_sign_is_refused(change, monkeypatch):
    # Python validation and the C++ Prepare (a graph loaded without it) refuse a BIN CONCAT
    # whose rescales, zero points or clamp could turn ±1 into something else
    ins = [Tensor(f"x{i}", DType.I8, (-1, 2, 3)) for i in range(2)]
    signs = [Tensor(f"b{i}", DType.BIN, (-1, 2, 3)) for i in range(2)]
    ops = [Op(OpType.BINARIZE, f"bin{i}", [f"x{i}"], [f"b{i}"], {"zero_point": 0}) for i in range(2)]
    attrs = dict(axis=1, in_zp=(0, 0), in_kind=(1, 1), in_multiplier=(1, 1), in_shift=(0, 0), in_rounding=(0, 0),
                 out_zp=0, out_min=-1, out_max=1)
    y = Tensor("y", DType.BIN, (-1, 4, 3))
    good = IntegerGraph(ins + signs + [y], ["x0", "x1"], ["y"], ops + [Op(OpType.CONCAT, "cat", ["b0", "b1"], ["y"], attrs)])
    rt.CompiledGraph(good.validate())
    bad = IntegerGraph(ins + signs + [y], ["x0", "x1"], ["y"],
                       ops + [Op(OpType.CONCAT, "cat", ["b0", "b1"], ["y"], {**attrs, **change})])
    with pytest.raises(GraphFormatError, match="BIN concat"):
        bad.validate()
    with pytest.raises(GraphFormatError, match="BIN CONCAT"):
        rt.CompiledGraph(_unchecked(bad, monkeypatch))

"""LSTM, GRU, RNN, LSTM_DYNAMIC and SELECT graph ops (docs/qgraph.md §4.4): the C++ runtime equals the
reference executor bit for bit on random weights, factors, zero points, states (rank 2 and 3,
both directions, an I32 cell; dynamic: one or two input parts, biases, signed/unsigned
grids), the reference's fixed-point gates follow the float formulas closely, and its
binary32 exp is within 5e-7 of exp."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt
from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, Tensor
from qdsl.graph.ops.dynamic import f32_bits
from qdsl.graph.ops.recurrent import ONE, factor, rnd, sigmoid_table
from qdsl.graph.ops.recurrent_dynamic import exp_f32
from qdsl.graph.reference import execute

from tests.runtime.test_graph import _check

needs_cpp = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")


def _graph(rng, is_lstm: bool, rank: int, f: int, hid: int, steps: int, xdt: DType, hdt: DType, cdt: DType,
           states: int, reverse: bool, validate: bool = True, rnn_relu: int | None = None) -> IntegerGraph:
    gates = 4 if is_lstm else (1 if rnn_relu is not None else 3)
    rows = gates * hid
    xshape = (-1, steps, f) if rank == 3 else (-1, f)
    yshape = xshape[:-1] + (hid,)
    xlo, xhi = xdt.range
    hlo, hhi = hdt.range
    s_x, s_h = float(rng.uniform(0.005, 0.05)), float(rng.uniform(0.004, 0.02))
    s_wih, s_whh = rng.uniform(0.001, 0.05, rows), rng.uniform(0.001, 0.05, rows)
    ih = [factor(s_x * s * 2**20) for s in s_wih]
    hh = [factor(s_h * s * 2**20) for s in s_whh]
    a = dict(reverse=int(reverse), x_zp=int(rng.integers(xlo, xhi + 1)), h_zp=int(rng.integers(hlo // 2, hhi // 2 + 1)),
             h_qmin=hlo + int(rng.integers(0, 2)), h_qmax=hhi, ih_mult=tuple(m for m, _ in ih),
             ih_shift=tuple(s for _, s in ih), hh_mult=tuple(m for m, _ in hh), hh_shift=tuple(s for _, s in hh),
             sigmoid=sigmoid_table())
    tensors = [Tensor("x", xdt, xshape),
               Tensor("w_ih", DType.I8, (rows, f), rng.integers(-127, 128, (rows, f))),
               Tensor("w_hh", DType.I8, (rows, hid), rng.integers(-127, 128, (rows, hid))),
               Tensor("b_ih", DType.I32, (rows,), rng.integers(-5000, 5000, rows)),
               Tensor("b_hh", DType.I32, (rows,), rng.integers(-5000, 5000, rows)),
               Tensor("y", hdt, yshape), Tensor("h_n", hdt, (-1, hid))]
    inputs = ["x"] + [n for n in ("h0", "c0")[:states]]
    outs = ["y", "h_n"]
    if is_lstm:
        clo, chi = (-32767, 32767) if cdt is DType.I32 else cdt.range
        s_c = float(rng.uniform(1e-4, 1e-3)) if cdt is DType.I32 else float(rng.uniform(0.01, 0.05))
        a["h_mult"], a["h_shift"] = factor(2.0**-24 / s_h)
        a["c_mult"], a["c_shift"] = factor(1 / s_c)
        a["ct_mult"], a["ct_shift"] = factor(s_c * 2**20)
        a.update(c_zp=0 if cdt is DType.I32 else int(rng.integers(clo // 2, chi // 2 + 1)), c_qmin=clo, c_qmax=chi)
        tensors.append(Tensor("c_n", cdt, (-1, hid)))
        outs.append("c_n")
    elif rnn_relu is not None:
        a["h_mult"], a["h_shift"] = factor((2.0**-20 if rnn_relu else 2.0**-24) / s_h)
        a["relu"] = rnn_relu
    else:
        a["h_mult"], a["h_shift"] = factor(1 / s_h)
    if states:
        tensors.append(Tensor("h0", hdt, (-1, hid)))
    if states > 1:
        tensors.append(Tensor("c0", cdt, (-1, hid)))
    kind = OpType.LSTM if is_lstm else (OpType.RNN if rnn_relu is not None else OpType.GRU)
    ops = [Op(kind, "rnn", ["x", "w_ih", "w_hh", "b_ih", "b_hh"] + inputs[1:],
              outs, a)]
    g = IntegerGraph(tensors, inputs, outs, ops)
    return g.validate() if validate else g


@needs_cpp
@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31), is_lstm=st.booleans(), rank=st.sampled_from([2, 3]),
       xdt=st.sampled_from([DType.I8, DType.U8]), hdt=st.sampled_from([DType.I8, DType.U8]),
       cdt=st.sampled_from([DType.I8, DType.U8, DType.I32]), states=st.integers(0, 2), reverse=st.booleans())
def test_cpp_matches_reference(seed, is_lstm, rank, xdt, hdt, cdt, states, reverse):
    rng = np.random.default_rng(seed)
    states = min(states, 2 if is_lstm else 1)
    if is_lstm and states > 1 and cdt is DType.I32:
        cdt = DType.I8  # an I32 initial cell is no graph input (the graph's activations are 8-bit)
    # sizes across the optimized paths' 16-column panels and 4-deep K blocks (their GEMMs)
    f, hid, steps = int(rng.choice([1, 3, 8, 17, 33])), int(rng.choice([1, 4, 9, 17])), int(rng.integers(1, 6))
    g = _graph(rng, is_lstm, rank, f, hid, steps, xdt, hdt, cdt, states, reverse)
    n = int(rng.integers(1, 6))
    xs = [rng.integers(*xdt.range, size=(n,) + g.tensor("x").shape[1:], endpoint=True).astype(xdt.numpy)]
    if states:
        xs.append(rng.integers(*hdt.range, size=(n, hid), endpoint=True).astype(hdt.numpy))
    if states > 1:
        xs.append(rng.integers(*cdt.range, size=(n, hid), endpoint=True).astype(cdt.numpy))
    _check(g, *xs)


@needs_cpp
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), relu=st.integers(0, 1), rank=st.sampled_from([2, 3]),
       xdt=st.sampled_from([DType.I8, DType.U8]), hdt=st.sampled_from([DType.I8, DType.U8]), states=st.integers(0, 1),
       reverse=st.booleans())
def test_rnn_cpp_matches_reference(seed, relu, rank, xdt, hdt, states, reverse):
    """RNN (39), tanh and relu: C++ == reference on every path."""
    rng = np.random.default_rng(seed)
    f, hid, steps = int(rng.choice([1, 3, 17, 33])), int(rng.choice([1, 4, 17, 40])), int(rng.integers(1, 6))
    g = _graph(rng, False, rank, f, hid, steps, xdt, hdt, DType.I8, states, reverse, rnn_relu=relu)
    n = int(rng.integers(1, 6))
    xs = [rng.integers(*xdt.range, size=(n,) + g.tensor("x").shape[1:], endpoint=True).astype(xdt.numpy)]
    if states:
        xs.append(rng.integers(*hdt.range, size=(n, hid), endpoint=True).astype(hdt.numpy))
    _check(g, *xs)


def test_fixed_point_gates_follow_the_float_formulas():
    """One LSTM step from zero state: h' within 1 code of the float formula on the same integers."""
    rng = np.random.default_rng(3)
    g = _graph(rng, True, 2, 8, 16, 1, DType.U8, DType.I8, DType.I32, 0, False)
    a = g.ops[0].attrs
    x = rng.integers(0, 256, (64, 8))
    y = execute(g, [x.astype(np.uint8)]).outputs[0].astype(np.int64)
    t = {n: g.tensor(n).data.astype(np.float64) for n in ("w_ih", "w_hh", "b_ih", "b_hh")}
    f_ih = np.array([m * 2.0**-s for m, s in zip(a["ih_mult"], a["ih_shift"])]) / 2**20
    f_hh = np.array([m * 2.0**-s for m, s in zip(a["hh_mult"], a["hh_shift"])]) / 2**20
    pre = ((x - a["x_zp"]) @ t["w_ih"].T + t["b_ih"]) * f_ih + t["b_hh"] * f_hh
    i, f_, gg, o = np.split(pre, 4, axis=1)
    sg = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    s_c = 1 / (a["c_mult"] * 2.0**-a["c_shift"])
    c = np.clip(np.rint(sg(i) * np.tanh(gg) / s_c), a["c_qmin"], a["c_qmax"])
    s_h = 2.0**-24 / (a["h_mult"] * 2.0**-a["h_shift"])
    h = np.clip(np.rint(sg(o) * np.tanh(c * s_c) / s_h) + a["h_zp"], a["h_qmin"], a["h_qmax"])
    assert np.abs(y - h).max() <= 1 and np.mean(y == h) >= 0.99


def test_helpers():
    assert factor(1.0) == (1 << 30, 30) and factor(3.0) == (3 << 29, 29)
    v = np.array([5, 6, 7, -5, -6, -7, 12], dtype=np.int64)
    assert rnd(v, 2).tolist() == [1, 2, 2, -1, -2, -2, 3]  # 1.25, 1.5, 1.75, ..., 3 (half to even)
    sig = sigmoid_table()
    assert sig[0] == 2 and sig[2048] == ONE // 2 and sig[-1] == ONE - 2
    with pytest.raises(ValueError):
        factor(2.0**31)


def _with(g: IntegerGraph, **attrs) -> IntegerGraph:
    op = g.ops[0]
    return IntegerGraph(g.tensors, g.inputs, g.outputs, [Op(op.type, op.name, op.inputs, op.outputs,
                                                            {**op.attrs, **attrs})])


def test_malformed_graphs_are_refused_with_the_op_named():
    rng = np.random.default_rng(0)
    g = _graph(rng, True, 3, 4, 4, 2, DType.U8, DType.I8, DType.I8, 0, False, validate=False)
    with pytest.raises(GraphFormatError, match="LSTM 'rnn'.*sigmoid"):
        _with(g, sigmoid=(0,) * 10).validate()
    g = _graph(rng, False, 3, 4, 4, 2, DType.U8, DType.I8, DType.I8, 0, False, validate=False)
    with pytest.raises(GraphFormatError, match="GRU 'rnn'.*hh_shift"):
        _with(g, hh_shift=(0,) * 12).validate()


# ---------------------------------------------------------------- LSTM_DYNAMIC
def _dyn_graph(rng, f: int, f2: int, hid: int, steps: int, reverse: bool, bias: bool, signed_in: bool,
               symmetric_h: bool, states: int = 0, gru: bool = False) -> IntegerGraph:
    rows = (3 if gru else 4) * hid
    q = lambda p, signed, sym: {f"{p}_qmin": -128 if signed else 0, f"{p}_qmax": 127 if signed else 255,  # noqa: E731
                                f"{p}_symmetric": int(sym), f"{p}_rounding": 1}
    a = dict(reverse=int(reverse), **q("in", signed_in, signed_in), **q("h", symmetric_h, symmetric_h),
             w_ih_scale=f32_bits(rng.uniform(1e-3, 2e-2, rows)), w_hh_scale=f32_bits(rng.uniform(1e-3, 2e-2, rows)),
             b_ih=f32_bits(rng.standard_normal(rows)) if bias else (),
             b_hh=f32_bits(rng.standard_normal(rows)) if bias else ())
    tensors = [Tensor("x", DType.F32, (-1, steps, f)),
               Tensor("w_ih", DType.I8, (rows, f + f2), rng.integers(-127, 128, (rows, f + f2))),
               Tensor("w_hh", DType.I8, (rows, hid), rng.integers(-127, 128, (rows, hid))),
               Tensor("y", DType.F32, (-1, steps, hid)), Tensor("h_n", DType.F32, (-1, hid)),
               Tensor("c_n", DType.F32, (-1, hid))]
    inputs = ["x"]
    if f2:
        tensors.append(Tensor("x2", DType.F32, (-1, steps, f2)))
        inputs.append("x2")
    for name in ("h0", "c0")[:states]:  # F32 initial states after the input parts
        tensors.append(Tensor(name, DType.F32, (-1, hid)))
        inputs.append(name)
    outs = ["y", "h_n"] if gru else ["y", "h_n", "c_n"]
    if gru:
        tensors = [t for t in tensors if t.name != "c_n"]
    op = Op(OpType.GRU_DYNAMIC if gru else OpType.LSTM_DYNAMIC, "rnn", ["x", "w_ih", "w_hh"] + inputs[1:], outs, a)
    return IntegerGraph(tensors, inputs, outs, [op]).validate()


@needs_cpp
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), two_parts=st.booleans(), reverse=st.booleans(), bias=st.booleans(),
       signed_in=st.booleans(), symmetric_h=st.booleans(), states=st.integers(0, 2), gru=st.booleans())
def test_dynamic_cpp_matches_reference(seed, two_parts, reverse, bias, signed_in, symmetric_h, states, gru):
    """LSTM_DYNAMIC and GRU_DYNAMIC (40): C++ == reference on every path."""
    rng = np.random.default_rng(seed)
    states = min(states, 1 if gru else 2)
    f, hid, steps = int(rng.choice([1, 3, 8, 33])), int(rng.choice([1, 4, 9, 17])), int(rng.integers(1, 6))
    f2 = int(rng.choice([2, 5])) if two_parts else 0
    g = _dyn_graph(rng, f, f2, hid, steps, reverse, bias, signed_in, symmetric_h, states, gru)
    n = int(rng.integers(1, 5))
    xs = [(rng.standard_normal((n, steps, f)) * rng.choice([0.1, 1, 10])).astype(np.float32)]
    if f2:
        xs.append(rng.standard_normal((n, steps, f2)).astype(np.float32))
    xs += [rng.standard_normal((n, hid)).astype(np.float32) for _ in range(states)]
    _check(g, *xs)


def test_exp_f32_is_close_to_exp():
    x = np.linspace(-87, 87, 200001, dtype=np.float32)
    rel = np.abs(exp_f32(x).astype(np.float64) / np.exp(x.astype(np.float64)) - 1)
    assert rel.max() < 5e-7


def test_select_takes_one_index_along_an_axis():
    """SELECT (38): a copy of x.take(index, axis) in every dtype; C++ == reference.  Along a
    static axis 0 (a state input's slot) the result's first dim is the run's batch."""
    rng = np.random.default_rng(0)
    for dt, axis, shape in ((DType.F32, 0, (3, 3, 5)), (DType.I8, 1, (-1, 6, 5)), (DType.U8, 2, (-1, 2, 7))):
        idx = shape[axis] - 1
        out_shape = shape[:axis] + shape[axis + 1:]
        g = IntegerGraph([Tensor("x", dt, shape), Tensor("y", dt, out_shape)], ["x"], ["y"],
                         [Op(OpType.SELECT, "sel", ["x"], ["y"], dict(axis=axis, index=idx))]).validate()
        real = tuple(3 if d == -1 else d for d in shape)
        x = (rng.standard_normal(real).astype(np.float32) if dt is DType.F32
             else rng.integers(*dt.range, size=real, endpoint=True).astype(dt.numpy))
        np.testing.assert_array_equal(execute(g, x).outputs[0], np.take(x, idx, axis=axis))
        if rt.available():
            _check(g, x)
    with pytest.raises(GraphFormatError, match="static size"):
        IntegerGraph([Tensor("x", DType.I8, (-1, 4)), Tensor("y", DType.I8, (4,))], ["x"], ["y"],
                     [Op(OpType.SELECT, "sel", ["x"], ["y"], dict(axis=0, index=0))]).validate()

"""LSTM, GRU and RNN: one recurrent layer and direction, looping over time inside the op.

Inputs ``x`` (I8/U8 codes, ``[N, T, F]``, or ``[N, F]``: one step, a cell), the constant
int8 weights ``w_ih [G·H, F]`` and ``w_hh [G·H, H]`` (symmetric, torch's gate order: LSTM
i, f, g, o; GRU r, z, n), the int32 biases ``b_ih``, ``b_hh [G·H]`` (at the scales
``s_x·s_wih[row]`` and ``s_h·s_whh[row]``), and optionally the initial state's codes
``h0 [N, H]`` (and ``c0 [N, H]`` for an LSTM); without them the state starts at the
zero points (real 0).  Outputs: ``y`` (the hidden state of every step, ``[N, T, H]``;
``[N, H]`` for a cell), ``h_n [N, H]`` and, for an LSTM, ``c_n [N, H]``.

Everything is integer (int64 here and in C++), with one rounding primitive,
``rnd(v, s) = round_half_even(v / 2^s)``, and factor pairs ``(m, s)`` (``m·2^-s``,
``0 <= m < 2^31``, ``1 <= s <= 62``) the exporter computes from the scales.  Gate values
are Q24 (``ONE = 2^24``), pre-activations Q20:

* ``A_ih = (x - x_zp)·W_ihᵀ + b_ih``, ``A_hh = (h - h_zp)·W_hhᵀ + b_hh`` (exact);
  ``Pih = clamp(rnd(A_ih·m_ih[r], s_ih[r]), ±2^36)`` (``m·2^-s ≈ s_x·s_wih[r]·2^20``),
  ``Phh`` alike (``≈ s_h·s_whh[r]·2^20``);
* ``σ(P)``: the 4098-entry table ``sigmoid`` (``rint(2^24·σ(-16 + k/128))``), interpolated
  quadratically: ``u = clamp(P, -2^24, 2^24 - 1) + 2^24``, ``i = u >> 13``, ``f = u & 8191``,
  ``T[i] + ((Δ1·f·2^14 + Δ2·f·(f - 8192) + 2^26) >> 27)`` with ``Δ1 = T[i+1] - T[i]``,
  ``Δ2 = T[i+2] - 2·T[i+1] + T[i]``; ``tanh(P) = 2·σ(2·clamp(P, ±2^36)) - ONE``;
* LSTM (``P = Pih + Phh``, gates i, f, g, o): ``U = σf·(c - c_zp) + rnd(rnd(σi·tanh(g), 24)·c_m, c_s)``
  (units of 2^-24 of a cell code; ``c_m·2^-c_s ≈ 1/s_c``),
  ``c' = clamp(rnd(U, 24) + c_zp, c_qmin, c_qmax)``; ``tc = tanh(rnd((c' - c_zp)·ct_m, ct_s))``
  (``≈ s_c·2^20``: the cell value in Q20); ``h' = clamp(rnd(rnd(σo·tc, 24)·h_m, h_s) + h_zp,
  h_qmin, h_qmax)`` (``≈ 2^-24/s_h``);
* GRU: ``r = σ(Pih_r + Phh_r)``, ``z = σ(Pih_z + Phh_z)``, ``n = tanh(Pih_n + rnd(r·Phh_n, 24))``,
  ``U = rnd(rnd((ONE - z)·n, 24)·h_m, h_s) + z·(h - h_zp)`` (``≈ 1/s_h``),
  ``h' = clamp(rnd(U, 24) + h_zp, h_qmin, h_qmax)``.

* RNN (``relu`` 0: tanh, 1: relu; ``P = Pih + Phh``): tanh: ``h' = clamp(rnd(tanh(P)·h_m, h_s) + h_zp,
  h_qmin, h_qmax)`` (``≈ 2^-24/s_h``); relu: ``v = clamp(P, 0, 2^31)``,
  ``h' = clamp(rnd(v·h_m, h_s) + h_zp, h_qmin, h_qmax)`` (``≈ 2^-20/s_h``).

This is the fake-quant model's step (qdsl/patch/recurrent_math.py) with its float gates
replaced by fixed point; docs/qgraph.md §4.4 has the measured agreement.
"""

from __future__ import annotations

import math

import numpy as np

from qdsl.graph.ops import OpDef
from qdsl.graph.schema import INT8_DTYPES, AttrType, DType, OpSchema

__all__ = ["OPS", "lstm", "gru", "rnn", "factor", "sigmoid_table", "TABLE_SIZE", "MAX_FEATURES", "BIAS_LIMIT"]

TABLE_SIZE = 4098
"""Entries of the sigmoid table: -16 + k/128 for k = 0..4097 (one past +16 for the second difference)."""
ONE = 1 << 24
"""1.0 in the gates' Q24."""
MAX_FEATURES = 16384
"""Largest F or H: |code - zp| <= 255 times |w| <= 128, K times, plus a bias below 2^30, fits int32."""
BIAS_LIMIT = 1 << 30
PRE_LIMIT = 1 << 36
"""Pre-activation terms are clamped to ±2^36 (Q20: ±65536; the table saturates at ±16), so
the products that follow (``r·Phh_n``) stay inside int64."""
RELU_LIMIT = 1 << 31
"""RNN (relu): the Q20 pre-activation is clamped to [0, 2^31] (2048.0) before its factor, so
``v·h_m`` stays inside int64; a hidden grid reaching 2048 would saturate there."""
_SIGNED_WEIGHTS = (DType.I8,)


def factor(real: float) -> tuple[int, int]:
    """``(m, s)`` with ``m·2^-s`` nearest ``real`` (> 0, < 2^30), ``m < 2^31``, ``1 <= s <= 62``."""
    if not (math.isfinite(real) and 0 < real < 2.0**30):
        raise ValueError(f"factor {real!r} outside (0, 2^30)")
    e = math.frexp(real)[1]  # real = q·2^e, q in [0.5, 1)
    s = min(31 - e, 62)
    m = int(np.rint(math.ldexp(real, s)))  # exact scaling, one rounding
    if m >= 1 << 31:
        m, s = m >> 1, s - 1
    return m, s


def sigmoid_table() -> tuple[int, ...]:
    """The ``sigmoid`` attribute (see the module doc)."""
    x = -16.0 + np.arange(TABLE_SIZE, dtype=np.float64) / 128.0
    return tuple(int(v) for v in np.rint(ONE / (1.0 + np.exp(-x))).astype(np.int64))


def rnd(v: np.ndarray, s) -> np.ndarray:
    """``round_half_even(v / 2^s)`` on int64 (``s >= 1``, scalar or broadcast array)."""
    s = np.asarray(s, dtype=np.int64)
    q = v >> s
    r = v - (q << s)
    half = np.int64(1) << (s - 1)
    return q + ((r > half) | ((r == half) & ((q & 1) == 1)))


def _sig(table: np.ndarray, p: np.ndarray) -> np.ndarray:
    # Newton's quadratic through T[i], T[i+1], T[i+2] at t = f / 2^13:
    # T[i] + t·Δ1 + t(t - 1)/2·Δ2, all over 2^27 and rounded once (half up)
    u = np.clip(p, -(1 << 24), (1 << 24) - 1) + (1 << 24)
    i, f = u >> 13, u & 8191
    t0, t1, t2 = table[i], table[i + 1], table[i + 2]
    num = (t1 - t0) * f * (1 << 14) + (t2 - 2 * t1 + t0) * f * (f - 8192)
    return t0 + ((num + (1 << 26)) >> 27)


def _tanh(table: np.ndarray, p: np.ndarray) -> np.ndarray:
    return 2 * _sig(table, np.clip(p, -PRE_LIMIT, PRE_LIMIT) * 2) - ONE


def _pre(acc: np.ndarray, m, s) -> np.ndarray:
    return np.clip(rnd(acc * np.asarray(m, dtype=np.int64), s), -PRE_LIMIT, PRE_LIMIT)


def _setup(args, a, n_state: int):
    x = np.asarray(args[0], dtype=np.int64)
    cell = x.ndim == 2
    seq = x[:, None, :] if cell else x
    w_ih, w_hh = (np.asarray(t.data, dtype=np.int64) for t in args[1:3])
    b_ih, b_hh = (np.asarray(t.data, dtype=np.int64).reshape(-1) for t in args[3:5])
    states = [np.asarray(s, dtype=np.int64) for s in args[5:5 + n_state]]
    p_ih = _pre((seq - a["x_zp"]) @ w_ih.T + b_ih, a["ih_mult"], a["ih_shift"])  # [N, T, G·H]
    order = range(seq.shape[1] - 1, -1, -1) if a["reverse"] else range(seq.shape[1])
    return cell, seq, w_hh, b_hh, states, p_ih, order, np.asarray(a["sigmoid"], dtype=np.int64)


def _hidden(u: np.ndarray, a, s) -> np.ndarray:
    return np.clip(rnd(u, s) + a["h_zp"], a["h_qmin"], a["h_qmax"])


def lstm(args, a) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cell, seq, w_hh, b_hh, states, p_ih, order, sig = _setup(args, a, 2)
    n, hid = seq.shape[0], w_hh.shape[1]
    h = states[0] if states else np.full((n, hid), a["h_zp"], dtype=np.int64)
    c = states[1] if len(states) > 1 else np.full((n, hid), a["c_zp"], dtype=np.int64)
    ys = np.zeros((n, seq.shape[1], hid), dtype=np.int64)
    for t in order:
        p = p_ih[:, t] + _pre((h - a["h_zp"]) @ w_hh.T + b_hh, a["hh_mult"], a["hh_shift"])
        gi, gf, gg, go = (p[:, k * hid:(k + 1) * hid] for k in range(4))
        si, sf, tg, so = _sig(sig, gi), _sig(sig, gf), _tanh(sig, gg), _sig(sig, go)
        u = sf * (c - a["c_zp"]) + rnd(rnd(si * tg, 24) * a["c_mult"], a["c_shift"])
        c = np.clip(rnd(u, 24) + a["c_zp"], a["c_qmin"], a["c_qmax"])
        tc = _tanh(sig, rnd((c - a["c_zp"]) * a["ct_mult"], a["ct_shift"]))
        h = _hidden(rnd(so * tc, 24) * a["h_mult"], a, a["h_shift"])
        ys[:, t] = h
    return (ys[:, 0] if cell else ys), h, c


def gru(args, a) -> tuple[np.ndarray, np.ndarray]:
    cell, seq, w_hh, b_hh, states, p_ih, order, sig = _setup(args, a, 1)
    n, hid = seq.shape[0], w_hh.shape[1]
    h = states[0] if states else np.full((n, hid), a["h_zp"], dtype=np.int64)
    ys = np.zeros((n, seq.shape[1], hid), dtype=np.int64)
    for t in order:
        p_hh = _pre((h - a["h_zp"]) @ w_hh.T + b_hh, a["hh_mult"], a["hh_shift"])
        pi = p_ih[:, t]
        r = _sig(sig, pi[:, :hid] + p_hh[:, :hid])
        z = _sig(sig, pi[:, hid:2 * hid] + p_hh[:, hid:2 * hid])
        nn_ = _tanh(sig, pi[:, 2 * hid:] + rnd(r * p_hh[:, 2 * hid:], 24))
        u = rnd(rnd((ONE - z) * nn_, 24) * a["h_mult"], a["h_shift"]) + z * (h - a["h_zp"])
        h = _hidden(u, a, 24)
        ys[:, t] = h
    return (ys[:, 0] if cell else ys), h


def rnn(args, a) -> tuple[np.ndarray, np.ndarray]:
    cell, seq, w_hh, b_hh, states, p_ih, order, sig = _setup(args, a, 1)
    n, hid = seq.shape[0], w_hh.shape[1]
    h = states[0] if states else np.full((n, hid), a["h_zp"], dtype=np.int64)
    ys = np.zeros((n, seq.shape[1], hid), dtype=np.int64)
    for t in order:
        p = p_ih[:, t] + _pre((h - a["h_zp"]) @ w_hh.T + b_hh, a["hh_mult"], a["hh_shift"])
        v = np.clip(p, 0, RELU_LIMIT) if a["relu"] else _tanh(sig, p)
        h = _hidden(v * a["h_mult"], a, a["h_shift"])
        ys[:, t] = h
    return (ys[:, 0] if cell else ys), h


# ---------------------------------------------------------------- validation
def _factor_attr(c, name: str, n: int) -> None:
    c.ints(f"{name}_mult", n, 0, (1 << 31) - 1)
    c.ints(f"{name}_shift", n, 1, 62)


def _factor_int(c, name: str) -> None:
    c.int(f"{name}_mult", 0, (1 << 31) - 1)
    c.int(f"{name}_shift", 1, 62)


def _infer(gates: int, lstm_: bool):
    def infer(c, op, ins, out):
        x, w_ih, w_hh, b_ih, b_hh = ins[:5]
        c.dt(x, INT8_DTYPES, "input")
        c.need(len(x.shape) in (2, 3), f"input {x.name!r} must be [N, T, F] or [N, F], has shape {x.shape}")
        c.int("x_zp", *x.dtype.range)
        for w, what in ((w_ih, "w_ih"), (w_hh, "w_hh")):
            c.const(w, what)
            c.dt(w, _SIGNED_WEIGHTS, what)
            c.need(len(w.shape) == 2, f"{what} {w.name!r} must have rank 2, has shape {w.shape}")
        rows, hid = w_hh.shape[0], w_hh.shape[1]
        c.need(rows == gates * hid, f"w_hh {w_hh.name!r} must be [{gates}·H, H], has shape {w_hh.shape}")
        c.need(tuple(w_ih.shape) == (rows, x.shape[-1]),
               f"w_ih {w_ih.name!r} must be [{rows}, {x.shape[-1]}], has shape {w_ih.shape}")
        c.need(max(x.shape[-1], hid) <= MAX_FEATURES, f"F and H must be <= {MAX_FEATURES}")
        for b, what in ((b_ih, "b_ih"), (b_hh, "b_hh")):
            c.const(b, what)
            c.dt(b, (DType.I32,), what)
            c.need(tuple(b.shape) == (rows,), f"{what} {b.name!r} must have shape ({rows},), has {b.shape}")
            c.need(b.data is None or bool(np.all(np.abs(np.asarray(b.data, dtype=np.int64)) <= BIAS_LIMIT)),
                   f"{what} values must be within ±2^30")
        c.int("reverse", 0, 1)
        c.dt(out, INT8_DTYPES, "output")
        c.int("h_zp", *out.dtype.range)
        c.need(c.int("h_qmin", *out.dtype.range) <= c.int("h_qmax", *out.dtype.range), "h_qmin > h_qmax")
        for name in ("ih", "hh"):
            _factor_attr(c, name, rows)
        _factor_int(c, "h")
        c.ints("sigmoid", TABLE_SIZE, 0, ONE)
        if lstm_:
            _factor_int(c, "c")
            _factor_int(c, "ct")
            c.int("c_zp", -(1 << 16), 1 << 16)
            c.need(c.int("c_qmin", -(1 << 16), 1 << 16) <= c.int("c_qmax", -(1 << 16), 1 << 16), "c_qmin > c_qmax")
        states = ins[5:]
        for k, s in enumerate(states):
            c.act(s, "initial state")
            want = (out.dtype,) if k == 0 else (DType.I8, DType.U8, DType.I32)
            c.dt(s, want, "initial state")
            # a state sliced from a module's (layers·directions, N, H) input has a static N (SELECT)
            c.need(len(s.shape) == 2 and s.shape[1] == hid and (s.shape[0] == x.shape[0] or -1 in (s.shape[0], x.shape[0])),
                   f"initial state {s.name!r} must be [N, {hid}], has {s.shape}")
        shape = tuple(x.shape[:-1]) + (hid,)
        return INT8_DTYPES, shape
    return infer


def _extra(lstm_: bool):
    # h_n on the hidden grid (an 8-bit container like y); c_n the cell's codes: I8/U8 for an
    # 8-bit cell, I32 for a wider one (the C++ Prepare checks h_n's dtype equals y's)
    def extra(op, ins):
        shape = (ins[0].shape[0], ins[2].shape[1])
        outs = ((INT8_DTYPES, shape),)
        return outs + (((DType.I8, DType.U8, DType.I32), shape),) if lstm_ else outs
    return extra


_COMMON = {
    "reverse": AttrType.INT, "x_zp": AttrType.INT, "h_zp": AttrType.INT, "h_qmin": AttrType.INT,
    "h_qmax": AttrType.INT, "ih_mult": AttrType.INTS, "ih_shift": AttrType.INTS, "hh_mult": AttrType.INTS,
    "hh_shift": AttrType.INTS, "h_mult": AttrType.INT, "h_shift": AttrType.INT, "sigmoid": AttrType.INTS,
}
_LSTM = {**_COMMON, "c_zp": AttrType.INT, "c_qmin": AttrType.INT, "c_qmax": AttrType.INT,
         "c_mult": AttrType.INT, "c_shift": AttrType.INT, "ct_mult": AttrType.INT, "ct_shift": AttrType.INT}

def _infer_rnn(c, op, ins, out):
    c.int("relu", 0, 1)
    return _infer(1, False)(c, op, ins, out)


OPS = (
    OpDef("LSTM", 35, OpSchema(5, 7, _LSTM, n_outputs=3), _infer(4, True),
          lambda op, args, graph, counts: lstm(args, op.attrs),
          "One LSTM layer and direction over time: I8/U8 x, int8 W_ih/W_hh, int32 biases, optional h0/c0 codes "
          "-> y, h_n, c_n (fixed-point gates, a Q24 sigmoid table).", extra_outputs=_extra(True)),
    OpDef("GRU", 36, OpSchema(5, 6, _COMMON, n_outputs=2), _infer(3, False),
          lambda op, args, graph, counts: gru(args, op.attrs),
          "One GRU layer and direction over time: I8/U8 x, int8 W_ih/W_hh, int32 biases, optional h0 codes "
          "-> y, h_n (fixed-point gates, a Q24 sigmoid table).", extra_outputs=_extra(False)),
    OpDef("RNN", 39, OpSchema(5, 6, {**_COMMON, "relu": AttrType.INT}, n_outputs=2), _infer_rnn,
          lambda op, args, graph, counts: rnn(args, op.attrs),
          "One Elman RNN layer and direction over time (tanh from the Q24 sigmoid table, or relu): I8/U8 x, "
          "int8 W_ih/W_hh, int32 biases, optional h0 codes -> y, h_n.", extra_outputs=_extra(False)),
)

"""LSTM_DYNAMIC: one LSTM layer and direction with dynamic (run-time scale) int8 input and
hidden state and float gates, as torch.ao's dynamically quantized LSTM.

Inputs: ``x`` (F32 ``[N, T, F]``), the constant int8 weights ``w_ih [4H, F+F2]`` and
``w_hh [4H, H]`` (symmetric, per-row scales ``w_ih_scale``/``w_hh_scale``), and optionally
``x2`` (F32 ``[N, T, F2]``): a second part of the input, concatenated after ``x`` along
the features (a bidirectional layer's two outputs feeding the next layer), then optionally
the initial states ``h0`` and ``c0`` (F32 ``[N, H]``; told from ``x2`` by their rank 2;
without them ``h = 0``, ``c = 0``).  Outputs (F32):
``y [N, T, H]``, ``h_n [N, H]``, ``c_n [N, H]``.  Float constants travel as binary32 bit
patterns (``w_*_scale``, ``b_ih``, ``b_hh``: 0 or 4H values), as LINEAR_DYNAMIC's.

Semantics (every float step one binary32 operation in this order, no fused multiply-add):

* ``qx, (s_x, z_x) = QUANTIZE_DYNAMIC(x‖x2)`` per tensor (``in_*`` attributes);
  ``A_ih[t, r] = f32(Σ (qx - z_x)·w_ih[r]) · f32(s_x · w_ih_scale[r]) (+ b_ih[r])``;
* ``h = Q(h0)`` (``Q(0)`` without one), ``c = c0`` (or 0); per step ``t`` (reversed when ``reverse``), with ``Q`` the
  per-tensor QUANTIZE_DYNAMIC of the ``[N, H]`` state (``h_*`` attributes) and ``h``'s codes
  ``qh, (s_h, z_h)``: ``A_hh = f32(Σ (qh - z_h)·w_hh[r]) · f32(s_h · w_hh_scale[r]) (+ b_hh[r])``,
  ``p = A_ih[t] + A_hh``, gates i, f, g, o: ``c = σ(f)·c + σ(i)·tanh(g)``,
  ``qh = Q(σ(o)·tanh(c))``, ``y[:, t] = h = f32(qh - z_h) · s_h``;
* ``σ(v) = 1 / (1 + exp(-v))``, ``tanh(v) = 2·σ(2v) - 1``, ``exp`` :func:`exp_f32` (range
  reduction by ln 2 and a degree-6 polynomial, all binary32: the same bits in numpy and C++).

The fake-quant model (``dynamic`` input and ``hidden`` quantizers, float cell) computes the
same with torch's float GEMM and transcendental functions: codes equal except where
binary32 rounding decides (docs/qgraph.md §4.4 has the measured agreement).
"""

from __future__ import annotations

import numpy as np

from qdsl.graph.checks import I32_RANGE
from qdsl.graph.ops import OpDef
from qdsl.graph.ops.dynamic import bits_f32, quantize_dynamic
from qdsl.graph.schema import AttrType, DType, OpSchema, Rounding

__all__ = ["OPS", "lstm_dynamic", "gru_dynamic", "exp_f32"]

_F = np.float32
_LN2_HI, _LN2_LO = _F(0.693359375), _F(-2.12194440e-4)  # ln 2 = HI + LO, HI exact in 9 bits
_INV_LN2 = _F(1.44269504)
_POLY = tuple(_F(c) for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 0.5, 1.0, 1.0))
_LIMIT = _F(87.0)


def exp_f32(x: np.ndarray) -> np.ndarray:
    """``e^x`` in binary32 with a fixed operation order: ``x`` clamped to ±87,
    ``k = rint(x · 1/ln2)``, ``r = (x - k·LN2_HI) - k·LN2_LO``, Horner of the degree-6
    Taylor polynomial, times ``2^k`` (exact).  Relative error below 3e-7."""
    x = np.clip(x.astype(_F), -_LIMIT, _LIMIT)
    k = np.rint(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = np.full_like(r, _POLY[0])
    for c in _POLY[1:]:
        p = p * r + c
    return np.ldexp(p, k.astype(np.int32)).astype(_F)


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return (_F(1) / (_F(1) + exp_f32(-v))).astype(_F)


def _tanh(v: np.ndarray) -> np.ndarray:
    return (_F(2) * _sigmoid(_F(2) * v) - _F(1)).astype(_F)


def _q(prefix: str, a) -> dict:
    return dict(qmin=a[f"{prefix}_qmin"], qmax=a[f"{prefix}_qmax"], symmetric=a[f"{prefix}_symmetric"],
                per_row=0, rounding=a[f"{prefix}_rounding"])


def _linear(q: np.ndarray, s: np.float32, z: np.float32, w: np.ndarray, ws: np.ndarray, b: np.ndarray | None):
    acc = (q - np.int64(z)) @ w.T  # exact
    y = acc.astype(_F) * (s * ws)[None, :]
    return y + b[None, :] if b is not None else y


def _prologue(args, a):
    """What LSTM_DYNAMIC and GRU_DYNAMIC share before their time loop: the input (a second
    [N, T, F2] input concatenated on features), the input products of every step at once,
    the hidden weights and the optional initial states ``rest``."""
    x = args[0].astype(_F)
    rest = [np.asarray(v, dtype=_F) for v in args[3:]]
    if rest and rest[0].ndim == 3:
        x = np.concatenate([x, rest.pop(0)], axis=-1)
    w_ih, w_hh = (np.asarray(t.data, dtype=np.int64) for t in args[1:3])
    ws_ih, ws_hh = bits_f32(a["w_ih_scale"]), bits_f32(a["w_hh_scale"])
    b_ih = bits_f32(a["b_ih"]) if a["b_ih"] else None
    b_hh = bits_f32(a["b_hh"]) if a["b_hh"] else None
    n, steps, feats = x.shape
    qx, qpx = quantize_dynamic(x, _q("in", a))
    s_x, z_x = qpx.reshape(-1, 2)[0]
    a_ih = _linear(qx.reshape(-1, feats), s_x, z_x, w_ih, ws_ih, b_ih).reshape(n, steps, -1)
    return a_ih, (w_hh, ws_hh, b_hh), rest, n, steps, w_hh.shape[1]


def lstm_dynamic(args, a) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a_ih, (w_hh, ws_hh, b_hh), rest, n, steps, hid = _prologue(args, a)
    hq = _q("h", a)
    h = rest[0] if rest else np.zeros((n, hid), dtype=_F)
    c = rest[1] if len(rest) > 1 else np.zeros((n, hid), dtype=_F)
    qh, qph = quantize_dynamic(h, hq)
    ys = np.zeros((n, steps, hid), dtype=_F)
    order = range(steps - 1, -1, -1) if a["reverse"] else range(steps)
    for t in order:
        s_h, z_h = qph.reshape(-1, 2)[0]
        p = a_ih[:, t] + _linear(qh, s_h, z_h, w_hh, ws_hh, b_hh)
        gi, gf, gg, go = (p[:, k * hid:(k + 1) * hid] for k in range(4))
        c = _sigmoid(gf) * c + _sigmoid(gi) * _tanh(gg)
        qh, qph = quantize_dynamic(_sigmoid(go) * _tanh(c), hq)
        s_h, z_h = qph.reshape(-1, 2)[0]
        h = (qh - np.int64(z_h)).astype(_F) * s_h
        ys[:, t] = h
    return ys, h, c.astype(_F)


def gru_dynamic(args, a) -> tuple[np.ndarray, np.ndarray]:
    """GRU_DYNAMIC: as :func:`lstm_dynamic` with GRU gates r, z, n and no cell:
    ``n = tanh(A_ih_n + σ(r)·A_hh_n)``, ``h' = Q((1 - σ(z))·n + σ(z)·h)`` (binary32, that order),
    ``h`` the dequantized codes (``Q(h0)`` at the start)."""
    a_ih, (w_hh, ws_hh, b_hh), rest, n, steps, hid = _prologue(args, a)
    hq = _q("h", a)
    qh, qph = quantize_dynamic(rest[0] if rest else np.zeros((n, hid), dtype=_F), hq)
    s_h, z_h = qph.reshape(-1, 2)[0]
    h = (qh - np.int64(z_h)).astype(_F) * s_h
    ys = np.zeros((n, steps, hid), dtype=_F)
    order = range(steps - 1, -1, -1) if a["reverse"] else range(steps)
    for t in order:
        a_hh = _linear(qh, s_h, z_h, w_hh, ws_hh, b_hh)
        xi = a_ih[:, t]
        r = _sigmoid(xi[:, :hid] + a_hh[:, :hid])
        z = _sigmoid(xi[:, hid:2 * hid] + a_hh[:, hid:2 * hid])
        nn_ = _tanh(xi[:, 2 * hid:] + r * a_hh[:, 2 * hid:])
        qh, qph = quantize_dynamic((_F(1) - z) * nn_ + z * h, hq)
        s_h, z_h = qph.reshape(-1, 2)[0]
        h = (qh - np.int64(z_h)).astype(_F) * s_h
        ys[:, t] = h
    return ys, h


def _infer_gates(gates: int):
    def infer(c, op, ins, out):
        return _infer(c, op, ins, out, gates)
    return infer


def _infer(c, op, ins, out, gates: int = 4):
    x, w_ih, w_hh = ins[:3]
    c.dt(x, (DType.F32,), "input")
    c.need(len(x.shape) == 3, f"input {x.name!r} must be [N, T, F], has shape {x.shape}")
    feats = x.shape[-1]
    rest = list(ins[3:])
    if rest and len(rest[0].shape) == 3:
        x2 = rest.pop(0)
        c.act(x2, "second input part")
        c.dt(x2, (DType.F32,), "second input part")
        c.need(len(x2.shape) == 3 and tuple(x2.shape[:2]) == tuple(x.shape[:2]),
               f"second input part {x2.name!r} must be [N, T, F2] like {x.shape}, has {x2.shape}")
        feats += x2.shape[-1]
    for w, what in ((w_ih, "w_ih"), (w_hh, "w_hh")):
        c.const(w, what)
        c.dt(w, (DType.I8,), what)
        c.need(len(w.shape) == 2, f"{what} {w.name!r} must have rank 2, has shape {w.shape}")
    rows, hid = w_hh.shape
    c.need(rows == gates * hid, f"w_hh {w_hh.name!r} must be [{gates}·H, H], has shape {w_hh.shape}")
    c.need(tuple(w_ih.shape) == (rows, feats), f"w_ih {w_ih.name!r} must be [{rows}, {feats}], has {w_ih.shape}")
    c.need(max(feats, hid) <= 65536, "F and H must be <= 65536 (exact int32 accumulators)")
    c.int("reverse", 0, 1)
    for prefix in ("in", "h"):
        mn, mx = c.int(f"{prefix}_qmin", -128, 255), c.int(f"{prefix}_qmax", -128, 255)
        c.need(mn < mx and mx > 0 and (mn >= 0 or mx <= 127), f"{prefix}_qmin/{prefix}_qmax must be an 8-bit range")
        c.int(f"{prefix}_symmetric", 0, 1)
        c.int(f"{prefix}_rounding", 0, len(Rounding) - 1)
    for name in ("w_ih_scale", "w_hh_scale"):
        c.ints(name, rows, *I32_RANGE)
        v = bits_f32(op.attrs[name])
        c.need(bool(np.all(np.isfinite(v) & (v > 0))), f"{name} must hold finite positive binary32 values")
    for name in ("b_ih", "b_hh"):
        c.ints(name, (0, rows), *I32_RANGE)
        c.need(bool(np.isfinite(bits_f32(op.attrs[name])).all()), f"{name} must hold finite binary32 values")
    c.need(len(rest) <= (2 if gates == 4 else 1), "too many initial states (LSTM: h0, c0; GRU: h0)")
    for s in rest:  # h0, c0: F32 [N, H] (N static when sliced from a module's state input)
        c.act(s, "initial state")
        c.dt(s, (DType.F32,), "initial state")
        c.need(len(s.shape) == 2 and s.shape[1] == hid and (s.shape[0] == x.shape[0] or -1 in (s.shape[0], x.shape[0])),
               f"initial state {s.name!r} must be [N, {hid}], has {s.shape}")
    c.dt(out, (DType.F32,), "output")
    return (DType.F32,), tuple(x.shape[:-1]) + (hid,)


def _extra(op, ins):
    shape = (ins[0].shape[0], ins[2].shape[1])
    return ((DType.F32, shape), (DType.F32, shape))


def _extra_gru(op, ins):
    return ((DType.F32, (ins[0].shape[0], ins[2].shape[1])),)


_ATTRS = {"reverse": AttrType.INT, "w_ih_scale": AttrType.INTS, "w_hh_scale": AttrType.INTS, "b_ih": AttrType.INTS,
          "b_hh": AttrType.INTS}
for _p in ("in", "h"):
    _ATTRS.update({f"{_p}_qmin": AttrType.INT, f"{_p}_qmax": AttrType.INT, f"{_p}_symmetric": AttrType.INT,
                   f"{_p}_rounding": AttrType.INT})

OPS = (
    OpDef("LSTM_DYNAMIC", 37, OpSchema(3, 6, _ATTRS, n_outputs=3), _infer,
          lambda op, args, graph, counts: lstm_dynamic(args, op.attrs),
          "One LSTM layer and direction, dynamic int8 input and hidden state, float gates: F32 x (and x2) "
          "-> F32 y, h_n, c_n.", extra_outputs=_extra),
    OpDef("GRU_DYNAMIC", 40, OpSchema(3, 5, _ATTRS, n_outputs=2), _infer_gates(3),
          lambda op, args, graph, counts: gru_dynamic(args, op.attrs),
          "One GRU layer and direction, dynamic int8 input and hidden state, float gates: F32 x (and x2, h0) "
          "-> F32 y, h_n.", extra_outputs=_extra_gru),
)

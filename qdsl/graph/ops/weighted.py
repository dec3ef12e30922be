"""The weighted ops: CONV1D, CONV2D, LINEAR and their binary (XNOR-popcount) forms
BCONV1D, BCONV2D, BLINEAR.  Input, constant weight[, int32 bias] -> an accumulator of
``acc_bits`` (wrapping or saturating), then an output stage or, for a BIN output, the sign.
"""

from __future__ import annotations

import numpy as np

from qdsl.graph.checks import check_acc, check_out, spatial
from qdsl.graph.ops import OpDef
from qdsl.graph.requant import apply_rescale, apply_rescale_wide, sat, wrap
from qdsl.graph.schema import INT8_DTYPES, WEIGHT_DTYPES, AttrType, DType, OpSchema, OutputStage

__all__ = ["OPS", "windows", "conv", "linear", "bconv", "accumulator_bound", "worst_case_range"]

_ACC = {"acc_bits": AttrType.INT, "overflow": AttrType.INT}
_SPATIAL = {"stride": AttrType.INTS, "padding": AttrType.INTS, "dilation": AttrType.INTS}
_CONV = {**_SPATIAL, "groups": AttrType.INT, "in_zp": AttrType.INT, "w_zp": AttrType.INTS, **_ACC}
_BCONV = {**_SPATIAL, "groups": AttrType.INT, **_ACC}


# ---------------------------------------------------------------- reference semantics


def worst_case_range(w: tuple[int, int], x: tuple[int, int], fan_in: int) -> tuple[int, int]:
    """Exact extremes of ``Σ_{i<fan_in} w_i x_i`` over all weights and inputs in range
    (lint's worst case, qdsl.lint.accumulator; here so the patch layer's compiled
    accumulator check can use it without importing lint)."""
    corners = [a * b for a in w for b in x]
    return fan_in * min(corners), fan_in * max(corners)


def accumulator_bound(w_codes: np.ndarray, w_zp, x_max: int, bias: np.ndarray | None, s_acc) -> float:
    """The largest ``|real value|`` a conv/linear result ``acc·s_acc[c]`` can take for any input
    codes within ``x_max`` of their zero point: every product at its largest, plus the bias
    (``w_codes``: output channels first; ``w_zp``/``s_acc``: per channel or one).  The
    exporter sizes a wide sum's grid with it (qdsl.export.lower_attn), and the fake-quant
    model the same grid (qdsl.patch.residual_sim)."""
    w = np.asarray(w_codes, dtype=np.int64)
    w_abs = np.abs(w.reshape(w.shape[0], -1) - np.asarray(w_zp, dtype=np.int64).reshape(-1, 1))
    b_abs = np.abs(np.asarray(bias, dtype=np.int64)) if bias is not None else 0
    return float(((w_abs.sum(axis=1) * x_max + b_abs) * np.asarray(s_acc, dtype=np.float64)).max(initial=0.0))
def windows(x: np.ndarray, kernel, stride, padding, dilation, pad_value) -> np.ndarray:
    """``N×C×L_1..×K_1..``: every window of ``x`` (rank-2 spatial or rank-1)."""
    pads = [(0, 0), (0, 0)] + [(p, p) for p in padding]
    xp = np.pad(x, pads, constant_values=pad_value)
    rank = len(kernel)
    win = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    v = np.lib.stride_tricks.sliding_window_view(xp, win, axis=tuple(range(2, 2 + rank)))
    sl = (slice(None), slice(None)) + tuple(slice(None, None, s) for s in stride)
    sl += tuple(slice(None, None, d) for d in dilation)
    return v[sl]


def _conv_acc(x: np.ndarray, w: np.ndarray, groups: int, a, pad_value: int) -> np.ndarray:
    """Exact ``sum x·w`` per output (x, w already zero-point-subtracted, int64)."""
    rank = w.ndim - 2
    win = windows(x, w.shape[2:], a["stride"], a["padding"], a["dilation"], pad_value)
    n, cin = x.shape[:2]
    cout = w.shape[0]
    cg, og = cin // groups, cout // groups
    out_sp = win.shape[2:2 + rank]
    outs = []
    for g in range(groups):
        xg = win[:, g * cg:(g + 1) * cg]  # N, cg, L.., K..
        xg = np.moveaxis(xg, 1, 1 + rank)  # N, L.., cg, K..
        cols = xg.reshape(n * int(np.prod(out_sp)), -1)
        wg = w[g * og:(g + 1) * og].reshape(og, -1)
        outs.append((cols @ wg.T).reshape((n,) + tuple(out_sp) + (og,)))
    acc = np.concatenate(outs, axis=-1)
    return np.moveaxis(acc, -1, 1)


def _finish_acc(acc: np.ndarray, bias: np.ndarray | None, a, counts: dict, name: str, axis: int = 1) -> np.ndarray:
    if bias is not None:
        shape = [1] * acc.ndim
        shape[axis] = -1
        acc = acc + bias.reshape(shape)
    bits = a["acc_bits"]
    if bits < 64:  # a 64-bit accumulator holds the exact (int64) sum
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        counts[name] = counts.get(name, 0) + int(((acc < lo) | (acc > hi)).sum())
    return sat(acc, bits) if a["overflow"] == 1 else wrap(acc, bits)


def _output(acc: np.ndarray, a, out, axis: int = 1) -> np.ndarray:
    if out.dtype is DType.BIN:
        return np.where(acc < 0, -1, 1).astype(np.int64)
    stage = OutputStage.from_attrs(a)
    rescale = apply_rescale_wide if a.get("acc_bits", 32) > 32 else apply_rescale
    y = rescale(acc, stage.rescale, axis=axis) + stage.zero_point
    return np.clip(y, stage.qmin, stage.qmax)


def _wzp(w, a) -> np.ndarray:
    zp = np.asarray(a["w_zp"], dtype=np.int64)
    return w.data.astype(np.int64) - zp.reshape((-1,) + (1,) * (w.data.ndim - 1))


def conv(x: np.ndarray, w, bias, a, out, counts, name) -> np.ndarray:
    acc = _conv_acc(x - a["in_zp"], _wzp(w, a), a["groups"], a, pad_value=0)
    return _output(_finish_acc(acc, bias, a, counts, name), a, out)


def linear(x: np.ndarray, w, bias, a, out, counts, name) -> np.ndarray:
    # features last: (N, K) or (N, ..., K) -> (N, ..., O), channels on the last axis
    acc = (x - a["in_zp"]) @ _wzp(w, a).T
    return _output(_finish_acc(acc, bias, a, counts, name, axis=acc.ndim - 1), a, out, axis=acc.ndim - 1)


def bconv(x: np.ndarray, w, bias, a, out, counts, name) -> np.ndarray:
    # XNOR-popcount: bit 1 means -1. For each output, over the taps that fall inside the
    # input (padding taps are skipped): acc = K_valid - 2 * popcount(a_bits XOR w_bits).
    abits = (x == -1).astype(np.int64)
    wbits = (w.data == -1).astype(np.int64)
    valid = np.ones_like(abits)
    groups = a.get("groups", 1)
    if w.data.ndim == 2:  # BLINEAR: no padding, every tap valid
        mism = abits @ (1 - wbits).T + (1 - abits) @ wbits.T
        k_valid = np.full(mism.shape, wbits.shape[1], dtype=np.int64)
    else:
        # popcount(a XOR w) over valid taps = sum valid*a*(1-w) + valid*(1-a)*w
        mism = _conv_acc(abits, 1 - wbits, groups, a, 0) + _conv_acc(valid - abits, wbits, groups, a, 0)
        k_valid = _conv_acc(valid, np.ones_like(wbits), groups, a, 0)
    acc = k_valid - 2 * mism
    axis = acc.ndim - 1 if w.data.ndim == 2 else 1  # BLINEAR: channels last, as LINEAR
    return _output(_finish_acc(acc, bias, a, counts, name, axis=axis), a, out, axis=axis)


def _runner(fn):
    def run(op, args, graph, counts):
        bias = args[2].data.astype(np.int64) if len(args) == 3 else None
        return fn(args[0], args[1], bias, op.attrs, graph.tensor(op.outputs[0]), counts, op.name)
    return run


# ---------------------------------------------------------------- validation
def _inferrer(rank: int, binary: bool):
    """The rule of one weighted op: ``rank`` spatial dims (0: LINEAR), ``binary``: XNOR-popcount."""

    def infer(c, op, ins, out):
        x, w = ins[0], ins[1]
        n = x.shape[0] if x.shape else 1
        c.dt(x, (DType.BIN,) if binary else INT8_DTYPES, "input")
        c.const(w, "weight")
        c.dt(w, (DType.BIN,) if binary else WEIGHT_DTYPES, "weight")
        if rank == 0:  # LINEAR: (N, K) or (N, ..., K), features last
            c.need(len(x.shape) >= 2, f"input {x.name!r} must have rank >= 2, has shape {x.shape}")
        else:
            c.need(len(x.shape) == rank + 2, f"input {x.name!r} must have rank {rank + 2}, has shape {x.shape}")
        c.need(len(w.shape) == rank + 2, f"weight {w.name!r} must have rank {rank + 2}, has shape {w.shape}")
        cout = w.shape[0]
        if len(ins) == 3:
            c.const(ins[2], "bias")
            c.dt(ins[2], (DType.I32,), "bias")
            c.need(ins[2].shape == (cout,), f"bias {ins[2].name!r} must have shape ({cout},), has {ins[2].shape}")
        check_acc(c)
        if not binary:
            c.int("in_zp", *x.dtype.range)
            c.ints("w_zp", (1, cout), *w.dtype.range)
        if rank == 0:
            c.need(w.shape[1] == x.shape[-1], f"weight {w.name!r} expects {w.shape[1]} input features, input has {x.shape[-1]}")
            shape = tuple(x.shape[:-1]) + (cout,)
        else:
            g = c.int("groups", 1, 1 << 20)
            cin = x.shape[1]
            c.need(cin % g == 0 and cout % g == 0, f"groups={g} must divide input channels {cin} and output channels {cout}")
            c.need(w.shape[1] == cin // g, f"weight {w.name!r} has {w.shape[1]} input channels per group, expected {cin // g}")
            shape = (n, cout) + spatial(c, x, rank, w.shape[2:], False)
        if out.dtype is not DType.BIN:
            c.dt(out, INT8_DTYPES + (DType.I32,), "output")
            check_out(c, out.dtype, cout)
        return (DType.I8, DType.U8, DType.I32, DType.BIN), shape

    return infer


def _weighted(name: str, number: int, attrs, rank: int, binary: bool, fn, doc: str) -> OpDef:
    return OpDef(name, number, OpSchema(2, 3, attrs, needs_output_stage=True), _inferrer(rank, binary), _runner(fn), doc)


OPS = (
    _weighted("CONV1D", 4, _CONV, 1, False, conv, "Integer conv over ``N×C×L``; output stage or sign (BIN output)."),
    _weighted("CONV2D", 5, _CONV, 2, False, conv, "Integer conv over ``N×C×H×W``; groups incl. depthwise."),
    _weighted("LINEAR", 6, {"in_zp": AttrType.INT, "w_zp": AttrType.INTS, **_ACC}, 0, False, linear,
              "Integer matrix product ``N×K · (O×K)^T``."),
    _weighted("BCONV1D", 7, _BCONV, 1, True, bconv, "Binary conv: XNOR-popcount of BIN input and BIN weights."),
    _weighted("BCONV2D", 8, _BCONV, 2, True, bconv, "Binary 2-D conv: XNOR-popcount."),
    _weighted("BLINEAR", 9, dict(_ACC), 0, True, bconv, "Binary linear: ``acc = K - 2 * popcount(a XOR w)``."),
)

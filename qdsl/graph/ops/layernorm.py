"""LAYERNORM: integer layer normalization over the last axis, then a per-channel affine
into the output grid (integer only, I-BERT style: exact sums, an integer square root, a
fixed-point quotient).

The normalized value is the sum of one or two inputs (I8/U8, or I32: a layer's wide
result), each brought to one common grid by its own rescale, as ADD does::

    x_i = sat32(Σ_j rescale_j(x_j,i - in_zp_j))

so a post-norm block's ``LayerNorm(dense(h) + residual)`` reads the residual sum at a fine
int32 grid instead of 8-bit codes (BERT's residual stream has channels 37-124x the typical
range; I-BERT's LayerNorm also takes INT32 input).  Input 1 may be a constant of shape
``(1, ...)`` added to every batch row (the position and token-type embeddings of a fixed
sequence length).  The narrow form - one I8/U8 input with the identity rescale - is the
original op; the wide form (anything else) allows rows of up to 8192.

For a row of ``N`` values ``x`` (a zero point cancels)::

    D_i = N·x_i - Σ_j x_j                 (= N·(x_i - mean), exact)
    k   = max(0, bitlen(max_i |D_i|) - 24)   (0 in the narrow form: |D| < 2^24)
    D_i = round_half_away(D_i / 2^k),  eps_k = round_half_away(eps / 4^k)
    W   = Σ_i D_i² + eps_k                (int64; eps = round(N³·ε / s²), ε in codes)
    G   = (62 - bitlen(W)) // 2           (scales W to 61..62 bits: full precision)
    R   = isqrt(W · 4^G)                  (exact floor square root, R < 2^31)
    Z_i = round_half_away(D_i · 2^(G+16) / R)   (0 when R = 0)
    acc_i = Z_i · gamma_i + beta_i
    y_i = clamp(rescale(acc_i) + out_zp, out_min, out_max)

The output is I8/U8, or I32 (the **wide output**: the stage clamps within int32, e.g. the
accumulator itself with the identity rescale), which a residual add and the next LayerNorm
read wide while the next Linear's input quantizer is a REQUANTIZE from it (post-norm BERT:
an 8-bit per-tensor grid cannot hold its residual stream).

``Z_i = 2^16 · (x_i - mean) / (sqrt(N) · sqrt(var + ε))``: the normalized value divided
by ``sqrt(N)``, so ``|Z_i| <= 2^16 + 1`` (``D_i² <= W``).  ``gamma`` holds the affine
weight in codes of at most 14 bits, ``beta`` the bias in accumulator units (``|beta| <=
2^30``), so ``acc`` stays in int32; the rescale carries ``s_gamma · sqrt(N) / (2^16 · s_out)``.
``N³ · 255² + eps < 2^62`` bounds ``W`` in the narrow form; in the wide form ``N <= 8192``
and ``eps < 2^61`` do (``|D_i| <= 2^24`` after the shift).
"""

from __future__ import annotations

import math

import numpy as np

from qdsl.graph.checks import check_out, check_rescale
from qdsl.graph.ops import OpDef
from qdsl.graph.ops.add import in_rescale
from qdsl.graph.requant import apply_rescale, rounding_shift, sat
from qdsl.graph.schema import (IN_RQ_ATTRS, INT8_DTYPES, OUT_ATTRS, RQ_ATTRS, AttrType, DType, OpSchema, OutputStage,
                               RescaleKind, Rounding)

__all__ = ["OPS", "layernorm", "layernorm_constants", "wide_output_bound", "wide_sum_grid", "isqrt", "LN_FRAC_BITS",
           "GAMMA_MAX", "BETA_MAX", "WIDE_MAX_N", "WIDE_SUM_BITS", "D_BITS"]

LN_FRAC_BITS = 16
GAMMA_MAX = 2**14 - 1
BETA_MAX = 2**30
WIDE_MAX_N = 8192
D_BITS = 24
"""Bits of ``|D_i|`` kept by the row shift ``k``."""


def layernorm_constants(n: int, weight, bias, eps: float, s_in: float) -> tuple[np.ndarray, np.ndarray, float, int]:
    """``(gamma codes, beta, unit, eps)`` of a LayerNorm over ``n`` channels (``weight``/``bias``:
    float arrays or None) reading the grid ``s_in``: ``gamma`` the affine weight in codes of at
    most 14 bits, ``beta`` the bias in accumulator units, ``unit`` the real value of one
    accumulator unit (``s_gamma·sqrt(N)/2^16``), ``eps`` in the op's units (``round(N³·ε/s²)``).
    The exporter (qdsl.export.lower_attn) and the fake-quant simulation (qdsl.patch.int_sim)
    both derive them here, so they compute one function."""
    gamma = np.ones(n) if weight is None else np.asarray(weight, dtype=np.float64).reshape(n)
    beta = np.zeros(n) if bias is None else np.asarray(bias, dtype=np.float64).reshape(n)
    s_gamma = float(np.abs(gamma).max()) / GAMMA_MAX or 1.0
    g_int = np.clip(np.rint(gamma / s_gamma), -GAMMA_MAX, GAMMA_MAX).astype(np.int64)
    # acc = Z·gamma + beta is the affine output in units of s_gamma·sqrt(N)/2^16
    unit = s_gamma * math.sqrt(n) / 2.0**LN_FRAC_BITS
    b_int = np.clip(np.rint(beta / unit), -BETA_MAX, BETA_MAX).astype(np.int64)
    eps_int = int(round(n**3 * eps / (s_in * s_in)))
    return g_int, b_int, unit, eps_int


def wide_output_bound(g_int: np.ndarray, b_int: np.ndarray, unit: float) -> float:
    """The largest ``|real value|`` of a LayerNorm's wide output (its accumulator ``acc·unit``):
    ``|Z| <= 2^16`` (+ rounding), since ``|N·(x - mean)|`` is at most the row's root sum of squares."""
    return float(((2**16 + 2) * np.abs(g_int).max(initial=0) + np.abs(b_int).max(initial=0)) * unit)


WIDE_SUM_BITS = 30
"""A wide sum's worst case stays below ``2^WIDE_SUM_BITS`` grid steps (int32, with headroom)."""


def wide_sum_grid(bound: float, n: int, eps: float) -> float:
    """The grid of a LayerNorm's wide input: the finest power of two that keeps the sum's worst
    case ``bound`` below ``2^WIDE_SUM_BITS`` steps (LAYERNORM saturates its sum to int32), and
    ``eps`` in the op's units (``N³·eps/s²``) below ``2^60``.

    Fine on purpose: each term of the sum is rounded onto this grid; a grid at an
    accumulator's unit (what an ADD's int8 result needs) rounds away bits the LayerNorm keeps
    (24 of ``N·(x - mean)``), and those roundings start 8-bit code differences that the
    attention's softmax amplifies from block to block (docs/qgraph.md §6).  The exporter
    (qdsl.export.lower_attn) sizes the graph's grid with it, and the fake-quant model
    (qdsl.patch.residual_sim) the same grid from the same term bounds."""
    # frexp: bound / 2^WIDE_SUM_BITS = m·2^e with m in [0.5, 1), so 2^e is the finest power of
    # two above it
    s = math.ldexp(1.0, math.frexp(max(bound, 1e-30) / 2**WIDE_SUM_BITS)[1])
    while n**3 * eps / (s * s) >= 2**60:
        s *= 2
    return s


def isqrt(v: np.ndarray) -> np.ndarray:
    """Exact ``floor(sqrt(v))`` of int64 values in [0, 2^62] (float estimate, integer fix-up)."""
    v = np.asarray(v, dtype=np.int64)
    r = np.floor(np.sqrt(v.astype(np.float64))).astype(np.int64)
    # the float estimate is within a few units: step it until r² <= v < (r+1)²
    for _ in range(4):
        r = np.where(r * r > v, r - 1, r)
        r = np.where((r + 1) * (r + 1) <= v, r + 1, r)
    return r


def _bitlen(v: np.ndarray) -> np.ndarray:
    out = np.zeros(v.shape, dtype=np.int64)
    w = v.copy()
    for s in (32, 16, 8, 4, 2, 1):
        big = w >= (np.int64(1) << s)
        out = out + np.where(big, s, 0)
        w = np.where(big, w >> s, w)
    return out + (w > 0)


def _half_away_shift(v: np.ndarray, k: np.ndarray) -> np.ndarray:
    return np.sign(v) * rounding_shift(np.abs(v), k, Rounding.HALF_AWAY)


def layernorm(xs, a) -> np.ndarray:
    if isinstance(xs, np.ndarray):  # one input (the narrow form's callers)
        xs = [xs]
    xs = [np.asarray(x, dtype=np.int64) for x in xs]
    shape = xs[0].shape
    x = sat(sum(apply_rescale(np.broadcast_to(v, shape) - a["in_zp"][i], in_rescale(a, i), None)
                for i, v in enumerate(xs)))
    n = x.shape[-1]
    d = n * x - x.sum(axis=-1, keepdims=True)
    m = np.abs(d).max(axis=-1, keepdims=True)
    k = np.maximum(_bitlen(m) - D_BITS, 0)
    d = _half_away_shift(d, k)
    w = (d * d).sum(axis=-1, keepdims=True) + _half_away_shift(np.full(k.shape, a["eps"], dtype=np.int64), 2 * k)
    g = (62 - _bitlen(w)) // 2
    r = isqrt(w << (2 * g))
    num = np.abs(d) << (g + LN_FRAC_BITS)
    safe = np.maximum(r, 1)
    z = np.where(r == 0, 0, np.sign(d) * ((2 * num + safe) // (2 * safe)))
    acc = z * np.asarray(a["gamma"], dtype=np.int64) + np.asarray(a["beta"], dtype=np.int64)
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(acc, st.rescale) + st.zero_point, st.qmin, st.qmax)


# the wide output (I32) keeps the affine result on a fine grid for a residual stream; the
# next Linear's input quantizer is then a REQUANTIZE from it
OUT_DTYPES = INT8_DTYPES + (DType.I32,)


def is_narrow(ins, a) -> bool:
    """One I8/U8 input read with the identity rescale: the original op's bounds apply."""
    return (len(ins) == 1 and ins[0].dtype in INT8_DTYPES and a["in_kind"][0] == RescaleKind.POT
            and a["in_shift"][0] == 0 and a["in_multiplier"][0] == 1)


def _infer(c, op, ins, out):
    x = ins[0]
    c.need(not x.is_constant, f"input 0 {x.name!r} must be an activation, not a constant")
    for i, t in enumerate(ins):
        c.dt(t, INT8_DTYPES + (DType.I32,), f"input {i}")
    c.need(len(x.shape) >= 2 and x.shape[-1] >= 1, f"input {x.name!r} needs a normalized axis, has shape {x.shape}")
    if len(ins) == 2:
        y = ins[1]
        c.need(y.shape == x.shape or (y.is_constant and tuple(y.shape) == (1,) + tuple(x.shape[1:])),
               f"input 1 {y.name!r} has shape {y.shape}: input 0's {x.shape}, or a constant (1, ...) over the batch")
    zps = c.ints("in_zp", len(ins))
    for t, zp in zip(ins, zps):
        c.need(t.dtype.range[0] <= zp <= t.dtype.range[1], f"in_zp {zp} outside the range of {t.name!r}")
    check_rescale(c, "in_", len(ins), per_input=True)
    n = x.shape[-1]
    c.ints("gamma", n, -GAMMA_MAX, GAMMA_MAX)
    c.ints("beta", n, -BETA_MAX, BETA_MAX)
    eps = c.int("eps", 0, 2**62)
    if is_narrow(ins, op.attrs):
        c.need(n**3 * 255**2 + eps < 2**62, f"row length {n} with eps {eps} overflows the int64 variance sum")
    else:
        c.need(n <= WIDE_MAX_N and eps < 2**61, f"row length {n} (at most {WIDE_MAX_N}) with eps {eps} (below 2^61) "
                                                  "overflows the int64 variance sum of a wide LAYERNORM")
    c.dt(out, OUT_DTYPES, "output")
    check_out(c, out.dtype, 1)
    return OUT_DTYPES, x.shape


OPS = (
    OpDef("LAYERNORM", 29, OpSchema(1, 2, {**IN_RQ_ATTRS, "gamma": AttrType.INTS, "beta": AttrType.INTS,
                                           "eps": AttrType.INT, **RQ_ATTRS, **OUT_ATTRS}), _infer,
          lambda op, args, graph, counts: layernorm([a if isinstance(a, np.ndarray) else a.data for a in args], op.attrs),
          "Layer normalization over the last axis of the sum of one or two rescaled inputs (I8/U8/I32): exact "
          "sums, integer sqrt, fixed-point quotient, affine, one stage (I8/U8, or I32: the wide output)."),
)

"""LAYERNORM: integer layer normalization over the last axis of an 8-bit input, then a
per-channel affine into the output grid (integer only, I-BERT style: exact sums, an
integer square root, a fixed-point quotient).

For a row of ``N`` codes ``x`` (the zero point cancels)::

    D_i = N·x_i - Σ_j x_j                 (= N·(x_i - mean), exact)
    W   = Σ_i D_i² + eps                  (int64; eps = round(N³·ε / s²), ε in codes)
    G   = (62 - bitlen(W)) // 2           (scales W to 61..62 bits: full precision)
    R   = isqrt(W · 4^G)                  (exact floor square root, R < 2^31)
    Z_i = round_half_away(D_i · 2^(G+16) / R)   (0 when R = 0)
    acc_i = Z_i · gamma_i + beta_i
    y_i = clamp(rescale(acc_i) + out_zp, out_min, out_max)

``Z_i = 2^16 · (x_i - mean) / (sqrt(N) · sqrt(var + ε))``: the normalized value divided
by ``sqrt(N)``, so ``|Z_i| <= 2^16 + 1`` (``D_i² <= W``).  ``gamma`` holds the affine
weight in codes of at most 14 bits, ``beta`` the bias in accumulator units (``|beta| <=
2^30``), so ``acc`` stays in int32; the rescale carries ``s_gamma · sqrt(N) / (2^16 · s_out)``.
``N³ · 255² + eps < 2^62`` bounds ``W``.
"""

from __future__ import annotations

import numpy as np

from qdsl.graph.checks import check_out
from qdsl.graph.ops import OpDef
from qdsl.graph.requant import apply_rescale
from qdsl.graph.schema import INT8_DTYPES, OUT_ATTRS, RQ_ATTRS, AttrType, OpSchema, OutputStage

__all__ = ["OPS", "layernorm", "isqrt", "LN_FRAC_BITS", "GAMMA_MAX", "BETA_MAX"]

LN_FRAC_BITS = 16
GAMMA_MAX = 2**14 - 1
BETA_MAX = 2**30


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


def layernorm(x: np.ndarray, a) -> np.ndarray:
    x = np.asarray(x, dtype=np.int64)
    n = x.shape[-1]
    d = n * x - x.sum(axis=-1, keepdims=True)
    w = (d * d).sum(axis=-1, keepdims=True) + a["eps"]
    g = (62 - _bitlen(w)) // 2
    r = isqrt(w << (2 * g))
    num = np.abs(d) << (g + LN_FRAC_BITS)
    safe = np.maximum(r, 1)
    z = np.where(r == 0, 0, np.sign(d) * ((2 * num + safe) // (2 * safe)))
    acc = z * np.asarray(a["gamma"], dtype=np.int64) + np.asarray(a["beta"], dtype=np.int64)
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(acc, st.rescale) + st.zero_point, st.qmin, st.qmax)


def _infer(c, op, ins, out):
    x = ins[0]
    c.dt(x, INT8_DTYPES, "input")
    c.need(len(x.shape) >= 2 and x.shape[-1] >= 1, f"input {x.name!r} needs a normalized axis, has shape {x.shape}")
    n = x.shape[-1]
    c.ints("gamma", n, -GAMMA_MAX, GAMMA_MAX)
    c.ints("beta", n, -BETA_MAX, BETA_MAX)
    eps = c.int("eps", 0, 2**62)
    c.need(n**3 * 255**2 + eps < 2**62, f"row length {n} with eps {eps} overflows the int64 variance sum")
    c.dt(out, INT8_DTYPES, "output")
    check_out(c, out.dtype, 1)
    return INT8_DTYPES, x.shape


OPS = (
    OpDef("LAYERNORM", 29, OpSchema(1, 1, {"gamma": AttrType.INTS, "beta": AttrType.INTS, "eps": AttrType.INT,
                                           **RQ_ATTRS, **OUT_ATTRS}), _infer,
          lambda op, args, graph, counts: layernorm(args[0], op.attrs),
          "Layer normalization over the last axis: exact sums, integer sqrt, fixed-point quotient, affine, one stage."),
)

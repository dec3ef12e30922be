"""A learned binarisation threshold in the integer graph.

A signed binary activation with ``threshold = learned`` (qdsl.quantizers.formats.binary)
gives code ``+1`` where its float input ``x >= t[c]`` and ``-1`` where ``x < t[c]`` (``c``
along axis 1; the tie ``x == t[c]`` is +1, as ``sign(0) = +1``).  The graph never sees
``x``: it holds the producer's integers, and every step from them to ``x`` is monotone,
so the comparison becomes one on integers, ``+1`` exactly where ``q >= k[c]``, with
``k[c]`` the smallest integer whose fake-quant value reaches ``t[c]``:

* an 8-bit value (an output/activation quantizer's codes, real ``(q - zp)·s``):
  ``k[c] = min{q : float32(q - zp)·float32(s) >= t[c]}`` over the code range, found by
  evaluating the fake quantizer's own binary32 product for every code (exact).  The graph
  op is BINARIZE_CHANNEL (``-1 if q < k[c] else +1``); ``k`` past the range (``qmax + 1``)
  is "always -1", ``qmin`` "always +1".
* a layer's accumulator (a conv/linear result read before any output quantizer, possibly
  through a ReLU/clamp ``[lo, hi]`` and max pools): the fake-quant value is ``v =
  float32(acc·s_acc[c] + b̂[c])`` (the frozen XNOR layer sums in binary64:
  qdsl.patch.layer), then the clamp.  ``clamp(v) >= t`` is "always" for ``t <= lo``,
  "never" for ``t > hi``, else ``v >= t``; ``k[c]`` starts at ``ceil((t - b̂)/s_acc)`` in
  exact rationals and is corrected by evaluating ``v`` at its neighbours (binary32
  rounding near ``t``).  The layer's bias becomes ``-k[c]`` and its BIN output rule
  ``-1 if acc < 0 else +1`` does the comparison: no extra op.  A max pool after the sign
  is the max of the signs (the comparison is monotone); a reshape must keep the channel
  axis.  For an integer (non-binary) layer the fake-quant model sums in binary32, not
  exactly: a value within a few float32 ulps of ``t[c]`` may land on the other side in the
  graph (the near-tie allowance of DESIGN.md §5 for float scales).
* a binary value (a binary layer's BIN output read by another thresholded quantizer): the
  codes are ``±α``; each channel's threshold must lie in ``(-α, α]`` (then the codes pass
  unchanged), else the channel would be constant and export refuses it.
* a concatenation along the channels: each part at its own channels' thresholds, then
  CONCAT of the signs (the U-Net's binary conv after a skip cat).
* the float graph input: refused (no integer op compares floats per channel); quantize
  the input to 8 bits first (xnor-binary keeps the first layer 8-bit).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from qdsl.graph.ir import DType, OpType
from qdsl.export.values import Builder, ExportError, QVal, Target

__all__ = ["channel_thresholds", "binarize_codes", "accumulator_threshold_bias", "check_channels"]


def channel_thresholds(proxy) -> tuple[float, ...] | None:
    """A frozen binary activation quantizer's learned thresholds (binary32 values), or None."""
    t = getattr(proxy, "sign_threshold", None)
    if t is None or t.numel() == 0:
        return None
    return tuple(float(v) for v in t.detach().float().reshape(-1).tolist())


def check_channels(t: Target, shape, origin: str) -> None:
    """The thresholds name one channel each of ``shape``'s axis 1."""
    if len(shape) < 2 or shape[1] != len(t.thresholds):
        raise ExportError(t.where, f"the learned threshold has {len(t.thresholds)} channels but the value it reads "
                                   f"(from '{origin}') has shape {tuple(shape)}",
                          "a threshold is per channel along axis 1 of the binarised tensor")


def binarize_codes(b: Builder, v: QVal, t: Target, lo: float = -math.inf, hi: float = math.inf) -> QVal:
    """``v`` (8-bit codes or BIN), clamped to ``[lo, hi]`` (a ReLU after a concat), binarised
    at ``t``'s learned thresholds (module doc)."""
    check_channels(t, v.shape, v.name)
    if v.dtype is DType.BIN:
        if lo != -math.inf or hi != math.inf:
            raise ExportError(t.where, "a learned threshold reads clamped binary codes", "binarise before the clamp")
        alpha = np.float32(v.scale)
        bad = [c for c, x in enumerate(t.thresholds) if not -alpha < np.float32(x) <= alpha]
        if bad:
            raise ExportError(t.where, f"a learned threshold outside (-α, α] = (-{float(alpha):g}, {float(alpha):g}] "
                                       f"reads binary codes: channel(s) {bad[:8]} would be constant",
                              "let the producer's output be int8 (an output quantizer), or binarise its input")
        return b.q(v.name, t.scale, 0, -1, 1, DType.BIN, v.shape)
    codes = np.arange(v.qmin, v.qmax + 1)
    vals = (codes - v.zp).astype(np.float32) * np.float32(v.scale)  # the fake quantizer's x̂, binary32
    k = []
    for x in t.thresholds:
        if np.float32(x) <= lo:
            k.append(v.qmin)  # clamp(x̂) >= lo >= t: always +1
            continue
        if np.float32(x) > hi:
            k.append(v.qmax + 1)  # never
            continue
        hit = np.nonzero(vals >= np.float32(x))[0]
        k.append(int(codes[hit[0]]) if hit.size else v.qmax + 1)
    name = b.op(OpType.BINARIZE_CHANNEL, t.where, [v.name], DType.BIN, v.shape, {"thresholds": tuple(k)})
    return b.q(name, t.scale, 0, -1, 1, DType.BIN, v.shape)


def _value(acc: int, s: float, bias: float) -> np.float32:
    # the frozen layer's output for accumulator ``acc``: binary64 sum, returned in binary32
    return np.float32(np.float64(acc) * np.float64(s) + np.float64(bias))


def accumulator_threshold_bias(t: Target, s_acc: np.ndarray, bias: np.ndarray | None, lo: float, hi: float,
                               acc_max: np.ndarray) -> np.ndarray:
    """int32 biases ``-k[c]``: ``acc - k[c] >= 0`` exactly where the clamped layer value
    reaches ``t[c]`` (module doc); ``acc_max[c]`` bounds ``|acc|`` (for always/never)."""
    out = []
    for c, (tc, s) in enumerate(zip(t.thresholds, np.asarray(s_acc, dtype=np.float64).reshape(-1))):
        m = int(acc_max[c])
        tf = np.float32(tc)
        b = float(np.float32(bias[c])) if bias is not None else 0.0
        if tf <= lo:
            out.append(m)  # clamp(v) >= lo >= t: always +1
            continue
        if tf > hi:
            out.append(-(m + 1))  # clamp(v) <= hi < t: always -1
            continue
        k0 = math.ceil((Fraction(float(tf)) - Fraction(b)) / Fraction(float(s)))
        k0 = min(max(k0, -m - 1), m + 2)
        # the smallest k with v(k) >= t near k0 (v is monotone in k)
        k = k0
        while k > -m - 1 and _value(k - 1, s, b) >= tf:
            k -= 1
        while k <= m and _value(k, s, b) < tf:
            k += 1
        out.append(min(max(-k, -(m + 1)), m))
    return np.asarray(out, dtype=np.int64)

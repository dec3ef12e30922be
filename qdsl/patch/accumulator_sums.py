"""The integer arithmetic of the accumulator simulation (:mod:`qdsl.patch.accumulate`).

Pure tensor functions, shared by the eager hook and the compiled one
(:mod:`qdsl.patch.accumulate_op`), so both take the same decision and compute the same bits:
the integer operands of a layer, the exact reachable sums of its weights, the bound that
bit widths and fan-in alone give (no weights read), and the exact wrapped/saturated output.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from qdsl.graph.ops.weighted import worst_case_range

__all__ = ["wrap_sum", "saturate_sum", "reachable", "fits", "channel_view", "operands", "width_bound",
           "bound_fits", "decide", "simulate", "EXACT_F64"]

EXACT_F64 = 1 << 53


def wrap_sum(s: torch.Tensor, bits: int) -> torch.Tensor:
    """Two's complement wrap of int64 ``s`` to ``bits`` (``bits >= 64``: unchanged)."""
    if bits >= 64:
        return s
    half = 1 << (bits - 1)
    return torch.remainder(s + half, 1 << bits) - half


def saturate_sum(s: torch.Tensor, bits: int) -> torch.Tensor:
    """``clamp(s, −2^(bits-1), 2^(bits-1) − 1)`` of int64 ``s``."""
    if bits >= 64:
        return s
    half = 1 << (bits - 1)
    return s.clamp(-half, half - 1)


def reachable(w_int: torch.Tensor, b_int: torch.Tensor | None,
              x_ranges: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel, the exact smallest and largest sum ``Σ w·x + b`` over every input
    code vector in the box (one ``(x_lo, x_hi)`` per candidate zero point): the sum is
    linear in ``x``, so its extremes are at vertices, taken element-wise (module doc of
    :mod:`qdsl.patch.accumulate`)."""
    w = w_int.reshape(w_int.shape[0], -1).to(torch.int64)
    pos = w.clamp(min=0).sum(1)
    neg = w.clamp(max=0).sum(1)
    b = b_int.to(torch.int64) if b_int is not None else torch.zeros_like(pos)
    his = [pos * xh + neg * xl + b for xl, xh in x_ranges]
    los = [pos * xl + neg * xh + b for xl, xh in x_ranges]
    return torch.stack(los).min(0).values, torch.stack(his).max(0).values


def fits(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Per channel: ``[lo, hi]`` inside the ``bits``-bit two's complement range."""
    half = 1 << (bits - 1)
    return (lo >= -half) & (hi <= half - 1)


def channel_view(t: torch.Tensor, ndim: int, axis: int) -> torch.Tensor:
    if t.numel() == 1:
        return t.reshape(())
    shape = [1] * ndim
    shape[axis] = -1
    return t.reshape(shape)


def operands(s_w: torch.Tensor, s_x: torch.Tensor, w_hat: torch.Tensor, b_hat: torch.Tensor | None,
             step: float) -> tuple:
    """``(w_int, b_int, s_x, s_acc)`` in binary64/int64 (module doc of :mod:`qdsl.patch.accumulate`)."""
    s_w64 = s_w.detach().double().reshape(-1) * step
    s_x64 = s_x.detach().double().reshape(())
    w_int = torch.round(w_hat.detach().double() / channel_view(s_w64, w_hat.dim(), 0))
    s_acc = s_x64 * s_w64  # [] or [C]
    b_int = None
    if b_hat is not None:
        b_int = torch.round(b_hat.detach().double() / s_acc).to(torch.int64)
        if s_acc.numel() == 1:
            s_acc = s_acc.expand(b_int.shape)
    return w_int, b_int, s_x64, s_acc


# The bound from bit widths and fan-in (no weight read).  Every weight code the weight
# quantizer can produce lies in the hull of its format's operand ranges (``w_q − z_w``; for
# an asymmetric quantizer the union over every zero point), every input code in the hull of
# the input's, and a sum has ``fan_in`` products, so (lint's worst case, exact over that box)
#
#     Σ w·x  ∈  [fan_in · min(corner products), fan_in · max(corner products)]  =:  [B_lo, B_hi]
#
# for *any* weights the quantizer can produce.  The exact per-channel extremes `reachable`
# computes lie inside it, so when [B_lo + min b, B_hi + max b] fits in P bits, the tight
# check would have found every channel safe as well: the decision is the same, only cheaper.
# Without a bias, B alone decides, at trace time: no check runs at all.
def width_bound(w_ranges: Sequence[tuple[int, int]], x_ranges: Sequence[tuple[int, int]],
                fan_in: int) -> tuple[int, int]:
    """``(B_lo, B_hi)``: every ``Σ w·x`` of ``fan_in`` products with codes in the ranges' hulls."""
    w = (min(r[0] for r in w_ranges), max(r[1] for r in w_ranges))
    x = (min(r[0] for r in x_ranges), max(r[1] for r in x_ranges))
    return worst_case_range(w, x, fan_in)


def bound_fits(bound: tuple[int, int], b_int: torch.Tensor | None, bits: int) -> bool:
    """The width bound plus the bias range inside ``bits`` (see :func:`width_bound`)."""
    half = 1 << (bits - 1)
    lo, hi = bound
    if b_int is not None and b_int.numel():
        lo, hi = lo + int(b_int.min()), hi + int(b_int.max())
    return lo >= -half and hi <= half - 1


def decide(w_int: torch.Tensor, b_int: torch.Tensor | None, x_ranges: Sequence[tuple[int, int]], bits: int,
           bound: tuple[int, int] | None) -> bool:
    """Can no input in range overflow the accumulator?  The bias against the width bound
    first (when given), then the exact per-channel extremes (both sound, the first implies
    the second, so the answer is the exact one)."""
    if bound is not None and bound_fits(bound, b_int, bits):
        return True
    lo, hi = reachable(w_int, b_int, x_ranges)
    return bool(fits(lo, hi, bits).all())


def simulate(sums: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], axis: int, x_hat: torch.Tensor,
             w_int: torch.Tensor, b_int: torch.Tensor | None, s_x64: torch.Tensor, s_acc: torch.Tensor,
             bits: int, saturate: bool, dtype: torch.dtype):
    """``(y, inside)``: the accumulator's output ``A · s_acc`` and where the exact sum stayed
    in range, or None when the sums may leave exact binary64 (not simulated).  ``sums`` is
    the layer's own linear/conv on binary64 integers; ``axis`` its output-channel axis
    (negative counts from the end)."""
    x_int = torch.round(x_hat.detach().double() / s_x64)
    wmax = float(w_int.abs().max()) if w_int.numel() else 0.0
    fan_in = w_int[0].numel()
    if wmax * float(x_int.abs().max()) * fan_in >= EXACT_F64:
        return None
    s = torch.round(sums(x_int, w_int)).to(torch.int64)
    axis = axis % s.dim()
    if b_int is not None:
        s = s + channel_view(b_int, s.dim(), axis)
    half = 1 << (bits - 1)
    inside = (s >= -half) & (s <= half - 1)
    a = saturate_sum(s, bits) if saturate else wrap_sum(s, bits)
    return (a.double() * channel_view(s_acc, a.dim(), axis)).to(dtype), inside

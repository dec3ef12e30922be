"""Bit-aware range search: pick the clipping range that minimises quantization error
at the *actual* integer grid, for weights (exact, per channel) and activations
(from a running histogram).

Every function here is pure torch, returns a ``(lo, hi)`` range with ``lo <= 0 <= hi``
(so zero is exactly representable), and never changes its inputs.  Observers call
these; the quantizers turn the range into a scale and zero point with
:func:`range_to_qparams`, which is the mapping the searches assume.

Range -> grid (:func:`range_to_qparams`)::

    symmetric, signed grid    s = max(|lo|, |hi|) / qmax      z = 0
    symmetric, unsigned grid  s = hi / qmax                   z = 0   (negatives clip to 0)
    asymmetric                s = (hi - lo) / (qmax - qmin)   z = clamp(qmin - round(lo / s), qmin, qmax)

and fake quantization is ``x̂ = (clamp(round(x / s) + z, qmin, qmax) - z) · s``.

Searches and their cost (``G`` = number of candidates, ``grid``):

* :func:`mse_range` (weights): candidate ranges are ``k/G`` (k = 1..G) of the min/max
  range of each channel, so ``k = G`` *is* min/max and the search never does worse
  than min/max on the searched tensor.  Each candidate fake-quantizes the whole tensor
  at the real grid (zero point rounded as the quantizer rounds it, multiplying by the
  reciprocal scale as the quantizer does) and scores ``sum |x - x̂|^p`` per channel;
  the arg-min is taken per channel.  :func:`mse_clip_ratio` returns the chosen ratio
  ``k/G`` per channel (what QAT carries, see ``observers.MseObserver``) and
  :func:`range_from_ratio` turns a ratio back into the range.  ``O(G · numel)`` work,
  vectorised over channels: rows are taken in cache-sized blocks and all candidates run
  over a block with in-place ops on one scratch buffer (``_candidate_errors``), so
  memory is ``O(numel)`` and each candidate costs a few in-cache passes
  (``benchmarks/ptq_resnet18.py`` times it on a torchvision-shaped ResNet-18).
* :func:`histogram_range` (activations): a running histogram (:class:`HistogramState`)
  of the raw values stands in for the data.  Each bin's mass sits at its centre; each
  candidate range is scored as ``sum_i mass_i · |c_i - x̂(c_i)|^p``, all candidates at
  once: ``O(G · bins)``.  The search knows the grid: an unsigned grid (post-ReLU data,
  ``qmin = 0``) searches ``[0, hi]``, a signed symmetric grid searches ``±a``, an
  asymmetric grid first shrinks both ends together, then refines the low and the high
  end separately (three 1-D passes instead of a ``G²`` 2-D search).  With ``joint=True``
  (what ``auto`` uses for activations below :data:`AUTO_JOINT_BELOW_BITS` bits, where
  each code is a large share of the range and the two ends interact through the zero
  point) an asymmetric grid searches ``(lo, hi)`` jointly instead: a ``33 × 32`` grid of
  ratios of the min/max ends (``lo`` ratio 0 included: a range starting at 0) on the
  histogram pooled to 256 bins, then a ``17 × 17`` grid one coarse step around the best
  pair (plus min/max) on the full one; ``O(300 · bins)``.  min/max itself is a
  candidate of the final pass, so the result is never worse than min/max on the histogram.
* :func:`percentile_range`: the range at a percentile of ``|x|`` (symmetric) or of
  ``x`` at both tails (asymmetric), read off the histogram's CDF with linear
  interpolation inside a bin; ``O(bins)``.

``pot=True`` restricts candidate scales to powers of two (``s = 2^round(log2 s)``,
as the ``pot`` scale rule rounds), so the search scores the grid that will really be
used, and the returned range is the one whose scale is exactly that power of two.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "range_to_qparams",
    "fake_quantize_range",
    "mse_range",
    "mse_clip_ratio",
    "range_from_ratio",
    "channel_minmax",
    "histogram_range",
    "percentile_range",
    "HistogramState",
    "histogram_observe",
    "histogram_merge",
    "auto_observer",
    "AUTO_SEARCH_BELOW_BITS",
    "AUTO_JOINT_BELOW_BITS",
]

AUTO_SEARCH_BELOW_BITS = 8
"""The ``auto`` observer searches ranges for quantizers narrower than this many bits."""

AUTO_JOINT_BELOW_BITS = 5
"""Below this many bits the ``auto`` observer searches an asymmetric activation range
jointly over (min, max) (``histogram_range(joint=True)``)."""

_JOINT_STEPS = 32  # coarse grid of the joint search, per end
_JOINT_REFINE = 8  # fine points per coarse step around the best pair
_JOINT_BINS = 256  # the coarse pass pools the histogram to this many bins

# Rows are searched in blocks of about this many elements (a 256 KiB float32 block plus
# its scratch buffer fit a 512 KiB L2 cache): see _candidate_errors.
_BLOCK_ELEMENTS = 1 << 15
_TINY = 1e-12


def _check_grid(qmin: int, qmax: int) -> None:
    if not qmax > qmin:
        raise ValueError(f"empty integer grid: qmin={qmin} must be < qmax={qmax}")
    if qmax <= 0:
        raise ValueError(f"qmax must be > 0, got {qmax}")


def _scale_zp(lo: torch.Tensor, hi: torch.Tensor, qmin: int, qmax: int, symmetric: bool):
    """Scale and zero point (float tensors, broadcast shape of lo/hi); see module doc."""
    lo = torch.clamp(lo, max=0.0)
    hi = torch.clamp(hi, min=0.0)
    if symmetric:
        if qmin < 0:
            amax = torch.maximum(-lo, hi)
        else:
            # A one-sided (unsigned symmetric) grid whose data all fell on the other side
            # (an SE fc1 whose outputs were all negative in calibration): every code is 0
            # whatever the scale, but the tiny floor made the integer graph's requant factor
            # s_acc / s absurd (E402 "factor 2.4e9 out of range").  The data's magnitude keeps
            # the same codes and a scale of the data's order.
            amax = torch.where(hi > 0, hi, -lo)
        scale = torch.clamp(amax / qmax, min=_TINY)
        zp = torch.zeros_like(scale)
    else:
        scale = torch.clamp((hi - lo) / (qmax - qmin), min=_TINY)
        zp = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    return scale, zp


def range_to_qparams(lo, hi, qmin: int, qmax: int, *, symmetric: bool):
    """``(scale, zero_point)`` for a range on the grid ``qmin..qmax`` (the mapping every
    search here assumes).  Zero ranges get a tiny positive scale, never 0; an unsigned
    symmetric grid given only negative data takes its scale from their magnitude.

    >>> s, z = range_to_qparams(torch.tensor(-1.0), torch.tensor(2.0), -8, 7, symmetric=True)
    >>> round(float(s), 4), float(z)
    (0.2857, 0.0)
    >>> s, z = range_to_qparams(torch.tensor(-1.0), torch.tensor(2.0), 0, 15, symmetric=False)
    >>> round(float(s), 4), float(z)
    (0.2, 5.0)
    """
    _check_grid(qmin, qmax)
    lo = torch.as_tensor(lo, dtype=torch.float32)
    hi = torch.as_tensor(hi, dtype=torch.float32)
    return _scale_zp(lo, hi, qmin, qmax, symmetric)


def _fq(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    # multiply by the reciprocal, as the quantizers (functional.fake_quant_affine) do
    return (torch.clamp(torch.round(x * (torch.ones_like(scale) / scale)) + zp, qmin, qmax) - zp) * scale


def fake_quantize_range(x, lo, hi, qmin: int, qmax: int, *, symmetric: bool, axis: int | None = None):
    """Fake-quantize ``x`` on the grid that ``(lo, hi)`` maps to (per channel along
    ``axis`` when given).  The reference the searches are scored against.

    >>> fake_quantize_range(torch.tensor([0.1, 0.26, 5.0]), -1.0, 1.0, -2, 1, symmetric=True)
    tensor([0., 0., 1.])
    """
    x = torch.as_tensor(x)
    scale, zp = range_to_qparams(lo, hi, qmin, qmax, symmetric=symmetric)
    if axis is not None:
        shape = [1] * x.dim()
        shape[axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    return _fq(x, scale, zp, qmin, qmax)


def _pot(scale: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.round(torch.log2(torch.clamp(scale, min=_TINY))))


def _range_from_scale(scale, zp, qmin: int, qmax: int, symmetric: bool):
    """The range whose qparams are exactly ``(scale, zp)`` (used when scales are pot)."""
    if symmetric:
        hi = scale * qmax
        lo = -hi if qmin < 0 else torch.zeros_like(hi)
        return lo, hi
    return (qmin - zp) * scale, (qmax - zp) * scale


def _flatten_channels(x: torch.Tensor, axis: int | None) -> torch.Tensor:
    if axis is None:
        return x.reshape(1, -1)
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} out of range for a tensor of shape {tuple(x.shape)}")
    return x.movedim(axis, 0).reshape(x.shape[axis], -1)


def _ratios(grid: int, device) -> torch.Tensor:
    if grid < 1:
        raise ValueError(f"grid must be >= 1, got {grid}")
    return torch.arange(1, grid + 1, dtype=torch.float32, device=device) / grid


def _pick(err: torch.Tensor) -> torch.Tensor:
    """Arg-min over the last dim (candidates in increasing range order), preferring the
    *widest* range among exact ties so flat errors never clip needlessly."""
    n = err.shape[-1]
    return n - 1 - torch.argmin(err.flip(-1), dim=-1)


def channel_minmax(xc: torch.Tensor, symmetric: bool, qmin: int):
    """Per-row ``(lo0, hi0)`` of a ``(C, N)`` tensor: the min/max range (containing 0;
    ``lo0 = 0`` on an unsigned symmetric grid) every search candidate is a ratio of."""
    if xc.shape[1] == 0:
        z = torch.zeros(xc.shape[0], dtype=xc.dtype, device=xc.device)
        return z, z.clone()
    lo0 = torch.clamp(xc.amin(dim=1), max=0.0)
    hi0 = torch.clamp(xc.amax(dim=1), min=0.0)
    if symmetric and qmin >= 0:  # an unsigned symmetric grid: negatives clip to 0 whatever lo is
        lo0 = torch.zeros_like(lo0)
    return lo0, hi0


def _candidate_qparams(lo, hi, qmin: int, qmax: int, symmetric: bool, pot: bool):
    """Scale and zero point of ranges ``(lo, hi)`` as the quantizer will use them
    (scale snapped to a power of two and the zero point re-derived when ``pot``)."""
    scale, zp = _scale_zp(lo, hi, qmin, qmax, symmetric)
    if pot:
        scale = _pot(scale)
        if not symmetric:
            zp = torch.clamp(qmin - torch.round(torch.clamp(lo, max=0.0) / scale), qmin, qmax)
    return scale, zp


def _candidate_errors(xc, lo0, hi0, ratios, qmin, qmax, symmetric, norm, pot) -> torch.Tensor:
    """``(C, G)``: the Lp norm of ``x - x̂`` per row of ``xc`` for each candidate ratio.

    Cost model (why it is written this way): the work is ``G`` fake quantizations of the
    whole tensor, so what matters is the cost per element per candidate.  Rows are taken
    in blocks of about ``_BLOCK_ELEMENTS`` (a block and its scratch buffer stay in the L2
    cache while all ``G`` candidates run over it), every step is an in-place op on one
    scratch buffer (no allocation per candidate), the zero point folds into the clamp
    bounds (``clamp(round(v) + z, qmin, qmax) - z == clamp(round(v), qmin - z, qmax - z)``
    exactly for integers below 2^24), and the reduction is ``vector_norm`` (monotone in
    ``sum |d|^p``, so the arg-min is the same).  The loop is over blocks and candidates,
    never over channels.
    """
    n_ch, n = xc.shape
    g = len(ratios)
    scale, zp = _candidate_qparams(lo0.unsqueeze(0) * ratios.unsqueeze(1), hi0.unsqueeze(0) * ratios.unsqueeze(1),
                                   qmin, qmax, symmetric, pot)  # (G, C)
    inv = torch.ones_like(scale) / scale  # the quantizer multiplies by the reciprocal
    err = torch.empty(n_ch, g, dtype=torch.float32, device=xc.device)
    rows = max(1, _BLOCK_ELEMENTS // max(1, n))
    for r0 in range(0, n_ch, rows):
        xb = xc[r0 : r0 + rows]
        buf = torch.empty_like(xb)
        sb, ib, zb = scale[:, r0 : r0 + rows, None], inv[:, r0 : r0 + rows, None], zp[:, r0 : r0 + rows, None]
        for k in range(g):
            torch.mul(xb, ib[k], out=buf)
            buf.round_()
            if symmetric:
                buf.clamp_(qmin, qmax)
            else:
                buf.clamp_(qmin - zb[k], qmax - zb[k])
            buf.mul_(sb[k])
            buf.sub_(xb)
            err[r0 : r0 + rows, k] = torch.linalg.vector_norm(buf, ord=norm, dim=1)
    return err


def mse_clip_ratio(
    x: torch.Tensor,
    qmin: int,
    qmax: int,
    *,
    symmetric: bool,
    axis: int | None = None,
    grid: int = 100,
    norm: float = 2.0,
    pot: bool = False,
) -> torch.Tensor:
    """The clip ratio (``k/grid``, shape ``(C,)`` along ``axis`` or 0-d) that
    :func:`mse_range` picks: its range is ``ratio ×`` the min/max range of each channel
    (:func:`range_from_ratio`).  QAT carries this ratio instead of searching every step.

    >>> w = torch.tensor([[0.1, -0.2, 4.0], [1.0, -1.0, 0.5]])
    >>> mse_clip_ratio(w, -1, 1, symmetric=True, axis=0, grid=4).tolist()
    [1.0, 0.75]
    """
    _check_grid(qmin, qmax)
    if norm <= 0:
        raise ValueError(f"norm must be > 0, got {norm}")
    x = torch.as_tensor(x).detach().to(torch.float32)
    xc = _flatten_channels(x, axis).contiguous()  # (C, N)
    lo0, hi0 = channel_minmax(xc, symmetric, qmin)
    ratios = _ratios(grid, x.device)
    best = ratios[_pick(_candidate_errors(xc, lo0, hi0, ratios, qmin, qmax, symmetric, norm, pot))]
    return best[0] if axis is None else best


def range_from_ratio(lo0, hi0, ratio, qmin: int, qmax: int, *, symmetric: bool, pot: bool = False):
    """The range ``ratio × (lo0, hi0)`` as the searches return it: with ``pot``, the range
    whose scale is exactly the power of two the quantizer will use.  ``(lo0, hi0)`` is a
    min/max range (any shape, ``lo0 <= 0 <= hi0``).

    >>> [float(v) for v in range_from_ratio(torch.tensor(-2.0), torch.tensor(4.0), 0.5, -7, 7, symmetric=True)]
    [-1.0, 2.0]
    """
    lo, hi = lo0 * ratio, hi0 * ratio
    if pot:
        scale, zp = _candidate_qparams(lo, hi, qmin, qmax, symmetric, True)
        lo, hi = _range_from_scale(scale, zp, qmin, qmax, symmetric)
    return lo, hi


def mse_range(
    x: torch.Tensor,
    qmin: int,
    qmax: int,
    *,
    symmetric: bool,
    axis: int | None = None,
    grid: int = 100,
    norm: float = 2.0,
    pot: bool = False,
):
    """The clipping range minimising ``sum |x - x̂|^norm`` at the grid ``qmin..qmax``,
    per channel along ``axis`` (shape ``(C,)``) or per tensor (0-d tensors).

    Candidates are ``k/grid`` of each channel's min/max range (``k = grid`` is
    min/max itself), so the result's error never exceeds min/max's.

    >>> g = torch.Generator().manual_seed(0)
    >>> w = torch.randn(4, 256, generator=g)
    >>> lo, hi = mse_range(w, -4, 3, symmetric=True, axis=0)
    >>> bool((hi < w.abs().amax(1)).all()), tuple(hi.shape)
    (True, (4,))
    """
    ratio = mse_clip_ratio(x, qmin, qmax, symmetric=symmetric, axis=axis, grid=grid, norm=norm, pot=pot)
    xc = _flatten_channels(torch.as_tensor(x).detach().to(torch.float32), axis)
    lo0, hi0 = channel_minmax(xc, symmetric, qmin)
    if axis is None:
        lo0, hi0 = lo0[0], hi0[0]
    return range_from_ratio(lo0, hi0, ratio, qmin, qmax, symmetric=symmetric, pot=pot)


# --------------------------------------------------------------------- histograms


class HistogramState(NamedTuple):
    """A histogram of raw values over ``[lo, hi]`` (``lo <= 0 <= hi``) in ``len(hist)``
    equal bins; ``hist`` holds float64 masses (counts).  Observers keep the three
    fields in buffers and pass them back in to accumulate across batches."""

    hist: torch.Tensor
    lo: float
    hi: float

    @classmethod
    def empty(cls, bins: int = 2048) -> "HistogramState":
        if bins < 1:
            raise ValueError(f"bins must be >= 1, got {bins}")
        return cls(torch.zeros(bins, dtype=torch.float64), 0.0, 0.0)

    @property
    def total(self) -> float:
        return float(self.hist.sum())

    def edges(self) -> torch.Tensor:
        return torch.linspace(self.lo, self.hi, len(self.hist) + 1, dtype=torch.float64)

    def centres(self) -> torch.Tensor:
        e = self.edges()
        return (e[:-1] + e[1:]) / 2


def _cdf(state: HistogramState, points: torch.Tensor) -> torch.Tensor:
    """Mass at or below each point, assuming mass is uniform inside each bin."""
    hist = state.hist.to(torch.float64)
    points = points.to(torch.float64)
    if state.hi <= state.lo:  # zero-width histogram: all mass sits at lo
        return torch.where(points >= state.lo, hist.sum(), torch.zeros((), dtype=torch.float64))
    bins = len(hist)
    pos = (points - state.lo) / (state.hi - state.lo) * bins  # in bin units
    pos = torch.clamp(pos, 0.0, float(bins))
    idx = torch.clamp(pos.floor().long(), max=bins - 1)
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(hist, 0)])
    return cum[idx] + hist[idx] * (pos - idx.to(torch.float64))


def _rebin(state: HistogramState, lo: float, hi: float, bins: int) -> torch.Tensor:
    if state.hi <= state.lo:  # a point mass: it goes to the one bin that holds it
        k = min(max(int((state.lo - lo) / (hi - lo) * bins), 0), bins - 1)
        return state.hist.sum() * (torch.arange(bins) == k).to(torch.float64)
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    return torch.diff(_cdf(state, edges))


def histogram_merge(a: HistogramState, b: HistogramState) -> HistogramState:
    """One histogram covering both (range = union, ``len(a.hist)`` bins); mass is
    re-spread assuming it is uniform inside each old bin, so totals are preserved."""
    if b.total == 0:
        return a
    if a.total == 0:
        if len(b.hist) == len(a.hist):
            return b
        return HistogramState(_rebin(b, b.lo, b.hi, len(a.hist)), b.lo, b.hi)
    lo, hi, bins = min(a.lo, b.lo), max(a.hi, b.hi), len(a.hist)
    if hi <= lo:
        return HistogramState(a.hist + b.hist.sum() * (torch.arange(bins) == 0), lo, hi)
    ha = a.hist if (a.lo, a.hi) == (lo, hi) else _rebin(a, lo, hi, bins)
    return HistogramState(ha + _rebin(b, lo, hi, bins), lo, hi)


def histogram_observe(state: HistogramState | None, x: torch.Tensor, bins: int = 2048) -> HistogramState:
    """Add the finite values of ``x`` to ``state`` (a new histogram of ``bins`` bins when
    ``state`` is None), growing its range to cover them (always including 0).

    >>> s = histogram_observe(None, torch.tensor([0.5, 1.0]), bins=4)
    >>> s.lo, s.hi, s.hist.tolist()
    (0.0, 1.0, [0.0, 0.0, 1.0, 1.0])
    >>> s = histogram_observe(s, torch.tensor([-1.0]))
    >>> s.lo, s.hi, s.total
    (-1.0, 1.0, 3.0)
    """
    if state is None:
        state = HistogramState.empty(bins)
    x = torch.as_tensor(x).detach().reshape(-1).to(torch.float64)
    x = x[torch.isfinite(x)]
    if x.numel() == 0:
        return state
    bins = len(state.hist)
    xlo, xhi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    lo, hi = (xlo, xhi) if state.total == 0 else (min(state.lo, xlo), max(state.hi, xhi))
    if hi <= lo:  # only zeros so far
        return HistogramState(state.hist + x.numel() * (torch.arange(bins) == 0), lo, hi)
    base = state.hist
    if state.total > 0 and (state.lo, state.hi) != (lo, hi):
        base = _rebin(state, lo, hi, bins)
    elif state.total == 0:
        base = torch.zeros(bins, dtype=torch.float64)
    new = torch.histc(x, bins=bins, min=lo, max=hi)
    return HistogramState(base + new.to(torch.float64), lo, hi)


def _hist_error(c, m, scale, zp, qmin, qmax, norm):
    """Sum over bins of mass · |c - x̂(c)|^norm for each candidate row of scale/zp."""
    xq = _fq(c.unsqueeze(0), scale.unsqueeze(1), zp.unsqueeze(1), qmin, qmax)
    return ((xq - c.unsqueeze(0)).abs().pow(norm) * m.unsqueeze(0)).sum(dim=1)


def histogram_range(
    hist,
    lo: float,
    hi: float,
    qmin: int,
    qmax: int,
    *,
    symmetric: bool,
    signed: bool,
    norm: float = 2.0,
    grid: int = 100,
    pot: bool = False,
    joint: bool = False,
):
    """The activation range minimising the histogram-estimated ``E|x - x̂|^norm`` at the
    grid ``qmin..qmax`` (``signed`` must agree with ``qmin < 0``).  Returns 0-d tensors.
    ``joint``: search an asymmetric range over (lo, hi) jointly (module docstring);
    ignored for symmetric grids (one end decides) and pot scales.

    >>> g = torch.Generator().manual_seed(0)
    >>> s = histogram_observe(None, torch.relu(torch.randn(10000, generator=g)))
    >>> lo, hi = histogram_range(s.hist, s.lo, s.hi, 0, 7, symmetric=True, signed=False)
    >>> float(lo), 1.0 < float(hi) < s.hi
    (0.0, True)
    """
    _check_grid(qmin, qmax)
    if signed != (qmin < 0):
        raise ValueError(f"signed={signed} disagrees with the grid {qmin}..{qmax}")
    state = HistogramState(torch.as_tensor(hist, dtype=torch.float64), float(lo), float(hi))
    zero = torch.zeros((), dtype=torch.float32)
    if state.total == 0 or state.hi <= state.lo:
        return zero + min(state.lo, 0.0), zero + max(state.hi, 0.0)
    c = state.centres().to(torch.float32)
    m = (state.hist / state.total).to(torch.float32)
    ratios = _ratios(grid, c.device)
    lo0, hi0 = torch.tensor(min(state.lo, 0.0)), torch.tensor(max(state.hi, 0.0))
    if symmetric and not signed:  # an unsigned symmetric grid: negatives clip to 0 whatever lo is
        if hi0 <= 0:  # nothing on the grid's side: every code is 0; _scale_zp scales by |lo|
            return zero + lo0, zero
        lo0 = torch.zeros(())

    def search(lo_c: torch.Tensor, hi_c: torch.Tensor):
        scale, zp = _scale_zp(lo_c, hi_c, qmin, qmax, symmetric)
        if pot:
            scale = _pot(scale)
            if not symmetric:
                zp = torch.clamp(qmin - torch.round(lo_c / scale), qmin, qmax)
        k = int(_pick(_hist_error(c, m, scale, zp, qmin, qmax, norm)))
        return lo_c[k], hi_c[k], scale[k], zp[k]

    if joint and not symmetric and not pot:
        return _joint_search(c, m, lo0, hi0, qmin, qmax, norm)

    # Pass 1: shrink both ends together (for a symmetric or unsigned grid this is the
    # whole search: only max(|lo|, hi), resp. hi, matters).
    best_lo, best_hi, scale, zp = search(lo0 * ratios, hi0 * ratios)
    if not symmetric:
        # Passes 2-3: refine each end with the other fixed (skewed data).
        if lo0 < 0:
            best_lo, best_hi, scale, zp = search(lo0 * ratios, best_hi.expand(grid))
        if hi0 > 0:
            best_lo, best_hi, scale, zp = search(best_lo.expand(grid), hi0 * ratios)
    if pot:
        return _range_from_scale(scale, zp, qmin, qmax, symmetric)
    return best_lo, best_hi


def _joint_search(c, m, lo0, hi0, qmin: int, qmax: int, norm: float):
    """Best asymmetric ``(lo, hi)`` over a coarse then a fine 2-D grid of end ratios.

    The coarse pass scores ~1000 pairs on the histogram pooled to :data:`_JOINT_BINS`
    bins (a coarse pass needs only the shape), the fine pass ~1000 pairs one coarse step
    around the winner on the full histogram, so the search costs about as much as two
    1-D passes over the full one."""

    def best(a: torch.Tensor, b: torch.Tensor, c, m):
        lo = (lo0 * a).unsqueeze(1).expand(len(a), len(b)).reshape(-1)
        hi = (hi0 * b).unsqueeze(0).expand(len(a), len(b)).reshape(-1)
        scale, zp = _scale_zp(lo, hi, qmin, qmax, False)
        err = _hist_error(c, m, scale, zp, qmin, qmax, norm)
        k = int(_pick(err))  # ties: the last candidate (widest hi, then widest lo)
        return k // len(b), k % len(b), lo[k], hi[k]

    n = _JOINT_STEPS
    pool = max(1, len(c) // _JOINT_BINS)
    if pool > 1 and len(c) % pool == 0:
        cc, mc = c.reshape(-1, pool).mean(1), m.reshape(-1, pool).sum(1)
    else:
        cc, mc = c, m
    a = torch.arange(0, n + 1, dtype=torch.float32) / n  # lo ratio 0 = a range starting at 0
    b = torch.arange(1, n + 1, dtype=torch.float32) / n
    i, j, _, _ = best(a, b, cc, mc)
    fine = torch.arange(-_JOINT_REFINE, _JOINT_REFINE + 1, dtype=torch.float32) / (_JOINT_REFINE * n)
    a2 = torch.unique(torch.clamp(a[i] + fine, 0.0, 1.0))
    b2 = torch.unique(torch.clamp(b[j] + fine, 1.0 / (_JOINT_REFINE * n), 1.0))
    if float(a2[-1]) < 1.0:  # min/max stays a candidate: never worse than min/max
        a2 = torch.cat([a2, torch.ones(1)])
    if float(b2[-1]) < 1.0:
        b2 = torch.cat([b2, torch.ones(1)])
    _, _, lo, hi = best(a2, b2, c, m)
    return lo, hi


def _f32(v) -> torch.Tensor:
    return torch.tensor(float(v), dtype=torch.float32)


def percentile_range(hist, lo: float, hi: float, percentile: float, *, symmetric: bool):
    """The range at ``percentile`` (0-100]: symmetric -> ``±t`` with ``P(|x| <= t) =
    p``; asymmetric -> the ``(100-p)`` and ``p`` percentiles of ``x`` (ends clamped so
    the range contains 0).  Returns 0-d tensors.

    >>> s = histogram_observe(None, torch.linspace(-1, 1, 10001))
    >>> [round(float(v), 2) for v in percentile_range(s.hist, s.lo, s.hi, 90.0, symmetric=True)]
    [-0.9, 0.9]
    """
    if not 0.0 < percentile <= 100.0:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    state = HistogramState(torch.as_tensor(hist, dtype=torch.float64), float(lo), float(hi))
    total = state.total
    if total == 0 or state.hi <= state.lo:
        return _f32(min(state.lo, 0.0)), _f32(max(state.hi, 0.0))
    q = percentile / 100.0
    n = 4 * len(state.hist) + 1  # threshold resolution: a quarter bin
    if symmetric:
        amax = max(-state.lo, state.hi)
        t = torch.linspace(0.0, amax, n, dtype=torch.float64)
        mass = (_cdf(state, t) - _cdf(state, -t)) / total  # P(|x| <= t), nondecreasing
        a = t[min(int(torch.searchsorted(mass, torch.tensor(q - 1e-12, dtype=torch.float64))), n - 1)]
        return _f32(-a), _f32(a)
    t = torch.linspace(state.lo, state.hi, n, dtype=torch.float64)
    cdf = _cdf(state, t) / total
    i_hi = min(int(torch.searchsorted(cdf, torch.tensor(q - 1e-12, dtype=torch.float64))), n - 1)
    i_lo = max(int(torch.searchsorted(cdf, torch.tensor(1.0 - q, dtype=torch.float64), right=True)) - 1, 0)
    return _f32(min(float(t[i_lo]), 0.0)), _f32(max(float(t[i_hi]), 0.0))


def auto_observer(params, ctx):
    """The ``auto`` observer (registry factory ``(params, ctx)``): min/max at 8 bits and
    above, where clipping buys almost nothing, and the bit-aware search below - the exact
    per-channel :func:`mse_range` for weights, the histogram search for activations
    (``MseObserver``).  ``params`` is an ``MseParams`` (norm, grid)."""
    from qdsl.quantizers.observers import MinMaxObserver, MseObserver  # observers import this module

    if ctx.recipe.bits >= AUTO_SEARCH_BELOW_BITS:
        return MinMaxObserver(None, ctx)
    obs = MseObserver(params, ctx)
    obs.joint = ctx.recipe.bits < AUTO_JOINT_BELOW_BITS
    return obs

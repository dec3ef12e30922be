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
  at the real grid (zero point rounded as the quantizer rounds it) and scores
  ``sum |x - x̂|^p`` per channel; the arg-min is taken per channel.  Vectorised over
  channels and over chunks of candidates: ``O(G · numel)`` work and
  ``O(chunk · numel)`` memory (chunks bounded to ~4M elements).  A 32×32×3×3 conv at
  G = 100 takes about a millisecond.
* :func:`histogram_range` (activations): a running histogram (:class:`HistogramState`)
  of the raw values stands in for the data.  Each bin's mass sits at its centre; each
  candidate range is scored as ``sum_i mass_i · |c_i - x̂(c_i)|^p``, all candidates at
  once: ``O(G · bins)``.  The search knows the grid: an unsigned grid (post-ReLU data,
  ``qmin = 0``) searches ``[0, hi]``, a signed symmetric grid searches ``±a``, an
  asymmetric grid first shrinks both ends together, then refines the low and the high
  end separately (three 1-D passes instead of a ``G²`` 2-D search).
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
    "histogram_range",
    "percentile_range",
    "HistogramState",
    "histogram_observe",
    "histogram_merge",
    "auto_observer",
    "AUTO_SEARCH_BELOW_BITS",
]

AUTO_SEARCH_BELOW_BITS = 8
"""The ``auto`` observer searches ranges for quantizers narrower than this many bits."""

# Candidate evaluation is chunked so a big weight never needs G copies in memory.
_CHUNK_ELEMENTS = 1 << 22
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
        amax = torch.maximum(-lo, hi) if qmin < 0 else hi
        scale = torch.clamp(amax / qmax, min=_TINY)
        zp = torch.zeros_like(scale)
    else:
        scale = torch.clamp((hi - lo) / (qmax - qmin), min=_TINY)
        zp = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    return scale, zp


def range_to_qparams(lo, hi, qmin: int, qmax: int, *, symmetric: bool):
    """``(scale, zero_point)`` for a range on the grid ``qmin..qmax`` (the mapping every
    search here assumes).  Zero ranges get a tiny positive scale, never 0.

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
    return (torch.clamp(torch.round(x / scale) + zp, qmin, qmax) - zp) * scale


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
    _check_grid(qmin, qmax)
    if norm <= 0:
        raise ValueError(f"norm must be > 0, got {norm}")
    x = torch.as_tensor(x).detach().to(torch.float32)
    xc = _flatten_channels(x, axis)  # (C, N)
    lo0 = torch.clamp(xc.amin(dim=1), max=0.0) if xc.shape[1] else torch.zeros(xc.shape[0])
    hi0 = torch.clamp(xc.amax(dim=1), min=0.0) if xc.shape[1] else torch.zeros(xc.shape[0])
    if symmetric and qmin >= 0:  # an unsigned symmetric grid: negatives clip to 0 whatever lo is
        lo0 = torch.zeros_like(lo0)
    ratios = _ratios(grid, x.device)
    n_ch, n = xc.shape
    chunk = max(1, _CHUNK_ELEMENTS // max(1, n_ch * n))
    errs = []
    for start in range(0, grid, chunk):
        r = ratios[start : start + chunk].unsqueeze(1)  # (g, 1)
        scale, zp = _scale_zp(lo0 * r, hi0 * r, qmin, qmax, symmetric)  # (g, C)
        if pot:
            scale = _pot(scale)
            if not symmetric:
                zp = torch.clamp(qmin - torch.round(lo0 * r / scale), qmin, qmax)
        xq = _fq(xc.unsqueeze(0), scale.unsqueeze(-1), zp.unsqueeze(-1), qmin, qmax)
        errs.append((xq - xc.unsqueeze(0)).abs().pow(norm).sum(dim=-1))  # (g, C)
    err = torch.cat(errs, dim=0).T  # (C, G)
    best = ratios[_pick(err)]  # (C,)
    lo, hi = lo0 * best, hi0 * best
    if pot:
        scale, zp = _scale_zp(lo, hi, qmin, qmax, symmetric)
        scale = _pot(scale)
        if not symmetric:
            zp = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
        lo, hi = _range_from_scale(scale, zp, qmin, qmax, symmetric)
    if axis is None:
        return lo[0], hi[0]
    return lo, hi


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
):
    """The activation range minimising the histogram-estimated ``E|x - x̂|^norm`` at the
    grid ``qmin..qmax`` (``signed`` must agree with ``qmin < 0``).  Returns 0-d tensors.

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
        lo0 = torch.zeros(())

    def search(lo_c: torch.Tensor, hi_c: torch.Tensor):
        scale, zp = _scale_zp(lo_c, hi_c, qmin, qmax, symmetric)
        if pot:
            scale = _pot(scale)
            if not symmetric:
                zp = torch.clamp(qmin - torch.round(lo_c / scale), qmin, qmax)
        k = int(_pick(_hist_error(c, m, scale, zp, qmin, qmax, norm)))
        return lo_c[k], hi_c[k], scale[k], zp[k]

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
    return MseObserver(params, ctx)

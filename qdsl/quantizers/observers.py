"""Built-in observers: statistics of a tensor -> a clipping range ``(lo, hi)``.

Every observer follows the protocol in :mod:`qdsl.quantizers.parts`: ``forward(x)``
accumulates (``x`` is detached), ``reset()``, ``observed``, ``range()``.  Statistics are
kept per *slot* (one slot per tensor, channel or group, see ``functional.reduce_view``)
in buffers, so ``state_dict()`` carries them; buffers are sized on the first
observation and :class:`LazyBuffers` resizes them when a state dict is loaded into a
fresh observer.

=============  ==================================================================
minmax         running min / max
ema            exponential moving average of per-batch min / max (first batch sets it)
mean_abs       ``±mean|x|`` (XNOR-Net's α for binary, TWN's starting point)
histogram      running histogram; ``percentile`` clips there, otherwise the
               bit-aware MSE search of :func:`range_search.histogram_range`
percentile     histogram clipped at ``percentile`` of ``|x|`` (or of ``x`` at both tails)
mse            weights / dynamic: exact per-slot search :func:`range_search.mse_clip_ratio`,
               kept as a clip ratio that QAT carries (see :class:`MseObserver`);
               static activations: histogram search
=============  ==================================================================

Non-finite values (NaN, ±inf) are left out of every statistic: a range covers the
finite values only (a slot with none gets ``(0, 0)``), so one bad calibration sample
cannot turn a scale into NaN or inf.  Quantizing them is the proxies' policy
(:mod:`qdsl.quantizers.functional`).

The searches live in :mod:`qdsl.quantizers.range_search` (owned by the PTQ-accuracy
work); these classes only keep the statistics and call them.
"""

from __future__ import annotations

import torch
from torch import nn

from qdsl.quantizers import functional as F
from qdsl.quantizers import range_search as RS
from qdsl.spec.model import Role

__all__ = [
    "LazyBuffers",
    "Observer",
    "MinMaxObserver",
    "EmaObserver",
    "MeanAbsObserver",
    "HistogramObserver",
    "PercentileObserver",
    "MseObserver",
]


class LazyBuffers(nn.Module):
    """Buffers whose shape is only known after the first tensor is seen: loading a state
    dict resizes them to the saved shape instead of failing with a size mismatch."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name, buf in list(self._buffers.items()):
            saved = state_dict.get(prefix + name)
            if buf is not None and saved is not None and saved.shape != buf.shape:
                self._buffers[name] = torch.empty(saved.shape, dtype=buf.dtype, device=buf.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _empty(dtype=torch.float32) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)


class Observer(LazyBuffers):
    """Base: keeps ``params`` and the :class:`~qdsl.quantizers.parts.PartContext`.

    Subclasses implement ``forward``, ``range`` and list their buffers in ``_state``
    (reset empties them; ``observed`` is true once the first is non-empty).
    """

    _state: tuple[str, ...] = ()

    def __init__(self, params, ctx):
        super().__init__()
        self.params = params
        self.ctx = ctx
        for name in self._state:
            self.register_buffer(name, _empty(torch.float64 if name.startswith("hist") else torch.float32))

    @property
    def observed(self) -> bool:
        return getattr(self, self._state[0]).numel() > 0

    def traced_range(self, x: torch.Tensor, training: bool):
        """``(lo, hi)`` of a stateless quantizer's tensor ``x`` alone (the observer is reset
        for every tensor) in tensor ops only, for a compiled forward; None: this observer
        cannot (the proxy observes eagerly, a graph break).  ``training``: a training
        forward (as ``training_forward``).  Touches no Python-side state."""
        return None

    @staticmethod
    def _finite_minmax(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_minmax` without its data-dependent branch (one masked pass; a slot with
        no finite value gets ``(0, 0)``), for traced code."""
        ok = torch.isfinite(rows)
        lo = torch.where(ok, rows, torch.inf).amin(dim=1)
        hi = torch.where(ok, rows, -torch.inf).amax(dim=1)
        none = ~ok.any(dim=1)
        return lo.masked_fill(none, 0.0), hi.masked_fill(none, 0.0)

    def cached_training_forward(self) -> None:
        """A training forward whose tensor is the one this observer saw last (the proxy's
        "same tensor, unchanged" cache skipped the observation).  Observers that count
        training forwards count it here, so the count does not depend on the cache (a
        deep copy or an unpickled model starts with an empty one)."""

    def reset(self) -> None:
        for name in self._state:
            buf = getattr(self, name)
            self._buffers[name] = torch.empty(0, dtype=buf.dtype, device=buf.device)

    def _rows(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        """``x`` as ``[P, N]`` rows (one per slot) and the slots' shape."""
        shape = self.ctx.param_shape(tuple(x.shape))
        return F.reduce_view(x.detach().float(), self.ctx.axis, self.ctx.group_size), shape

    @staticmethod
    def _minmax(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row min and max of the finite values (the masked pass only when needed)."""
        lo, hi = rows.amin(dim=1), rows.amax(dim=1)
        if bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all()):
            return lo, hi
        ok = torch.isfinite(rows)
        lo = torch.where(ok, rows, torch.inf).amin(dim=1)
        hi = torch.where(ok, rows, -torch.inf).amax(dim=1)
        none = ~ok.any(dim=1)
        return lo.masked_fill(none, 0.0), hi.masked_fill(none, 0.0)

    def _check(self) -> None:
        if not self.observed:
            raise RuntimeError(f"{type(self).__name__} has not observed any data")

    def extra_repr(self) -> str:
        return "" if self.params is None else repr(self.params)


class MinMaxObserver(Observer):
    """Running min and max per slot.

    >>> from qdsl.quantizers.parts import PartContext
    >>> o = MinMaxObserver(None, _ctx(axis=0))
    >>> o(torch.tensor([[1., -2.], [3., 4.]])); o(torch.tensor([[0., 0.], [5., 1.]]))
    >>> [t.tolist() for t in o.range()]
    [[-2.0, 1.0], [1.0, 5.0]]
    """

    _state = ("min_val", "max_val")

    def forward(self, x: torch.Tensor) -> None:
        rows, shape = self._rows(x)
        lo, hi = (t.reshape(shape) for t in self._minmax(rows))
        if self.observed:
            lo, hi = torch.minimum(lo, self.min_val), torch.maximum(hi, self.max_val)
        self.min_val, self.max_val = lo, hi

    def traced_range(self, x: torch.Tensor, training: bool):
        if self.ctx.axis is None and self.ctx.group_size is None:
            return self._finite_minmax_all(x.detach().float())
        rows, shape = self._rows(x)
        return tuple(t.reshape(shape) for t in self._finite_minmax(rows))

    @staticmethod
    def _finite_minmax_all(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_finite_minmax` of the whole tensor as one slot, 0-d results.

        Reduced over all dimensions of ``x`` as it is, not over ``x.reshape(1, -1)``: the
        minimum and maximum do not depend on the order, and under inductor the flattened
        view of a channels-last activation became a scalar gather loop (index
        arithmetic per element, not vectorised) where a full reduction runs over memory in
        order, vectorised and fused with the producer's pass.  No separate "any finite"
        pass either: without a finite value the masked minimum is +inf and the maximum
        -inf (``lo > hi``), the only case where ``lo > hi``."""
        ok = torch.isfinite(x)
        lo = torch.where(ok, x, torch.inf).amin()
        hi = torch.where(ok, x, -torch.inf).amax()
        none = lo > hi
        return lo.masked_fill(none, 0.0), hi.masked_fill(none, 0.0)

    def range(self):
        self._check()
        return self.min_val, self.max_val


class EmaObserver(Observer):
    """``r ← (1 − momentum)·r + momentum·batch`` for min and max; the first batch sets ``r``.

    >>> o = EmaObserver(type("P", (), {"momentum": 0.5})(), _ctx())
    >>> o(torch.tensor([0., 4.])); o(torch.tensor([-2., 2.]))
    >>> [t.item() for t in o.range()]
    [-1.0, 3.0]
    """

    _state = ("min_val", "max_val")

    def forward(self, x: torch.Tensor) -> None:
        rows, shape = self._rows(x)
        lo, hi = (t.reshape(shape) for t in self._minmax(rows))
        if self.observed:
            m = float(self.params.momentum)
            lo = torch.lerp(self.min_val, lo, m)
            hi = torch.lerp(self.max_val, hi, m)
        self.min_val, self.max_val = lo, hi

    def range(self):
        self._check()
        return self.min_val, self.max_val

    traced_range = MinMaxObserver.traced_range  # one tensor: its min/max, as after a reset


class MeanAbsObserver(Observer):
    """``(−m, m)`` with ``m`` = mean of ``|x|`` over everything seen (per slot).

    >>> o = MeanAbsObserver(None, _ctx())
    >>> o(torch.tensor([1., -3.])); o(torch.tensor([2., 2.]))
    >>> [t.item() for t in o.range()]
    [-2.0, 2.0]
    """

    _state = ("abs_sum", "count")

    def forward(self, x: torch.Tensor) -> None:
        rows, shape = self._rows(x)
        s = rows.abs().sum(dim=1).reshape(shape)
        n = torch.full(shape, float(rows.shape[1]))
        if not bool(torch.isfinite(s).all()):  # leave NaN/inf out of the mean
            ok = torch.isfinite(rows)
            s = torch.where(ok, rows.abs(), 0.0).sum(dim=1).reshape(shape)
            n = ok.sum(dim=1).to(torch.float32).reshape(shape)
        if self.observed:
            s, n = s + self.abs_sum, n + self.count
        self.abs_sum, self.count = s, n

    def range(self):
        self._check()
        m = self.abs_sum / self.count.clamp_min(1)
        return -m, m

    def traced_range(self, x: torch.Tensor, training: bool):
        rows, shape = self._rows(x)
        ok = torch.isfinite(rows)
        s = torch.where(ok, rows.abs(), 0.0).sum(dim=1).reshape(shape)
        m = s / ok.sum(dim=1).to(torch.float32).reshape(shape).clamp_min(1)
        return -m, m


class HistogramObserver(Observer):
    """A running histogram per slot (``bins`` bins, range grown to cover the data).

    ``range()``: with ``percentile`` set, :func:`range_search.percentile_range`; otherwise
    the bit-aware MSE search :func:`range_search.histogram_range` at the quantizer's
    grid (and power-of-two scales when the scale rule is ``pot``).
    """

    _state = ("hist", "hist_lo", "hist_hi", "slot_shape")
    joint = False
    """Search an asymmetric range over (min, max) jointly (``auto`` below 5 bits sets it)."""

    def __init__(self, params, ctx):
        super().__init__(params, ctx)
        # the slots' shape ([], [C] or [C, G]) so range() works after a state-dict load
        self.register_buffer("slot_shape", _empty(torch.int64))

    def _bins(self) -> int:
        return int(self.params.bins)

    def forward(self, x: torch.Tensor) -> None:
        rows, shape = self._rows(x)
        observed = self.observed
        hists, los, his = [], [], []
        for p in range(rows.shape[0]):
            state = RS.HistogramState(self.hist[p], float(self.hist_lo[p]), float(self.hist_hi[p])) if observed else None
            new = RS.histogram_observe(state, rows[p], self._bins())
            hists.append(new.hist)
            los.append(new.lo)
            his.append(new.hi)
        self.hist = torch.stack(hists)
        self.hist_lo = torch.tensor(los, dtype=torch.float64)
        self.hist_hi = torch.tensor(his, dtype=torch.float64)
        self.slot_shape = torch.tensor(shape, dtype=torch.int64)

    def _percentile(self) -> float | None:
        return getattr(self.params, "percentile", None)

    def _slot_range(self, p: int):
        hist, lo, hi = self.hist[p], float(self.hist_lo[p]), float(self.hist_hi[p])
        ctx = self.ctx
        pct = self._percentile()
        if pct is not None:
            return RS.percentile_range(hist, lo, hi, float(pct), symmetric=ctx.recipe.symmetric)
        return RS.histogram_range(
            hist, lo, hi, ctx.qmin, ctx.qmax, symmetric=ctx.recipe.symmetric, signed=ctx.qmin < 0,
            norm=float(getattr(self.params, "norm", 2.0)), grid=int(getattr(self.params, "grid", 100)), pot=ctx.pot,
            joint=self.joint,
        )

    def range(self):
        self._check()
        pairs = [self._slot_range(p) for p in range(self.hist.shape[0])]
        shape = tuple(int(v) for v in self.slot_shape.tolist())
        lo = torch.stack([a for a, _ in pairs]).reshape(shape).float()
        hi = torch.stack([b for _, b in pairs]).reshape(shape).float()
        return lo, hi


class PercentileObserver(HistogramObserver):
    """Histogram clipped at ``percentile`` (default 99.99) of ``|x|`` (symmetric) or of
    ``x`` at both tails (asymmetric)."""


class MseObserver(HistogramObserver):
    """The range minimising ``sum |x − x̂|^norm`` over ``grid`` clip ratios at the real grid.

    Weights, biases and dynamic quantizers see the whole tensor each time, so the search
    is exact (:func:`range_search.mse_clip_ratio`, per slot) and its result is kept in
    ``min_val``/``max_val``; static activations accumulate a histogram and search it.

    **Carried ratio (QAT).**  The exact search costs ``grid`` fake quantizations of the
    tensor, tens of times a training step of the layer, and in QAT the weight changes
    every step.  So the search result is kept as a clip ratio per slot (``clip_ratio``:
    the range is ``ratio ×`` the slot's min/max range), and a *training* observation (the
    proxy sets ``training_forward``: grad enabled and the weight requires grad) applies
    the carried ratio to the current tensor's min/max instead of searching: one min/max
    pass, like the ``minmax`` observer.  Why a ratio: it describes the *shape* of a
    channel's distribution (how far its tail is worth clipping at this bit width), which
    QAT changes slowly, while the range itself must follow the weight's magnitude every
    step; right after a search the carried range equals the searched one exactly.  Once
    a training observation has carried (``carrying``), every later observation carries
    too (eval, ``qdsl.freeze``), so the frozen model uses the grid training converged
    with; before that (PTQ), each new tensor is searched as before.

    A search runs when there is no ratio yet (calibration, or the first forward), on
    :meth:`request_search` (``qdsl.qat.research_ranges(model)``), when the slots' shape
    changes, and with ``search_every = N`` (spec ``observer=mse(search_every=N)``, or
    ``qdsl.qat.prepare_qat(weight_search_every=N)`` when the spec leaves it unset) every
    N observations while carrying (the proxy observes a weight only when it changed, so
    about every N optimizer steps).  ``clip_ratio``, ``carrying`` and the counter
    ``since_search`` are buffers, so ``state_dict`` carries them; ``searches`` counts the
    searches of this object (tests, benchmarks).
    """

    training_forward: bool = False

    def __init__(self, params, ctx):
        super().__init__(params, ctx)
        self._exact = ctx.role.is_param or ctx.recipe.dynamic
        if self._exact:
            self._state = ("min_val", "max_val")
            for name in ("hist", "hist_lo", "hist_hi", "slot_shape"):
                del self._buffers[name]
            self.register_buffer("min_val", _empty())
            self.register_buffer("max_val", _empty())
            # not in _state: reset() (every new tensor) must not forget the searched ratio
            self.register_buffer("clip_ratio", _empty())
            self.register_buffer("carrying", torch.zeros((), dtype=torch.bool))
            self.register_buffer("since_search", torch.zeros((), dtype=torch.int64))
        self.search_every: int | None = getattr(params, "search_every", None)
        self.searches = 0
        self._search_requested = False

    def _bins(self) -> int:
        return 2048

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self._exact:
            # a checkpoint from before ratios were carried: keep ours (empty: search next time)
            for name in ("clip_ratio", "carrying", "since_search"):
                state_dict.setdefault(prefix + name, getattr(self, name))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def request_search(self) -> None:
        """Search again at the next observation (then carry the new ratio)."""
        self._search_requested = True

    def start_carrying(self) -> None:
        """Carry from now on, as after a training observation (``LeanOptimizer`` re-quantizes
        its masters without grad: its observations are training ones all the same)."""
        self.carrying = torch.ones((), dtype=torch.bool, device=self.carrying.device)

    def cached_training_forward(self) -> None:
        if self._exact:  # what :meth:`forward` does for a training observation, less the min/max
            if not bool(self.carrying):
                self.start_carrying()
            self.since_search = self.since_search + 1

    def _needs_search(self, carry: bool, n_slots: int) -> bool:
        if self._search_requested or self.clip_ratio.numel() != n_slots:
            return True
        if not carry:
            return True  # PTQ: every new tensor is searched
        every = self.search_every or 0  # counted in training forwards: eval never re-searches
        return self.training_forward and every > 0 and int(self.since_search) + 1 >= every

    def forward(self, x: torch.Tensor) -> None:
        if not self._exact:
            return super().forward(x)
        rows, shape = self._rows(x)
        ctx = self.ctx
        if self.training_forward and not bool(self.carrying):
            self.start_carrying()
        carry = bool(self.carrying)
        lo0, hi0 = RS.channel_minmax(rows, ctx.recipe.symmetric, ctx.qmin)
        if self._needs_search(carry, rows.shape[0]):
            ratio = RS.mse_clip_ratio(rows, ctx.qmin, ctx.qmax, symmetric=ctx.recipe.symmetric, axis=0,
                                      grid=int(self.params.grid), norm=float(self.params.norm), pot=ctx.pot)
            self.clip_ratio = ratio.to(torch.float32)
            self.since_search = torch.zeros_like(self.since_search)
            self.searches += 1
            self._search_requested = False
        elif carry and self.training_forward:  # an eval forward leaves the state as it was
            self.since_search = self.since_search + 1
        lo, hi = RS.range_from_ratio(lo0, hi0, self.clip_ratio, ctx.qmin, ctx.qmax,
                                     symmetric=ctx.recipe.symmetric, pot=ctx.pot)
        if self.observed:  # a second tensor without reset: keep the union of the searches
            lo, hi = torch.minimum(lo.reshape(shape), self.min_val), torch.maximum(hi.reshape(shape), self.max_val)
        self.min_val, self.max_val = lo.reshape(shape).float(), hi.reshape(shape).float()

    def range(self):
        if not self._exact:
            return super().range()
        self._check()
        return self.min_val, self.max_val

    def traced_count(self, training: bool) -> None:
        """What a traced training forward records (``carrying`` set, counted), in place:
        buffer mutations a compiled graph can carry (also used by
        qdsl.quantizers.weight_op, which computes the range in its op)."""
        if training:
            self.carrying.fill_(True)
            self.since_search.add_(1)

    def traced_range(self, x: torch.Tensor, training: bool):
        """Compiled forwards always carry the searched ratio (no search can be traced):
        a training forward as in :meth:`forward` (counted, ``carrying`` set), and an
        eval one too, also before the first training forward (eager would search the
        tensor again; equal while the weight is still the one calibration searched).
        A periodic search (``search_every``) waits for an eager training forward, or
        run ``qdsl.qat.research_ranges(model)``; a requested one, or no ratio yet for
        these slots, observes eagerly (a graph break)."""
        if not self._exact or not self.ctx.role.is_param or self._search_requested:
            return None
        rows, shape = self._rows(x)
        if self.clip_ratio.numel() != rows.shape[0]:
            return None
        ctx = self.ctx
        self.traced_count(training)
        lo0, hi0 = RS.channel_minmax(rows, ctx.recipe.symmetric, ctx.qmin)
        lo, hi = RS.range_from_ratio(lo0, hi0, self.clip_ratio, ctx.qmin, ctx.qmax,
                                     symmetric=ctx.recipe.symmetric, pot=ctx.pot)
        return lo.reshape(shape).float(), hi.reshape(shape).float()


def _ctx(axis=None, group_size=None, role=Role.INPUT, qmin=-128, qmax=127):
    """A context for doctests and tests (per-tensor int8 recipe unless told)."""
    from qdsl.quantizers.parts import PartContext
    from qdsl.resolve.plan import QuantizerRecipe
    from qdsl.spec.model import Granularity, GranularityKind, Kind, ObserverSpec

    gran = Granularity(GranularityKind.CHANNEL, axis) if axis is not None else Granularity()
    recipe = QuantizerRecipe(Kind.INT, 8, True, False, True, "float", gran, ObserverSpec("minmax"), "half_even", False)
    return PartContext(recipe, role, qmin, qmax, axis, group_size)

"""Distributed calibration: make every rank's observer statistics identical.

Under ``DistributedDataParallel`` each rank calibrates on its own shard, so static
activation observers disagree and so would the scales derived from them.
:func:`sync_observers` combines the statistics of all ranks (one ``all_gather_object``
for the whole model) and writes the same result on every rank, so scales, zero points
and learned scales initialised from them are identical everywhere.  Guarantees, by
observer:

=============================  ===============================================
minmax, mse (exact, weights)   min of mins, max of maxes: equal to observing the
                               global batch on one process
mean_abs                       sums of |x| and of counts: equal to one process
histogram, percentile, mse     histograms merged in rank order
(histogram-backed)             (``range_search.histogram_merge``), the same on
                               every rank
ema                            mean of the ranks' averages (EMA is linear, so this
                               is the EMA of the per-batch means of rank minima)
=============================  ===============================================

A custom observer takes part by defining ``merge_states(states) -> dict`` (``states``:
one ``{buffer: tensor}`` per rank that observed something, in rank order); one that
does not is reported as a :class:`~qdsl.spec.diagnostics.QdslError`.  Weight and
dynamic quantizers are skipped: they re-observe their tensor on every call and DDP
keeps weights identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from qdsl.quantizers import observers as O
from qdsl.quantizers import range_search as RS
from qdsl.spec.diagnostics import QdslError

__all__ = ["sync_observers", "merge_observer_states"]


def _static_observers(model: nn.Module):
    from qdsl.quantizers.proxy import TensorQuantizer

    for name, m in model.named_modules():
        if isinstance(m, TensorQuantizer) and m.observer is not None and not m.stateless:
            yield name, m.observer


def _state(obs: nn.Module) -> dict[str, torch.Tensor] | None:
    if not obs.observed:
        return None
    return {k: getattr(obs, k).detach().cpu().clone() for k in obs._state}


def merge_observer_states(obs: nn.Module, states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine per-rank buffer states of one observer (see the module docstring)."""
    if hasattr(obs, "merge_states"):
        return obs.merge_states(states)
    if isinstance(obs, O.HistogramObserver) and "hist" in states[0]:
        first = states[0]
        slots = first["hist"].shape[0]
        hists, los, his = [], [], []
        for p in range(slots):
            acc = RS.HistogramState(first["hist"][p], float(first["hist_lo"][p]), float(first["hist_hi"][p]))
            for st in states[1:]:
                acc = RS.histogram_merge(acc, RS.HistogramState(st["hist"][p], float(st["hist_lo"][p]),
                                                                float(st["hist_hi"][p])))
            hists.append(acc.hist)
            los.append(acc.lo)
            his.append(acc.hi)
        return {"hist": torch.stack(hists), "hist_lo": torch.tensor(los, dtype=torch.float64),
                "hist_hi": torch.tensor(his, dtype=torch.float64), "slot_shape": first["slot_shape"]}
    if isinstance(obs, O.EmaObserver):
        return {k: torch.stack([s[k] for s in states]).mean(0) for k in ("min_val", "max_val")}
    if isinstance(obs, (O.MinMaxObserver, O.MseObserver)):
        return {"min_val": torch.stack([s["min_val"] for s in states]).amin(0),
                "max_val": torch.stack([s["max_val"] for s in states]).amax(0)}
    if isinstance(obs, O.MeanAbsObserver):
        return {k: torch.stack([s[k] for s in states]).sum(0) for k in ("abs_sum", "count")}
    raise QdslError(
        f"observer {type(obs).__name__} cannot be synchronised across ranks: give it a "
        "merge_states(states) -> dict method (see qdsl.calibration.distributed)"
    )


def sync_observers(model: nn.Module, group=None) -> int:
    """All-gather and merge every static observer's statistics; returns how many changed.

    A no-op (returning 0) when ``torch.distributed`` is not initialised or has one rank.
    Call it after calibration and before training/freezing, on every rank (it is a
    collective).  Works with the model itself or its DDP wrapper.  Learned scales are
    initialised from the observers on the first forward after calibration: run that
    forward (e.g. one no-grad batch) *before* wrapping the model in DDP, so DDP sees the
    parameters at their final shapes (identical on every rank after this sync).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return 0
    model = getattr(model, "module", model)
    observers = dict(_static_observers(model))
    local = {name: _state(obs) for name, obs in observers.items()}
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    n = 0
    for name, obs in observers.items():
        states = [g[name] for g in gathered if g.get(name) is not None]
        if not states:
            continue
        device = next((b.device for b in obs.buffers()), torch.device("cpu"))
        for k, v in merge_observer_states(obs, states).items():
            obs._buffers[k] = v.to(device)
        n += 1
    return n

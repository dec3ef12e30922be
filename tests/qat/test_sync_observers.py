"""Merging observer statistics across ranks (the collective itself is covered by the slow DDP test)."""

import pytest
import torch

from qdsl.calibration.distributed import merge_observer_states, sync_observers
from qdsl.quantizers import observers as O
from qdsl.quantizers.observers import _ctx
from qdsl.spec.diagnostics import QdslError


def _observe(obs, *tensors):
    for t in tensors:
        obs(t)
    return {k: getattr(obs, k).clone() for k in obs._state}


def _shards():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 50, generator=g) * (i + 1) for i in range(3)]


@pytest.mark.parametrize("cls,params", [(O.MinMaxObserver, None), (O.MeanAbsObserver, None)])
def test_exact_merges_equal_one_process(cls, params):
    shards = _shards()
    states = [_observe(cls(params, _ctx(axis=0)), s) for s in shards]
    whole = cls(params, _ctx(axis=0))
    _observe(whole, torch.cat(shards, dim=1))
    merged = merge_observer_states(whole, states)
    for k, v in merged.items():
        assert torch.allclose(v, getattr(whole, k)), k


def test_ema_merge_is_the_mean_of_ranks():
    shards = _shards()
    p = type("P", (), {"momentum": 0.5})()
    states = [_observe(O.EmaObserver(p, _ctx()), s) for s in shards]
    merged = merge_observer_states(O.EmaObserver(p, _ctx()), states)
    assert torch.allclose(merged["min_val"], torch.stack([s["min_val"] for s in states]).mean(0))


def test_histogram_merge_keeps_every_count_and_covers_all_ranges():
    shards = _shards()
    p = type("P", (), {"bins": 64, "percentile": 99.0})()
    states = [_observe(O.PercentileObserver(p, _ctx()), s) for s in shards]
    obs = O.PercentileObserver(p, _ctx())
    merged = merge_observer_states(obs, states)
    assert merged["hist"].sum().item() == pytest.approx(sum(s.numel() for s in shards))
    assert merged["hist_lo"].item() <= min(s.min().item() for s in shards)
    assert merged["hist_hi"].item() >= max(s.max().item() for s in shards)
    for k, v in merged.items():
        obs._buffers[k] = v
    lo, hi = obs.range()  # a usable observer afterwards
    assert lo.item() < 0 < hi.item()


def test_unknown_observer_is_a_clear_error_and_custom_merge_is_used():
    class Custom(torch.nn.Module):
        pass

    with pytest.raises(QdslError, match="merge_states"):
        merge_observer_states(Custom(), [{}])

    class WithMerge(Custom):
        def merge_states(self, states):
            return {"n": sum(s["n"] for s in states)}

    assert merge_observer_states(WithMerge(), [{"n": torch.tensor(2)}, {"n": torch.tensor(3)}])["n"].item() == 5


def test_sync_is_a_no_op_without_a_process_group():
    assert sync_observers(torch.nn.Linear(2, 2)) == 0

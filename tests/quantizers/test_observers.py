"""Observers: hand-derived statistics, searches that beat min/max where they should, and
the doctests of every part module."""

import doctest

import pytest
import torch

from qdsl.quantizers import observers, range_search, rounding, scales
from qdsl.quantizers.observers import (
    EmaObserver,
    HistogramObserver,
    MeanAbsObserver,
    MinMaxObserver,
    MseObserver,
    PercentileObserver,
    _ctx,
)
from qdsl.spec.builtins import EmaParams, HistogramParams, MseParams, PercentileParams
from qdsl.spec.model import Role


@pytest.mark.parametrize("module", [observers, scales, rounding, range_search])
def test_part_doctests(module):
    res = doctest.testmod(module)
    assert res.failed == 0 and res.attempted > 0


def test_minmax_ema_mean_abs_per_channel():
    ctx = _ctx(axis=1)  # activations N,C,L: channel axis 1
    x1 = torch.tensor([[[1.0, -2.0], [0.0, 4.0]]])
    x2 = torch.tensor([[[3.0, 0.0], [-1.0, 2.0]]])
    mm = MinMaxObserver(None, ctx)
    ema = EmaObserver(EmaParams(momentum=0.25), ctx)
    ma = MeanAbsObserver(None, ctx)
    for o in (mm, ema, ma):
        assert not o.observed
        o(x1)
        o(x2)
    assert [t.tolist() for t in mm.range()] == [[-2.0, -1.0], [3.0, 4.0]]
    # ema: lo = 0.75*[-2, 0] + 0.25*[0, -1]; hi = 0.75*[1, 4] + 0.25*[3, 2]
    assert [t.tolist() for t in ema.range()] == [[-1.5, -0.25], [1.5, 3.5]]
    assert ma.range()[1].tolist() == [1.5, 1.75]
    mm.reset()
    assert not mm.observed


def test_group_slots():
    o = MinMaxObserver(None, _ctx(group_size=2, role=Role.WEIGHT))
    w = torch.tensor([[1.0, -3.0, 2.0, 5.0]])
    o(w)
    lo, hi = o.range()
    assert lo.tolist() == [[-3.0, 2.0]] and hi.tolist() == [[1.0, 5.0]]


def test_percentile_clips_outliers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100000, generator=g)
    x[:10] = 50.0
    o = PercentileObserver(PercentileParams(percentile=99.9, bins=2048), _ctx())
    o(x[:50000])
    o(x[50000:])
    lo, hi = o.range()
    assert 2.5 < float(hi) < 4.0 and float(lo) == -float(hi)  # symmetric: ±|x| percentile


def test_mse_beats_minmax_on_weights_with_outliers():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 256, generator=g)
    w[:, 0] = 12.0
    ctx = _ctx(axis=0, role=Role.WEIGHT, qmin=-8, qmax=7)  # 4 bits
    mse = MseObserver(MseParams(grid=50), ctx)
    mm = MinMaxObserver(None, ctx)
    mse(w)
    mm(w)
    assert (mse.range()[1] < mm.range()[1]).all()

    def err(lo_hi):
        from qdsl.quantizers.range_search import fake_quantize_range

        return (fake_quantize_range(w, *lo_hi, -8, 7, symmetric=True, axis=0) - w).pow(2).sum()

    assert err(mse.range()) < err(mm.range())


def test_histogram_mse_search_for_activations_and_state_shape():
    g = torch.Generator().manual_seed(2)
    ctx = _ctx(qmin=0, qmax=15)  # unsigned 4 bits
    o = HistogramObserver(HistogramParams(bins=512), ctx)
    for _ in range(3):
        o(torch.relu(torch.randn(4000, generator=g)))
    lo, hi = o.range()
    assert float(lo) == 0.0 and 0.5 < float(hi) < float(o.hist_hi[0])
    fresh = HistogramObserver(HistogramParams(bins=512), ctx)
    fresh.load_state_dict(o.state_dict())
    assert [t.tolist() for t in fresh.range()] == [lo.tolist(), hi.tolist()]


def test_range_before_data_is_an_error():
    with pytest.raises(RuntimeError, match="has not observed any data"):
        MinMaxObserver(None, _ctx()).range()

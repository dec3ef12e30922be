"""The joint (min, max) activation range search that ``auto`` uses below 5 bits."""

import pytest
import torch

from qdsl.quantizers import range_search as RS


def _skewed(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "lognormal":  # a long right tail, a short negative side (shifted)
        return torch.exp(torch.randn(100_000, generator=g) * 0.8) - 1.2
    # a dense negative bulk and a thin positive tail
    return torch.cat([torch.randn(95_000, generator=g) * 0.3 - 0.5, torch.rand(5_000, generator=g) * 4])


def _mse(x, lo, hi, qmin, qmax):
    return float(((RS.fake_quantize_range(x, lo, hi, qmin, qmax, symmetric=False) - x) ** 2).mean())


@pytest.mark.parametrize("kind", ["lognormal", "bulk_tail"])
@pytest.mark.parametrize("bits, signed", [(2, False), (3, False), (3, True)])
def test_joint_search_beats_minmax_and_matches_the_coordinate_search(kind, bits, signed):
    x = _skewed(kind)
    qmin, qmax = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    s = RS.histogram_observe(None, x)
    lo, hi = RS.histogram_range(s.hist, s.lo, s.hi, qmin, qmax, symmetric=False, signed=signed, joint=True)
    assert float(lo) <= 0.0 <= float(hi)
    joint = _mse(x, lo, hi, qmin, qmax)
    minmax = _mse(x, s.lo, s.hi, qmin, qmax)
    coord = _mse(x, *RS.histogram_range(s.hist, s.lo, s.hi, qmin, qmax, symmetric=False, signed=signed),
                 qmin, qmax)
    assert joint < 0.8 * minmax
    assert joint <= coord * 1.01  # the 3-pass search is a special path through the same surface


def test_joint_is_ignored_for_symmetric_grids():
    s = RS.histogram_observe(None, _skewed("lognormal"))
    a = RS.histogram_range(s.hist, s.lo, s.hi, -2, 1, symmetric=True, signed=True)
    b = RS.histogram_range(s.hist, s.lo, s.hi, -2, 1, symmetric=True, signed=True, joint=True)
    assert [float(v) for v in a] == [float(v) for v in b]


def test_auto_observer_searches_jointly_below_5_bits_only():
    from qdsl.resolve.plan import QuantizerRecipe
    from qdsl.spec.builtins import MseParams
    from qdsl.spec.model import Granularity, Kind, ObserverSpec, Role
    from qdsl.quantizers.parts import PartContext

    def obs(bits):
        recipe = QuantizerRecipe(Kind.INT, bits, False, False, False, "float", Granularity(), ObserverSpec("auto"),
                                 "half_even", False)
        return RS.auto_observer(MseParams(), PartContext(recipe, Role.INPUT, 0, 2**bits - 1, None, None))

    assert obs(3).joint and obs(4).joint and not obs(5).joint

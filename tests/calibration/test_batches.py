"""Calibration batches: tuples as positional inputs (then targets), dicts as keyword
arguments, nested ``((inputs...), target)``, ``inputs=`` overrides, and a located
BatchError instead of the model's raw TypeError (issue 19, item 5)."""

import copy

import pytest
import torch
from torch import nn

import qdsl
from qdsl.calibration.batches import BatchError, batch_call
from qdsl.patch.handle import get_handle
from qdsl.spec.diagnostics import QdslError

SPEC = "specs/int8-default.qspec"


class ThreeIn(nn.Module):
    """forward(x, h, c): three required inputs, as an LSTM cell step takes."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x, h, c):
        return self.a(x) + self.b(h) * c


class Masked(nn.Module):
    """forward(x, mask=None): one required input, one optional."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x, mask=None):
        y = self.a(x)
        return y if mask is None else y + self.b(mask)


def _scale(model, fqn):
    return float(get_handle(model).quantizer(fqn, "input").scale.flatten()[0])


def _applied(cls):
    torch.manual_seed(0)
    model = cls().eval()
    qdsl.apply(model, SPEC)
    return model


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, h, c = (torch.rand(8, 4, generator=g) * k for k in (1.0, 5.0, 1.0))
    c = c[:, :3]
    return x, h, c


def test_tuple_batch_fills_every_required_positional_input():
    # before: calibrate forwarded batch[0] only and the model raised a raw TypeError
    x, h, c = _data()
    model = _applied(ThreeIn)
    qdsl.calibrate(model, [(x, h, c)])
    qdsl.freeze(model)
    ref = _applied(ThreeIn)
    qdsl.calibrate(ref, [{"x": x, "h": h, "c": c}])
    qdsl.freeze(ref)
    assert _scale(model, "b") == _scale(ref, "b")
    assert _scale(model, "b") > 2 * _scale(model, "a")  # b really saw h (5x the range of x)


def test_x_y_pairs_still_pass_only_x():
    x, h, _ = _data()
    y = torch.arange(8)
    pairs, plain = _applied(Masked), _applied(Masked)
    qdsl.calibrate(pairs, [(x, y)])  # the label is not taken for the optional mask
    qdsl.calibrate(plain, [x])
    assert not get_handle(pairs).quantizer("b", "input").calibrated
    with torch.no_grad():
        assert torch.equal(pairs(x), plain(x))


def test_nested_inputs_and_the_inputs_selector():
    x, h, _ = _data()
    y = torch.arange(8)
    nested, selected, counted, fn = (_applied(Masked) for _ in range(4))
    qdsl.calibrate(nested, [((x, h), y)])
    qdsl.calibrate(selected, [(x, h)], inputs="all")
    qdsl.calibrate(counted, [(x, h, y)], inputs=2)
    qdsl.calibrate(fn, [{"data": x, "m": h}], inputs=lambda b: {"x": b["data"], "mask": b["m"]})
    for m in (nested, selected, counted, fn):
        qdsl.freeze(m)
    want = _scale(nested, "b")
    assert [_scale(m, "b") for m in (selected, counted, fn)] == [want] * 3


def test_dict_of_kwargs_nested_in_a_pair():
    x, h, _ = _data()
    model = _applied(Masked)
    qdsl.calibrate(model, [({"x": x, "mask": h}, torch.arange(8))])
    qdsl.freeze(model)
    assert get_handle(model).quantizer("b", "input").calibrated


@pytest.mark.parametrize("batch, inputs, match", [
    ("short", None, r"needs 3 positional inputs"),
    ("extra", "all", r"too many positional arguments"),
    ("kw", None, r"missing a required argument: 'h'"),
    ("str", None, r"batches must be tensors, tuples/lists or dicts"),
    ("short", 5, r"inputs=5 takes the first 5"),
    ("short", "first", r"inputs='first'"),
])
def test_a_batch_that_does_not_fit_is_a_located_batch_error(batch, inputs, match):
    x, h, c = _data()
    batches = {"short": (x, h), "extra": (x, h, c, c), "kw": {"x": x, "mask": h}, "str": "x"}
    model = _applied(ThreeIn)
    with pytest.raises(BatchError, match=match) as err:
        qdsl.calibrate(model, [(x, h, c), batches[batch]], inputs=inputs)
    assert isinstance(err.value, QdslError)
    if inputs is None and batch in ("short", "kw"):
        msg = str(err.value)
        assert "batch 1" in msg and "test_batches.py:" in msg and "ThreeIn.forward" in msg


def test_ptq_steps_rerun_the_calls_calibrate_made():
    # bias correction re-runs the batches through the PTQ layer's run_batches: with
    # (x, h, c) batches it used to call model(x) and fail
    x, h, c = _data()
    model = _applied(ThreeIn)
    qdsl.calibrate(model, [(x, h, c)])
    corr = qdsl.ptq.correct_bias(model, [(x, h, c)])
    assert set(corr) == {"a", "b"}
    with pytest.raises(BatchError, match="PTQ batch 0"):
        qdsl.ptq.correct_bias(model, [(x,)])


def test_batch_call_passes_tensors_and_dicts():
    x, h, c = _data()
    model = ThreeIn()
    assert batch_call(model, {"x": x, "h": h, "c": c}).kwargs.keys() == {"x", "h", "c"}
    one = batch_call(nn.Linear(4, 3), x)
    assert one.args[0] is x and one.kwargs == {}


def test_sweep_calibrates_on_tuple_batches():
    from qdsl.workflows.sweep import sweep

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    x = torch.rand(64, 4)
    y = model(x).argmax(1)
    data = (x, y, x, y)
    points = sweep(copy.deepcopy(model), SPEC, data, [(("weight.bits", "8"),)],
                   calib_batches=[(x[:32], y[:32]), (x[32:], y[32:])])
    assert points[0].accuracy > 0.8
    with pytest.raises(BatchError, match="calibration batch 0"):
        sweep(model, SPEC, data, [()], calib_batches=[(x, y)], inputs=3)

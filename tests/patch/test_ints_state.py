"""int_tensors recombined with integer arithmetic reproduces the fake-quant layer outputs;
state_dict / save / load reproduce a calibrated model bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdsl
from qdsl.patch import State, get_handle, state_of
from qdsl.spec.diagnostics import QdslError
from qdsl.zoo.models import conv1d_net, digits_resnet
from patch_helpers import spec

ASYM_W = """
version 1
fold_bn
defaults {
  weight = int(bits=8, signed, asymmetric, per_channel, observer=minmax)
  input = int(bits=8, unsigned, asymmetric, observer=minmax)
  bias = int(bits=32, signed, scale=input*weight)
}
"""


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, stride=2, padding=1, dilation=1, groups=1)
        self.bn = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.bn(self.conv(x))), 1))


def _captured(model, fqn):
    """The (already input-quantized) input and the output of one layer."""
    got = {}
    mod = dict(model.named_modules())[fqn]
    h = mod.register_forward_hook(lambda m, a, o: got.update(x=a[0], y=o))
    with torch.no_grad():
        model(torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(5)))
    h.remove()
    return got["x"], got["y"]


@pytest.mark.parametrize("text", [None, ASYM_W], ids=["symmetric_w", "asymmetric_w"])
def test_int_tensors_recombine_to_the_fake_quant_output(text):
    torch.manual_seed(0)
    model = _Net().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.2, 0.2)
        model.bn.running_var.uniform_(0.5, 1.5)
    qdsl.apply(model, spec(text) if text else spec())
    qdsl.calibrate(model, [torch.randn(4, 3, 8, 8) for _ in range(3)], progress=False)
    qdsl.freeze(model)
    ints = qdsl.int_tensors(model)
    assert set(ints) == {"conv", "fc"}
    for fqn in ("conv", "fc"):
        li = ints[fqn]
        x, y = _captured(model, fqn)  # x is what the layer saw: the fake-quantized input
        xq = torch.round(x * (1.0 / li.input_scale)) + li.input_zero_point
        assert torch.equal((xq - li.input_zero_point) * li.input_scale, x)  # x is on the grid
        xi = (xq.to(torch.int64) - li.input_zero_point.to(torch.int64))
        wz = li.weight_zero_point.to(torch.int64)
        wi = li.weight.to(torch.int64) - wz.reshape(-1, *([1] * (li.weight.dim() - 1)))
        assert li.weight.dtype == torch.int8 and li.bias.dtype == torch.int32
        if fqn == "conv":
            # int64 convolution through float64 (exact: every partial sum < 2^53)
            acc = F.conv2d(xi.double(), wi.double(), None, stride=2, padding=1).to(torch.int64)
            acc = acc + li.bias.to(torch.int64)[None, :, None, None]
            scale = (li.input_scale * li.weight_scale)[None, :, None, None]
        else:
            acc = xi @ wi.T + li.bias.to(torch.int64)
            scale = li.input_scale * li.weight_scale
        assert torch.equal(li.bias_scale, li.input_scale * li.weight_scale)
        y_int = acc.to(torch.float64) * scale.double()
        tol = 1e-5 * float(y.abs().max())
        assert (y_int - y.double()).abs().max() <= tol


def test_state_dict_round_trip_is_bit_exact(tmp_path):
    torch.manual_seed(0)
    batches = [torch.randn(4, 1, 8, 8) for _ in range(3)]
    x = torch.randn(5, 1, 8, 8)
    model = digits_resnet()
    qdsl.apply(model, spec())
    qdsl.calibrate(model, batches, progress=False)
    with torch.no_grad():
        y_cal = model(x)
    sd = model.state_dict()
    assert any(k.endswith("observer.min_val") for k in sd) and "_qdsl.lifecycle" in sd

    fresh = digits_resnet(seed=3)  # different float weights: all must come from the state
    qdsl.apply(fresh, spec())
    fresh.load_state_dict(sd)
    assert state_of(fresh) is State.CALIBRATING
    with torch.no_grad():
        assert torch.equal(fresh(x), y_cal)

    qdsl.freeze(model)
    with torch.no_grad():
        y_frozen = model(x)
    path = tmp_path / "calibrated.pt"
    qdsl.save(model, path)
    other = digits_resnet(seed=4)
    qdsl.apply(other, spec())
    qdsl.load(other, path)
    assert state_of(other) is State.FROZEN
    with torch.no_grad():
        assert torch.equal(other(x), y_frozen)
        assert torch.equal(other(x), y_frozen)  # cached path after load


def test_load_errors(tmp_path):
    model = conv1d_net()
    with pytest.raises(QdslError, match="not applied"):
        qdsl.load(model, tmp_path / "x.pt")
    qdsl.apply(model, spec())
    with pytest.raises(QdslError, match="no such file"):
        qdsl.load(model, tmp_path / "missing.pt")
    torch.save({"weight": torch.zeros(1)}, tmp_path / "plain.pt")
    with pytest.raises(QdslError, match="not a qdsl state file"):
        qdsl.load(model, tmp_path / "plain.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(QdslError, match="not a qdsl state file"):
        qdsl.load(model, tmp_path / "junk.pt")
    # a state from a differently specced model
    other = conv1d_net()
    qdsl.apply(other, spec("version 1\ndefaults { weight = int(bits=4) }\n"))
    qdsl.save(other, tmp_path / "other.pt")
    with pytest.raises(QdslError, match="does not match this model"):
        qdsl.load(model, tmp_path / "other.pt")
    assert get_handle(model).state is State.PREPARED


def test_float_checkpoint_loads_into_the_masters():
    trained = digits_resnet(seed=7)
    model = digits_resnet(seed=0)
    qdsl.apply(model, spec())
    result = model.load_state_dict(trained.state_dict(), strict=False)
    assert all(k.startswith("_qdsl.") for k in result.missing_keys) and not result.unexpected_keys
    assert torch.equal(model.stem[0].weight_float, trained.stem[0].weight)
    qdsl.remove(model)
    for (k, a), (k2, b) in zip(trained.state_dict().items(), model.state_dict().items()):
        assert k == k2 and torch.equal(a, b)


def test_model_index_of_an_applied_model_still_lists_its_layers():
    from qdsl.resolve.plan import ModelIndex

    model = digits_resnet()
    before = ModelIndex.from_module(model)
    qdsl.apply(model, spec())
    after = ModelIndex.from_module(model)
    assert [e.fqn for e in after] == [e.fqn for e in before]

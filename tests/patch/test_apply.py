"""apply -> calibrate -> freeze -> eval on the reference models; remove is bit-identical;
lifecycle errors are clear."""

import io

import attrs

import pytest
import torch
from torch import nn

import qdsl
from qdsl.patch import State, get_handle, state_of
from qdsl.calibration.run import ProgressBar
from qdsl.spec.diagnostics import QdslError, SpecError
from qdsl.spec.model import Role
from qdsl.zoo.models import conv1d_net, conv_bn_relu_net, digits_resnet, mlp
from patch_helpers import INT8, same_state, snapshot, spec

MODELS = [
    ("digits_resnet", digits_resnet, (6, 1, 8, 8)),
    ("conv1d_net", conv1d_net, (6, 1, 64)),
    ("conv_bn_relu_net", lambda: conv_bn_relu_net(width=8), (4, 3, 16, 16)),
]


def _batches(shape, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


@pytest.mark.parametrize("name,make,shape", MODELS, ids=[m[0] for m in MODELS])
def test_lifecycle_and_remove(name, make, shape):
    model = make()
    before = snapshot(model)
    params_before = {n: p for n, p in model.named_parameters()}
    types_before = {n: type(m) for n, m in model.named_modules()}
    x = torch.randn(shape)
    with torch.no_grad():
        y_float = model(x)

    handle = qdsl.apply(model, spec())
    assert state_of(model) is State.PREPARED and get_handle(model) is handle
    assert all(type(m) is types_before[n] for n, m in model.named_modules() if n in types_before)
    qdsl.calibrate(model, _batches(shape), progress=False)
    assert handle.state is State.CALIBRATING
    qdsl.freeze(model)
    assert handle.state is State.FROZEN
    with torch.no_grad():
        y1 = model(x)
        y2 = model(x)
    assert torch.equal(y1, y2)  # the cached frozen path is deterministic
    y3 = model(x)  # grad-enabled path computes the same values
    assert torch.equal(y1, y3.detach())
    err = (y1 - y_float).abs().max() / y_float.abs().max()
    assert 0 < err < 0.1, err  # quantized, but close to float at 8 bits
    # every weighted layer is patched and reads quantized weights
    for fqn, patch in handle.layers.items():
        if patch.wq is not None:
            w, _ = patch.float_params()
            assert torch.equal(patch.module.weight, patch.wq(w))

    handle.remove()
    assert state_of(model) is None and not hasattr(model, "_qdsl")
    assert same_state(before, snapshot(model))
    assert all(p is params_before[n] for n, p in model.named_parameters())
    assert all(type(m) is types_before[n] for n, m in model.named_modules())
    with torch.no_grad():
        assert torch.equal(model(x), y_float)


def test_residual_block_output_and_model_input():
    model = digits_resnet()
    text = INT8 + "\nrule type:DigitsResNet { input = a8 }\n"
    handle = qdsl.apply(model, spec(text))
    assert handle.quantizer("layer1.0", Role.OUTPUT) is not None
    assert handle.quantizer("", Role.INPUT) is not None
    qdsl.calibrate(model, _batches((4, 1, 8, 8)), progress=False)
    qdsl.freeze(model)
    # the block's output is on its grid: (y / s) + z are integers
    outs = {}
    h = model.layer1[0].register_forward_hook(lambda m, a, o: outs.setdefault("o", o))
    with torch.no_grad():
        model(torch.randn(2, 1, 8, 8))
    h.remove()
    q = handle.quantizer("layer1.0", "output")
    codes = outs["o"] * (1.0 / q.scale) + q.zero_point
    assert torch.allclose(codes, codes.round(), atol=1e-3)
    qdsl.remove(model)


def test_groups_dilation_conv1d_and_linear():
    model = nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=2, dilation=2, groups=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 5),
    ).eval()
    before = snapshot(model)
    x = torch.randn(3, 4, 6, 6)
    y0 = model(x)
    text = """
version 1
defaults {
  weight = int(bits=4, signed, narrow, granularity=group(9), observer=mse)
  input = int(bits=8, unsigned, asymmetric, observer=ema(momentum=0.5))
}
rule type:ReLU { output = int(bits=8, unsigned, observer=percentile(percentile=99.9)) }
"""
    qdsl.apply(model, spec(text))
    qdsl.calibrate(model, _batches((3, 4, 6, 6)), num_batches=2, progress=False)
    qdsl.freeze(model)
    h = get_handle(model)
    assert tuple(h.quantizer("0", "weight").scale.shape) == (8, 2)  # rows of 2*3*3 = 18 -> 2 groups
    assert tuple(h.quantizer("3", "weight").scale.shape) == (5, 32)
    y = model(x)
    assert y.shape == y0.shape
    qdsl.remove(model)
    assert same_state(before, snapshot(model))


def test_apply_twice_is_an_error():
    model = mlp()
    qdsl.apply(model, spec())
    with pytest.raises(QdslError, match="already applied.*qdsl.remove"):
        qdsl.apply(model, spec())


def test_lifecycle_errors():
    model = mlp()
    with pytest.raises(QdslError, match="not applied.*qdsl.apply"):
        qdsl.calibrate(model, _batches((2, 64)))
    with pytest.raises(QdslError, match="not applied"):
        qdsl.freeze(model)
    qdsl.apply(model, spec())
    with pytest.raises(QdslError, match="never observed data.*net.1:input"):
        qdsl.freeze(model)
    with pytest.raises(QdslError, match="no batches"):
        qdsl.calibrate(model, [])
    with pytest.raises(QdslError, match="batches must be tensors"):
        qdsl.calibrate(model, [3])
    qdsl.calibrate(model, _batches((2, 64)), progress=False)
    with pytest.raises(QdslError, match="freeze first|call qdsl.freeze"):
        qdsl.int_tensors(model)
    qdsl.freeze(model)
    with pytest.raises(QdslError, match="already frozen"):
        qdsl.freeze(model)
    with pytest.raises(QdslError, match="frozen.*calibrate before"):
        qdsl.calibrate(model, _batches((2, 64)))


def test_dynamic_input_needs_no_calibration():
    model = mlp()
    text = """
version 1
defaults {
  weight = int(bits=8, signed, narrow, per_channel)
  input = int(bits=8, signed, dynamic)
  bias = int(bits=32, signed, scale=input*weight)
}
"""
    handle = qdsl.apply(model, spec(text))
    qdsl.freeze(model)
    x = torch.randn(3, 64)
    q = handle.quantizer("net.1", "input")
    y = model(x)
    y_big = model(x * 100)  # the input scale follows each batch
    assert q.current_scale() is not None
    assert not torch.allclose(y_big, model(x))
    assert torch.isfinite(y).all()


def test_plan_naming_absent_modules_and_bad_groups():
    model = mlp()
    with pytest.raises(SpecError) as e:
        qdsl.apply(model, spec("version 1\nrule net.9 { weight = int(bits=8) }\n"))
    assert "net.9" in str(e.value)
    model = mlp()
    text = "version 1\nrule type:Linear { weight = int(bits=4, granularity=group(7)) }\n"
    with pytest.raises(SpecError, match="group size 7 does not divide"):
        qdsl.apply(model, spec(text))
    assert state_of(model) is None


def test_bad_arguments_are_clear_errors():
    with pytest.raises(QdslError, match="needs an nn.Module, got str"):
        qdsl.apply("model", spec())
    with pytest.raises(QdslError, match="needs a spec file path, a QuantSpec or a resolved Plan, got int"):
        qdsl.apply(mlp(), 42)
    with pytest.raises(SpecError, match="cannot read spec file"):
        qdsl.apply(mlp(), "no-such-file.qspec")
    plan = qdsl.resolve.resolve(mlp(), spec())
    with pytest.raises(QdslError, match="overrides= needs a spec"):
        qdsl.apply(mlp(), plan, overrides=["weight.bits=4"])


def test_plan_from_another_model_is_an_error():
    plan = qdsl.resolve.resolve(digits_resnet(), spec())
    with pytest.raises(SpecError, match="does not have: 'stem.0'"):
        qdsl.apply(mlp(), plan)


def test_derived_bias_needs_an_input_quantizer():
    text = """
version 1
defaults {
  weight = int(bits=8)
  bias = int(bits=32, scale=input*weight)
}
"""
    model = mlp()
    with pytest.raises(SpecError) as e:  # the resolver sees it first
        qdsl.apply(model, spec(text))
    assert "test.qspec:5" in str(e.value)
    # a hand-made plan that drops the input quantizer is caught by apply itself
    plan = qdsl.resolve.resolve(model, spec())
    layers = [attrs.evolve(lp, roles={r: q for r, q in lp.roles.items() if r is not Role.INPUT})
              if lp.fqn == "net.3" else lp for lp in plan.layers]
    with pytest.raises(SpecError) as e:
        qdsl.apply(model, attrs.evolve(plan, layers=layers))
    assert e.value.codes == ["E504"] and "'net.3'" in str(e.value) and "test.qspec:9" in str(e.value)
    assert state_of(model) is None


def test_example_input_failure_rolls_back():
    model = mlp()
    before = snapshot(model)
    with pytest.raises(RuntimeError):
        qdsl.apply(model, spec(), example_input=torch.randn(2, 3))  # wrong width
    assert state_of(model) is None and same_state(before, snapshot(model))


def test_calibrating_context_observes_in_float_and_restores_modes():
    model = conv_bn_relu_net(width=8)
    model.train()
    x = torch.randn(2, 3, 16, 16)
    qdsl.apply(model, spec())
    with qdsl.calibrating(model):
        assert not model.training
        with torch.no_grad():
            y_cal = model(x)
    assert model.training and model.features[1].training
    model.eval()
    qdsl.remove(model)
    with torch.no_grad():
        y_float = model(x)
    # float during calibration (BN folded: equal up to float rounding)
    assert torch.allclose(y_cal, y_float, atol=1e-5)


def test_progress_bar_draws_only_when_enabled():
    buf = io.StringIO()
    bar = ProgressBar("calibrating", 3, enabled=True, stream=buf)
    for _ in range(3):
        bar.update()
    bar.close()
    assert "3/3" in buf.getvalue() and buf.getvalue().endswith("\n")
    quiet = io.StringIO()
    bar = ProgressBar("calibrating", 3, stream=quiet)  # StringIO is not a TTY
    bar.update()
    bar.close()
    assert quiet.getvalue() == ""


def test_paths_overrides_and_deepcopy(tmp_path):
    import copy
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "specs"
    model = digits_resnet()
    h = qdsl.apply(model, root / "int8-default.qspec.toml", overrides=["weight.bits=4"])
    assert h.quantizer("stem.0", "weight").qmax == 7
    qdsl.calibrate(model, _batches((4, 1, 8, 8)), progress=False)
    qdsl.freeze(model)
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        y = model(x)
    twin = copy.deepcopy(model)  # an applied model copies with its own proxies and hooks
    assert get_handle(twin).model is twin and get_handle(twin).layers["stem.0"].module is twin.stem[0]
    with torch.no_grad():
        assert torch.equal(twin(x), y)
    qdsl.remove(twin)
    assert state_of(twin) is None and state_of(model) is State.FROZEN
    with torch.no_grad():
        assert torch.equal(model(x), y)

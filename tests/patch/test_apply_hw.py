"""``qdsl.apply(..., hw=PROFILE)`` refuses a plan the target rejects (issue 7 item 4)."""

import warnings

import pytest
import torch

import qdsl
from qdsl.lint import LintWarning
from qdsl.spec.diagnostics import SpecError
from qdsl.zoo.models import digits_resnet


def test_apply_refuses_spec_the_profile_rejects_and_leaves_model_untouched():
    model = digits_resnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # w4a8-per-channel uses float scales and unsigned activations with zero points:
    # the power-of-two ASIC rejects it
    with pytest.raises(SpecError) as exc:
        qdsl.apply(model, "specs/w4a8-per-channel.qspec", hw="pot-asic-24bit-acc")
    assert any(code.startswith("E3") for code in exc.value.codes)
    assert "w4a8-per-channel.qspec:" in str(exc.value)
    assert qdsl.patch.state_of(model) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_apply_accepts_a_spec_the_profile_allows():
    model = digits_resnet()
    handle = qdsl.apply(model, "specs/pot-asic.qspec", hw="pot-asic-24bit-acc")
    assert handle.plan is not None
    handle.remove()


def test_apply_warn_mode_patches_and_warns():
    model = digits_resnet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = qdsl.apply(model, "specs/w4a8-per-channel.qspec", hw="pot-asic-24bit-acc", hw_mode="warn")
    assert any(issubclass(w.category, LintWarning) for w in caught)
    assert qdsl.patch.state_of(model) is not None
    handle.remove()

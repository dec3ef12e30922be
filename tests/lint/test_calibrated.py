"""The tight accumulator bound on a real calibrated qdsl model: the integers come from
``qdsl.patch.int_tensors`` and the bound equals brute force over every input vector."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

import qdsl
from qdsl.lint import lint
from qdsl.lint.calibrated import layer_ints
from qdsl.lint.plan_checks import tight_layer_range
from qdsl.parse import parse_text
from qdsl.spec.diagnostics import QdslError
from qdsl.spec.model import Role

SPEC = """version = 1
[defaults]
weight = { kind = "int", bits = 4, granularity = "channel" }
input = { kind = "int", bits = 3, signed = false, symmetric = false }
bias = { kind = "int", bits = 16, scale = "input*weight" }
"""


def _calibrated(spec_text=SPEC):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    spec = parse_text(spec_text, "c.qspec.toml")
    handle = qdsl.apply(model, spec)
    qdsl.calibrate(model, [torch.randn(8, 4) * 2 + 1 for _ in range(2)], progress=False)
    qdsl.freeze(model)
    return model, spec, handle


def test_tight_bound_equals_brute_force_on_int_tensors():
    model, spec, handle = _calibrated()
    raw = qdsl.int_tensors(model)["0"]
    w = raw.weight.numpy().astype(np.int64) - raw.weight_zero_point.numpy().astype(np.int64).reshape(-1, 1)
    b = raw.bias.numpy().astype(np.int64)
    z = int(raw.input_zero_point.reshape(-1)[0])
    codes = np.array(list(itertools.product(range(0, 8), repeat=4)), dtype=np.int64)  # every 3-bit input
    acc = (codes - z) @ w.T + b
    layer = handle.plan.layer("0")
    got = tight_layer_range(layer.recipe(Role.WEIGHT), layer.recipe(Role.INPUT), layer.recipe(Role.BIAS),
                            layer_ints(model)["0"])
    assert got == (int(acc.min()), int(acc.max()))


def test_calibrated_model_is_linted_with_its_integers():
    model, spec, _ = _calibrated()
    from qdsl.lint import parse_profile

    prof = parse_profile('version = 1\n[accumulator]\nbits = 6\noverflow = "wrap"\n')
    worst = lint(spec, prof, model, calibrated=False)
    tight = lint(spec, prof, model)
    assert [d.code for d in worst] == ["W313"]
    assert [d.code for d in tight] == ["E314"]
    assert "with its integer weights the accumulator reaches" in tight[0].message


def test_calibrated_true_requires_a_frozen_model():
    spec = parse_text(SPEC, "c.qspec.toml")
    with pytest.raises(QdslError, match="calibrated=True"):
        lint(spec, "x86-fbgemm", nn.Sequential(nn.Linear(4, 3)), calibrated=True)


def test_pot_codes_become_magnitudes():
    spec = SPEC.replace('weight = { kind = "int", bits = 4, granularity = "channel" }',
                        'weight = { kind = "pot", bits = 3, granularity = "channel" }')
    spec = spec.replace('bias = { kind = "int", bits = 16, scale = "input*weight" }\n', "")  # int-only bias rule
    model, _, handle = _calibrated(spec)
    raw = qdsl.int_tensors(model)["0"].weight.numpy().astype(np.int64)
    mags = layer_ints(model)["0"].weight
    assert set(np.abs(raw).ravel()) <= {0, 1, 2, 3}
    expected = [[0 if c == 0 else int(np.sign(c)) * 2 ** (abs(int(c)) - 1) for c in row] for row in raw]
    assert mags.tolist() == expected


ACC_SPEC = """version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
defaults {
  weight = w8
  input = a8
  bias = int(bits=32, signed, symmetric, scale=input*weight)
  accumulator(bits=16, overflow=wrap)
}
"""


def test_spec_accumulator_narrower_than_the_target_is_an_overflow_finding():
    # a 16-bit wrapping spec on a 24-bit wrapping target: fan-in 64 of 8x8-bit codes needs
    # 22 bits, so the spec's own accumulator overflows (before: no finding at all, the
    # target's 24 bits being wide enough)
    from qdsl.lint import parse_profile

    prof = parse_profile('version = 1\n[accumulator]\nbits = 24\noverflow = "wrap"\n')
    spec = parse_text(ACC_SPEC, "acc.qspec")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 8))
    worst = lint(spec, prof, model, calibrated=False)
    assert [d.code for d in worst] == ["W313"]
    d = worst[0]
    assert "the spec's accumulator has 16 (wrap)" in d.message
    # located at the spec's accumulator setting (line 8, its arguments), as E315 is
    assert d.span.location() == "acc.qspec:8:14"
    with torch.no_grad():
        model[0].weight.abs_()  # every weight positive: the calibrated sums reach far past 16 bits
    qdsl.apply(model, spec)
    qdsl.calibrate(model, [torch.rand(16, 64) * 4], progress=False)
    qdsl.freeze(model)
    tight = lint(spec, prof, model)
    assert [d.code for d in tight] == ["E314"]
    assert "the spec's accumulator has 16 (wrap)" in tight[0].message
    assert tight[0].span.location() == "acc.qspec:8:14"
    # with the target's own 16 bits instead, the finding is the target's (at the weight bits)
    same = lint(spec, parse_profile('version = 1\n[accumulator]\nbits = 16\noverflow = "wrap"\n'), model)
    assert [d.code for d in same] == ["E314"] and "has 16 (wrap)" in same[0].message


def test_constrained_accumulator_lints_clean_once_calibrated():
    # the same layer and data as above, with constrain=true: the exact bound holds at freeze
    from qdsl.lint import parse_profile

    prof = parse_profile('version = 1\n[accumulator]\nbits = 24\noverflow = "wrap"\n')
    spec = parse_text(ACC_SPEC.replace("overflow=wrap)", "overflow=wrap, constrain=true)"), "acc.qspec")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 8))
    with torch.no_grad():
        model[0].weight.abs_()
    qdsl.apply(model, spec)
    qdsl.calibrate(model, [torch.rand(16, 64) * 4], progress=False)
    qdsl.freeze(model)
    assert [d.code for d in lint(spec, prof, model)] == []
    assert [d.code for d in lint(spec, prof, model, calibrated=False)] == ["W313"]  # bit widths alone

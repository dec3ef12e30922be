"""Exact integer weights for block-scaled and minifloat weights (qdsl/export/exact_weights.py).

A weight whose values are, per output channel, integers in int8 times one scale lowers onto
the integer weight path: the graph (reference and C++) then equals the fake-quant model bit
for bit when every scale is a power of two.  Otherwise export refuses, naming the layer, the
format and the channel."""

import numpy as np
import pytest
import torch
from torch import nn

import qdsl
from qdsl.export.exact_weights import NotExact, dyadic_rows
from qdsl.export.values import ExportError
from qdsl.runtime.run import run_graph

FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def test_fp4_times_pot_blocks_decode_to_small_integers():
    rng = np.random.default_rng(0)
    elems = rng.choice(np.concatenate([FP4, -FP4]), size=(3, 64))
    exps = np.array([[-3, -1], [0, 0], [-7, -4]])  # per row, two blocks of 32: spreads 2, 0, 3
    values = elems * np.repeat(np.ldexp(1.0, exps), 32, axis=1)
    codes, k = dyadic_rows(values)
    assert np.array_equal(np.ldexp(codes.astype(np.float64), k[:, None]), values)
    assert np.abs(codes).max() <= 127
    # the coarsest grid: some code in each nonzero row is odd
    assert all((codes[r] % 2 != 0).any() for r in range(3) if codes[r].any())


def test_a_row_spanning_too_many_binades_is_named():
    values = np.array([[1.0, 2.0], [6.0, 0.5 * 2.0**-5]])  # row 1: 6 / 2^-6 = 384 > 127
    got = dyadic_rows(values)
    assert isinstance(got, NotExact) and got.channel == 1 and got.largest_code == 384
    text = got.message("fp4_e2m1 weights")
    assert "output channel 1 needs codes up to 384" in text and text.startswith("fp4_e2m1 weights have no exact")


def test_zero_rows_and_negative_bounds():
    codes, k = dyadic_rows(np.array([[0.0, 0.0], [-128.0, 127.0]]))
    assert codes.tolist() == [[0, 0], [-128, 127]]
    assert isinstance(dyadic_rows(np.array([[-129.0, 1.0]])), NotExact)


SPEC = """version 1
quantizer a8pot = int(bits=8, signed, symmetric, scale=pot, per_tensor)
defaults {
  weight = int(bits=4, signed, narrow, symmetric, scale=%s, granularity=group(16))
  input = a8pot
  output = a8pot
}
"""


def _model(scale: str):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 16, bias=False), nn.ReLU(), nn.Linear(16, 4, bias=False))
    qdsl.apply(m, qdsl.parse_spec(SPEC % scale))
    x = torch.randn(64, 64)
    qdsl.calibrate(m, [x])
    qdsl.freeze(m)
    return m, x


def test_group_wise_pot_weights_export_exactly():
    m, x = _model("pot")
    g = qdsl.export(m, x[:2])
    with torch.no_grad():
        fq = m(x).numpy()
    ref = run_graph(g, x.numpy(), backend="reference")
    assert np.array_equal(ref, fq)
    try:
        cpp = run_graph(g, x.numpy(), backend="cpp")
    except Exception as e:  # pragma: no cover - the native runtime is optional
        pytest.skip(f"no C++ runtime: {e}")
    assert np.array_equal(cpp, ref)


def test_group_wise_float_scales_are_refused_with_the_layer():
    m, x = _model("float")
    with pytest.raises(ExportError, match=r"cannot export '0': int weights with group\(16\) scales have no exact int8 "
                                          r"form: output channel \d+") as info:
        qdsl.export(m, x[:2])
    # located: where the spec writes the granularity (a parsed text is '<input>')
    assert "hint: use `granularity = channel`; the weight's granularity is written at <input>:4:" in str(info.value)

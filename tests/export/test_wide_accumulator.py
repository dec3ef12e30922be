"""A spec's wide accumulator (``accumulator(bits=48)``) reaches the graph as 48 bits, and the
wide output stage extends the int32 one (equal on every int32-range value)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import qdsl
from qdsl.graph.ir import Rescale, RescaleKind, Rounding
from qdsl.graph.reference import execute
from qdsl.graph.requant import apply_rescale, apply_rescale_wide, make_rescale

SPEC = """version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_tensor, observer=minmax)
quantizer a8 = int(bits=8, unsigned, symmetric, per_tensor, observer=minmax)
defaults {{
  weight = w8
  input = a8
  output = a8
  accumulator(bits={bits}, overflow={overflow})
}}
"""


class Wide(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.fc = nn.Linear(n, 1, bias=False)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("bits", [40, 48, 64])
@pytest.mark.parametrize("overflow", ["wrap", "saturate"])
def test_spec_accumulator_wider_than_32_bits_is_exported_and_exact(bits, overflow):
    # fan-in 70000 of codes 255 x 127: the sum 2.27e9 needs 33 bits (was exported as 32 bits
    # and wrapped to a negative sum: output 0 instead of 70000)
    n = 70_000
    model = Wide(n)
    model.fc.weight.data.fill_(1.0)
    x = torch.ones(2, n)
    qdsl.apply(model, qdsl.parse_spec(SPEC.format(bits=bits, overflow=overflow)))
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    graph = qdsl.export(model, x)
    assert [op.attrs["acc_bits"] for op in graph.ops if "acc_bits" in op.attrs] == [bits]
    with torch.no_grad():
        fq = model(x).numpy()
    res = execute(graph, x.numpy())
    np.testing.assert_array_equal(res.outputs[0], fq)
    assert res.overflow["fc"] == 0
    import qdsl.runtime as rt

    if rt.available():
        np.testing.assert_array_equal(rt.CompiledGraph(graph).run(x.numpy()), fq)


@pytest.mark.parametrize("kind", ["pot", "single", "gemmlowp"])
@pytest.mark.parametrize("rounding", list(Rounding))
def test_wide_rescale_equals_int32_rescale_on_int32_values(kind, rounding):
    rng = np.random.default_rng(int(rounding))
    x = np.concatenate([rng.integers(-2**31, 2**31, 3000), rng.integers(-3000, 3000, 3000),
                        [-2**31, 2**31 - 1, 0, -1, 1, 2]]).astype(np.int64).reshape(2, -1)
    for factor in (2.0 ** -7, 0.37, 3e-6, 1.9, 700.0, 2.0 ** 5):
        if kind == "pot":
            s = -int(np.log2(factor)) if factor in (2.0 ** -7, 2.0 ** 5) else 11
            r = Rescale(RescaleKind.POT, [1], [s], rounding)
        else:
            r = make_rescale(factor, rounding, allow_pot=False, single=kind == "single")
        np.testing.assert_array_equal(apply_rescale_wide(x, r), apply_rescale(x, r), err_msg=f"{kind} {factor}")


def test_one_bit_accumulator_is_refused_at_check_with_a_location():
    # it used to check clean and then fail at export (the graph's acc_bits range is 2..64)
    from qdsl.spec.diagnostics import SpecError

    with pytest.raises(SpecError) as err:
        qdsl.parse_spec(SPEC.format(bits=1, overflow="wrap"), "acc.qspec")
    text = str(err.value)
    assert "E104" in text and "acc.qspec:8:" in text and "accumulator bits" in text


@pytest.mark.parametrize("hw_bits", [32, 40])
def test_lint_agrees_with_the_exported_accumulator(tmp_path, hw_bits):
    """The bound lint checks is the one the graph computes: a 70000-term 8-bit layer needs 33
    bits (W313 on a 32-bit target, clean on a 40-bit one), and a spec's 48-bit accumulator on a
    40-bit target is E315."""
    from qdsl.lint import lint

    profile = tmp_path / "wide.toml"
    profile.write_text(f'version = 1\nname = "wide"\n[accumulator]\nbits = {hw_bits}\noverflow = "wrap"\n')
    model = Wide(70_000)
    spec = qdsl.parse_spec(SPEC.format(bits=hw_bits, overflow="wrap"), "acc.qspec")
    codes = [d.code for d in lint(spec, str(profile), model, calibrated=False)]
    assert codes == (["W313"] if hw_bits == 32 else [])
    wider = qdsl.parse_spec(SPEC.format(bits=48, overflow="wrap"), "acc.qspec")
    assert "E315" in [d.code for d in lint(wider, str(profile), model, calibrated=False)]

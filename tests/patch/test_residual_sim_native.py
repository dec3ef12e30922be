"""The frozen Linear's exact accumulator (qdsl.patch.residual_sim.exact_accumulator) on the C++
runtime's integer GEMM equals the float32 products in exact chunks, to the bit: the operand
layouts it takes (uint8 and int8 input codes, zero points, odd sizes), the frozen fake-quant
model end to end, and a copy of a frozen model (the packed weights are not copied)."""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import qdsl
from qdsl.patch import residual_sim as RS
from qdsl.runtime import _native

pytestmark = pytest.mark.skipif(_native.lib() is None, reason="needs the native runtime")


def _sums(native_on: bool, w: np.ndarray, grid: tuple, xq: torch.Tensor, monkeypatch) -> torch.Tensor:
    """exact_accumulator's sums through a stand-in patch holding ``w`` (codes - zp) and ``grid``."""
    x = (xq * grid[0]).float()
    fits = True
    ops = (torch.from_numpy(w.astype(np.float32)), None, np.ones(w.shape[0]), 0.0,
           max(1, (RS.F32_EXACT - 1) // (255 * max(1, int(np.abs(w).max(initial=1))))), fits,
           RS._native_operands(w, grid, fits))

    class P:
        pass

    with monkeypatch.context() as m:
        m.setattr(RS, "_operands", lambda patch, g: ops)
        m.setattr(RS, "NATIVE_SUMS", native_on)
        return RS.exact_accumulator(P(), x, grid), ops[6]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 37), k=st.integers(1, 700), n=st.integers(1, 45), signed=st.booleans(),
       zp=st.integers(-128, 255), seed=st.integers(0, 2**16), lead=st.booleans())
def test_native_sums_equal_the_float32_chunks(monkeypatch, m, k, n, signed, zp, seed, lead):
    g = np.random.default_rng(seed)
    qmin, qmax = (-128, 127) if signed else (0, 255)
    zp = int(np.clip(zp, qmin, qmax))
    grid = (0.0371, zp, qmin, qmax)
    w = g.integers(-127, 128, (n, k)).astype(np.int64)
    codes = g.integers(qmin, qmax + 1, (2, m, k) if lead else (m, k))
    xq = torch.from_numpy((codes - zp).astype(np.float32))
    ref, native = _sums(False, w, grid, xq, monkeypatch)
    got, _ = _sums(True, w, grid, xq, monkeypatch)
    assert native is not None
    assert got.dtype == torch.float64 and torch.equal(got, ref)


def test_codes_off_the_dtype_fall_back(monkeypatch):
    grid = (0.5, 0, 0, 255)
    w = np.ones((3, 4), dtype=np.int64)
    xq = torch.tensor([[1.0, 2.0, -3.0, 4.0]])  # a code below 0: not a uint8
    ref, _ = _sums(False, w, grid, xq, monkeypatch)
    got, native = _sums(True, w, grid, xq, monkeypatch)
    assert native is not None and torch.equal(got, ref)
    assert RS._native_operands(w, grid, False) is None  # sums that need the wrap: float32 chunks
    assert RS._native_operands(np.full((2, 2), 200), grid, True) is None  # weights beyond int8


def _frozen_encoder():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16),
                          nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation="gelu", batch_first=True))
    qdsl.apply(model, Path(__file__).resolve().parents[2] / "specs" / "transformer-int8.qspec")  # GELU: linear1 has an (implied) 8-bit output
    x = torch.randn(4, 6, 16)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    return model.eval(), x


def test_frozen_model_equals_the_float32_chunks(monkeypatch):
    model, x = _frozen_encoder()
    calls = []
    real = RS._native_sums
    monkeypatch.setattr(RS, "_native_sums", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        got = model(x)
        twin = copy.deepcopy(model)  # the packed weights are not copied: packed again
        got2 = twin(x)
    assert calls  # the runtime's GEMM ran
    monkeypatch.setattr(RS, "NATIVE_SUMS", False)
    with torch.no_grad():
        want = model(x)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(got2.view(torch.int32), want.view(torch.int32))

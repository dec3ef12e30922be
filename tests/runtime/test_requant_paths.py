"""The vector output stages (AVX2: 8 lanes + scalar tail; AVX-512: 16 lanes + masked
tail) equal the exact formulas of qdsl/export/requant.py on every path, across column
counts that end blocks at every offset, per-tensor and per-channel parameters, every
kind and rounding, and corner accumulators and multipliers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.export.ir import Rescale  # noqa: E402
from qdsl.export.requant import apply_rescale  # noqa: E402
from qdsl.runtime import kernels as K  # noqa: E402

PATHS = [p for p in ("ref", "portable", "avx2", "avxvnni", "avx512", "amx") if p in K.paths()["cpu"]]
_CORNERS = [0, 1, -1, 127, -128, 255, (1 << 24) + 1, -(1 << 24) - 1, (1 << 30) + 1, (1 << 31) - 1, -(1 << 31),
            -(1 << 31) + 1]


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from([0, 1, 2]), rounding=st.integers(0, 3), cols=st.integers(1, 40),
       per_tensor=st.booleans(), rows=st.integers(1, 5), seed=st.integers(0, 2**31), out_signed=st.booleans())
def test_output_stage_paths_equal_formula(kind, rounding, cols, per_tensor, rows, seed, out_signed):
    rng = np.random.default_rng(seed)
    channels = 1 if per_tensor else cols
    rounding = 0 if kind == 0 else rounding
    if kind == 1:
        mult = np.ones(channels, np.int64)
        shift = rng.integers(-31, 63, channels)
        shift[rng.random(channels) < 0.6] = rng.integers(0, 16)
    else:
        mult = rng.integers(0, 1 << 31, channels)
        mult[rng.random(channels) < 0.2] = (1 << 31) - 1
        mult[rng.random(channels) < 0.2] = 1 << 30
        mult[rng.random(channels) < 0.1] = 0
        shift = rng.integers(-31, 32, channels)
        shift[rng.random(channels) < 0.6] = rng.integers(0, 24)
    acc = rng.integers(-(1 << 31), 1 << 31, (rows, cols))
    acc[0, :] = rng.choice(_CORNERS, cols)
    if rows > 1:
        acc[1, :] = rng.integers(-2000, 2000, cols) * (1 << int(rng.integers(0, 12)))  # rounding ties
    lo, hi = (-128, 127) if out_signed else (0, 255)
    zp = int(rng.integers(lo, hi + 1))
    qmin = int(rng.integers(lo, zp + 1)) if rng.random() < 0.3 else lo
    stage = K.OutputStage(mult, shift, zero_point=zp, qmin=qmin, qmax=hi, kind=kind, rounding=rounding)
    r = Rescale(kind, tuple(int(v) for v in mult), tuple(int(v) for v in shift), rounding)
    want = np.clip(apply_rescale(acc, r, axis=1) + zp, qmin, hi)
    for path in PATHS:
        got = K.requantize(acc.astype(np.int32), stage, np.int8 if out_signed else np.uint8, path=path)
        np.testing.assert_array_equal(got.astype(np.int64), want, err_msg=f"path {path}")

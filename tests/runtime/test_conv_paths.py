"""Int8 convs on the shapes where the optimized conv paths change strategy (AMX implicit
GEMM: row tiles of 16 positions, 64-byte K segments per kernel row or per tap, 16-channel
panels; VNNI/AVX2 im2col paths) equal the Python reference executor bit for bit, on every
kernel path this CPU has."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.export.ir import DType, GraphFormatError, OpType, Tensor  # noqa: E402

from tests.runtime.test_graph import _check, _graph, _rand, _stage  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), rank=st.sampled_from([1, 2, 2]), xdtype=st.sampled_from([DType.I8, DType.U8]),
       out=st.sampled_from([DType.I8, DType.U8, DType.I32]), bias=st.booleans())
def test_int8_conv_geometry_matches_reference(seed, rank, xdtype, out, bias):
    rng = np.random.default_rng(seed)
    cin = int(rng.choice([1, 3, 16, 17, 32, 40, 64, 70]))
    cout = int(rng.choice([1, 8, 16, 17, 33, 48]))
    k = [int(rng.integers(1, 6)) for _ in range(rank)]
    spatial = [int(rng.choice([1, 5, 8, 15, 16, 17, 33])) + k[i] for i, _ in enumerate(range(rank))]
    w = _rand(rng, DType.I8, (cout, cin, *k))
    attrs = {
        "stride": [int(rng.integers(1, 4)) for _ in range(rank)], "padding": [int(rng.integers(0, 4)) for _ in range(rank)],
        "dilation": [int(rng.integers(1, 3)) for _ in range(rank)], "groups": 1,
        "in_zp": int(rng.integers(*xdtype.range)), "w_zp": [0], "acc_bits": 32, "overflow": 0,
    }
    lo, hi = (-(2**31), 2**31 - 1) if out is DType.I32 else out.range
    attrs.update(_stage(rng, cout, lo, hi, pot=False if out is DType.I32 else None))
    consts = [Tensor("w", DType.I8, w.shape, w)]
    if bias:
        consts.append(Tensor("b", DType.I32, (cout,), rng.integers(-5000, 5000, cout)))
    op = OpType.CONV1D if rank == 1 else OpType.CONV2D
    try:
        graph = _graph(op, [("x", xdtype, (-1, cin, *spatial))], attrs, out, consts)
    except GraphFormatError:
        return  # drawn geometry is invalid (window larger than the padded input)
    _check(graph, _rand(rng, xdtype, (int(rng.integers(1, 4)), cin, *spatial)))

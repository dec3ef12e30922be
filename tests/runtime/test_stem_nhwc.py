"""MobileNetV2's first layers channels-last: an RGB stem (fewer than 8 input channels: the
gathered-panel conv, conv_fast.cc) writes its codes NHWC when its one reader is a
channels-last depthwise conv (prepare.cc PlanNhwc, GatheredNhwcReader), the depthwise conv
then reads NHWC rows in place (conv_dw_nhwc.cc) instead of transposing NCHW bands, and the
1x1 projection after it, with 16 output channels, runs as the implicit-GEMM conv
(conv_prepare.cc PrepareIgemm: 1x1 convs from O = 16), so the expansion conv after that reads
NHWC rows too.  The chain equals the Python reference executor bit for bit on every kernel
path this CPU has, at 1 and 2 threads, and the plan says which tensors were NHWC;
``QDSL_GATHERED_DW_NHWC=0`` keeps the stem's output NCHW."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Tensor  # noqa: E402

from tests.runtime.test_depthwise_conv import _with_threads  # noqa: E402
from tests.runtime.test_graph import PATHS, _check, _rand  # noqa: E402
from tests.runtime.test_row_band import _conv  # noqa: E402


def _stem_graph(rng, *, cin, c, o, hw, k, stride, pad, dk, dstride, dpad, s_dtype, s_hi, x_dtype, batch):
    """x (cin < 8 channels) -> stem (k x k, stride, pad; cin -> c) -> s (s_dtype, clamped to s_hi)
    -> depthwise (dk x dk, dstride, dpad) -> d (U8, 7-bit) -> projection (1x1, c -> o) -> p (U8,
    7-bit) -> expansion (1x1, o -> 24) -> y."""
    h, w = hw
    sh, sw = ((n + 2 * pad - k) // stride + 1 for n in (h, w))
    dh, dw = ((n + 2 * dpad - dk) // dstride + 1 for n in (sh, sw))
    tensors = [Tensor("x", x_dtype, (-1, cin, h, w)), Tensor("s", s_dtype, (-1, c, sh, sw)),
               Tensor("d", DType.U8, (-1, c, dh, dw)), Tensor("p", DType.U8, (-1, o, dh, dw)),
               Tensor("y", DType.U8, (-1, 24, dh, dw))]
    ops = []
    for name, src, dst, ci, co, kw in [
            ("stem", "x", "s", cin, c, {"k": (k, k), "stride": stride, "pad": pad, "hi": s_hi, "out_dtype": s_dtype,
                                        "in_zp": int(rng.integers(*x_dtype.range))}),
            ("dw", "s", "d", c, c, {"k": (dk, dk), "stride": dstride, "pad": dpad, "groups": c,
                                    "in_zp": int(rng.integers(0, s_hi + 1)) - (128 if s_dtype == DType.I8 else 0)}),
            ("proj", "d", "p", c, o, {}), ("expand", "p", "y", o, 24, {"hi": 255})]:
        ts, op = _conv(rng, name, src, dst, ci, co, **kw)
        tensors += ts
        ops.append(op)
    graph = IntegerGraph(tensors, ["x"], ["y"], ops).validate()
    x = _rand(rng, x_dtype, (batch, cin, h, w))
    return graph, x


def _layouts(cg, x):
    """Per op name: (runs the implicit-GEMM conv, output stored NHWC) after an AVX2 run."""
    cg.run(x, path="avx2")
    return {p["name"]: (p.get("implicit_gemm"), p["nhwc_output"]) for p in cg.plan()}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), k=st.sampled_from([3, 3, 5]), stride=st.sampled_from([1, 2]),
       dk=st.sampled_from([3, 3, 5]), dstride=st.sampled_from([1, 2]), o=st.sampled_from([16, 16, 17, 20, 24]),
       s_dtype=st.sampled_from([DType.U8, DType.U8, DType.I8]), x_dtype=st.sampled_from([DType.U8, DType.I8]),
       threads=st.sampled_from([1, 2]))
def test_stem_depthwise_projection_nhwc_matches_reference(seed, k, stride, dk, dstride, o, s_dtype, x_dtype, threads):
    """Odd image sizes, 2-7 input channels, 8-37 channels (off the 16/32 multiples), stem and
    depthwise strides 1/2 and padding 0..k//2, 7-bit or full-range U8 / I8 stem codes (the
    depthwise conv's vpmaddubsw kernel or its int16 one), projections to 16-24 channels,
    batches 1-3."""
    rng = np.random.default_rng(seed)
    cin, c = int(rng.integers(2, 8)), int(rng.choice([8, 13, 16, 24, 32, 37]))
    pad, dpad = int(rng.integers(0, k // 2 + 1)), int(rng.integers(0, dk // 2 + 1))
    h, w = int(rng.integers(k + dk + 3, 40)), int(rng.integers(k + dk + 3, 48))
    s_hi = 127 if rng.random() < 0.7 else 255
    graph, x = _stem_graph(rng, cin=cin, c=c, o=o, hw=(h, w), k=k, stride=stride, pad=pad, dk=dk, dstride=dstride,
                           dpad=dpad, s_dtype=s_dtype, s_hi=s_hi, x_dtype=x_dtype, batch=int(rng.integers(1, 4)))
    cg = _with_threads(threads, lambda: _check(graph, x))
    if "avx2" in PATHS:
        lay = _with_threads(threads, lambda: _layouts(cg, x))
        # the stem (gathered) writes NHWC for the channels-last depthwise conv, which writes NHWC
        # for the implicit-GEMM projection (1x1, O >= 16, K = C padded to 4 >= 16)
        proj_ig = -(-c // 4) * 4 >= 16
        assert lay["stem"] == (False, True) and lay["dw"][1] == proj_ig
        assert lay["proj"] == ((True, True) if proj_ig else (False, False))


def test_mobilenet_v2_stem_runs_channels_last():
    """qdsl.zoo's MobileNetV2 (the benchmarks' model: stem 3 -> 32, features.1 32 -> 16) with
    the int8-default spec and 7-bit activations at 3 x 32 x 32: its stem, first depthwise conv
    and 32 -> 16 projection all store NHWC, and the graph equals the reference."""
    import torch

    import qdsl
    from qdsl.zoo.mobilenet import mobilenet_v2

    model = mobilenet_v2()
    qdsl.apply(model, "specs/int8-default.qspec", overrides=["input.bits=7", "output.bits=7"])
    calib = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    qdsl.calibrate(model, [calib[:4], calib[4:]], progress=False)
    qdsl.freeze(model)
    graph, x = qdsl.export(model, calib[:2]), calib[:2].numpy()
    cg = _check(graph, x)
    if "avx2" in PATHS:
        lay = _layouts(cg, x)
        assert lay["features.0.0"] == (False, True) and lay["features.1.conv.0.0"][1], lay
        assert lay["features.1.conv.1"] == (True, True), lay


_CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {root!r})
import qdsl.runtime as rt
from tests.runtime.test_stem_nhwc import _stem_graph, _layouts
from qdsl.graph.ir import DType
from qdsl.graph.reference import execute
graph, x = _stem_graph(np.random.default_rng(5), cin=3, c=32, o=16, hw=(29, 31), k=3, stride=2, pad=1, dk=3,
                       dstride=1, dpad=1, s_dtype=DType.U8, s_hi=127, x_dtype=DType.U8, batch=2)
cg = rt.CompiledGraph(graph)
lay = _layouts(cg, x)
same = bool(np.array_equal(cg.run(x, path="avx2"), execute(graph, [x]).outputs[0]))
print(json.dumps({{"stem": lay["stem"][1], "same": same}}))
"""


@pytest.mark.skipif("avx2" not in PATHS, reason="no AVX2")
@pytest.mark.parametrize("env,nhwc", [("1", True), ("0", False)])
def test_gathered_dw_nhwc_switch(env, nhwc):
    """QDSL_GATHERED_DW_NHWC=0 (read once per process) keeps the stem's output NCHW."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _CHILD.format(root=root)], capture_output=True, text=True,
                         env={**os.environ, "QDSL_GATHERED_DW_NHWC": env}, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"stem": nhwc, "same": True}

"""Row bands (csrc/runtime/ops/conv_dw_nhwc.cc, ConvParams::band_producer): an NHWC
depthwise conv computes the rows of its input from the 1x1 implicit-GEMM conv just before
it (MobileNetV2's expansion convs) into a ring of rows, so that conv's output is never
written whole.  The pair equals the Python reference executor bit for bit on every kernel
path this CPU has, at 1 and 2 threads, inside cache segments too, and the plan says which
convs ran that way; ``QDSL_ROW_BAND=0`` runs the two ops as before."""

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
from tests.runtime.test_depthwise_maddubs import _stage7, mobilenet_v2_7bit  # noqa: E402
from tests.runtime.test_graph import PATHS, _check, _rand  # noqa: E402


def _conv(rng, name, src, dst, cin, cout, *, k=(1, 1), stride=1, pad=0, dil=1, groups=1, hi=127, wlim=127,
          out_dtype=DType.U8, in_zp=None):
    """A CONV2D op with its weight and bias tensors; a FIXED_SINGLE stage onto out_dtype codes
    clamped to [qmin, hi] (I8: shifted down by 128)."""
    wt = rng.integers(-wlim, wlim + 1, (cout, cin // groups, *k))
    wt[rng.random(wt.shape) < 0.1] = -wlim  # pair sums at the edge the exactness proof allows
    attrs = {"stride": [stride, stride], "padding": [pad, pad], "dilation": [dil, dil], "groups": groups,
             "in_zp": int(rng.integers(0, 128)) if in_zp is None else in_zp, "w_zp": [0], "acc_bits": 32,
             "overflow": 0, **_stage7(rng, cout, bool(rng.random() < 0.3), hi)}
    if out_dtype == DType.I8:
        attrs["out_zp"] -= 128
        attrs["out_min"] -= 128
        attrs["out_max"] -= 128
    tensors = [Tensor(f"w_{name}", DType.I8, wt.shape, wt),
               Tensor(f"b_{name}", DType.I32, (cout,), rng.integers(-60000, 60000, cout))]
    return tensors, Op(OpType.CONV2D, name, [src, f"w_{name}", f"b_{name}"], [dst], attrs)


def _pair_graph(rng, *, cin, c, hw, k, stride, pad, dil, pre, post, t_dtype, t_hi, x_dtype):
    """x -> [pre: 1x1 conv to cin channels, NHWC] -> expand (1x1, cin -> c) -> t -> dw (k, stride,
    pad, dil) -> [post: 1x1 conv] -> y.  The expansion reads 7-bit codes (a CLAMP or pre's
    clamp), so its int8 weights run the vpmaddubsw kernel; t is U8 (t_hi = 127: the depthwise
    conv takes its vpmaddubsw kernel too) or I8."""
    h, w = hw
    xmax = 127 if x_dtype == DType.U8 else 0
    tensors = [Tensor("x", x_dtype, (-1, cin if not pre else 8, h, w)),
               Tensor("xc", x_dtype, (-1, cin if not pre else 8, h, w))]
    ops = [Op(OpType.CLAMP, "clamp", ["x"], ["xc"], {"out_min": -128 if x_dtype == DType.I8 else 0, "out_max": xmax})]
    src = "xc"
    if pre:
        ts, op = _conv(rng, "pre", "xc", "p", 8, cin, hi=127, in_zp=0 if x_dtype == DType.U8 else -128)
        tensors += ts + [Tensor("p", DType.U8, (-1, cin, h, w))]
        ops.append(op)
        src = "p"
    in_zp = 0 if (pre or x_dtype == DType.U8) else -128
    ts, op = _conv(rng, "expand", src, "t", cin, c, hi=t_hi, out_dtype=t_dtype, in_zp=in_zp)
    tensors += ts + [Tensor("t", t_dtype, (-1, c, h, w))]
    ops.append(op)
    oh, ow = (h + 2 * pad - dil * (k[0] - 1) - 1) // stride + 1, (w + 2 * pad - dil * (k[1] - 1) - 1) // stride + 1
    t_zp = op.attrs["out_zp"]
    ts, op = _conv(rng, "dw", "t", "d" if post else "y", c, c, k=k, stride=stride, pad=pad, dil=dil, groups=c,
                   hi=127, in_zp=t_zp)
    tensors += ts + [Tensor("d" if post else "y", DType.U8, (-1, c, oh, ow))]
    ops.append(op)
    if post:
        ts, op = _conv(rng, "post", "d", "y", c, 24, hi=255, in_zp=0)
        tensors += ts + [Tensor("y", DType.U8, (-1, 24, oh, ow))]
        ops.append(op)
    return IntegerGraph(tensors, ["x"], ["y"], ops).validate()


def _x(rng, graph, batch):
    t = graph.tensor("x")
    shape = (batch, *t.shape[1:])
    x = _rand(rng, t.dtype, shape)
    hi = 127 if t.dtype == DType.U8 else 0
    x[rng.random(shape) < 0.2] = hi  # codes at the top of the clamp (and above it, clamped)
    return x


def _plan(cg):
    return {p["name"]: p for p in cg.plan()}


@pytest.fixture(autouse=True)
def _igemm_all(monkeypatch):
    # every eligible shape takes the implicit-GEMM conv (small test channel counts included)
    monkeypatch.setenv("QDSL_IGEMM_ALL", "1")


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), stride=st.sampled_from([1, 2]), k=st.sampled_from([(3, 3), (3, 3), (5, 5), (1, 3), (3, 2), (1, 1)]),
       pre=st.booleans(), post=st.booleans(), batch=st.integers(1, 3), threads=st.sampled_from([1, 2]))
def test_row_band_pair_matches_reference(seed, stride, k, pre, post, batch, threads):
    """Odd sizes, stride 1/2, padding 0-2, dilation 1/2, channel counts not a multiple of 16
    or 32, 7-bit and full U8 codes and I8 codes between the two convs, an NCHW or NHWC input
    of the 1x1 conv (padded to 4 channels or not), an NCHW or NHWC output of the depthwise
    conv, batch 1-3, 1/2 threads: equal to the reference on every path, and on AVX2 the
    depthwise conv computed the 1x1 conv's rows."""
    rng = np.random.default_rng(seed)
    cin = int(rng.choice([8, 9, 12, 16, 19]))
    c = int(rng.choice([24, 32, 40, 96, 99]))
    hw = (int(rng.integers(5, 30)), int(rng.integers(5, 30)))
    t_dtype = DType.U8 if rng.random() < 0.8 else DType.I8
    t_hi = 127 if (t_dtype == DType.I8 or rng.random() < 0.7) else 255
    x_dtype = DType.U8 if rng.random() < 0.8 else DType.I8
    pad, dil = int(rng.integers(0, 3)), int(rng.choice([1, 1, 2]))
    # at least one output position: the dilated window fits the padded image
    hw = tuple(max(n, dil * (kk - 1) + 1 - 2 * pad) for n, kk in zip(hw, k))
    graph = _pair_graph(rng, cin=cin, c=c, hw=hw, k=k, stride=stride, pad=pad, dil=dil, pre=pre, post=post,
                        t_dtype=t_dtype, t_hi=t_hi, x_dtype=x_dtype)
    x = _x(rng, graph, batch)
    cg = _with_threads(threads, lambda: _check(graph, x))
    if "avx2" in PATHS:
        _with_threads(threads, lambda: cg.run(x, path="avx2"))
        plan = _plan(cg)
        assert plan["dw"]["row_band"] == "computed"
        assert plan["expand"]["row_band"] == "producer"
        # on the reference path the two run as written
        cg.run(x, path="ref")
        assert _plan(cg)["dw"]["row_band"] is None


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31), kb=st.sampled_from([1, 4, 12, 40, 60]))
def test_row_band_pair_in_cache_segments(seed, kb):
    """Batch 5 with small segment budgets (QDSL_SEGMENT_KB, read per run): the pair runs a
    slice of the batch per pass or whole-batch, never split between the two, and the output
    equals the reference."""
    rng = np.random.default_rng(seed)
    graph = _pair_graph(rng, cin=16, c=48, hw=(int(rng.integers(6, 20)), int(rng.integers(6, 20))), k=(3, 3),
                        stride=int(rng.choice([1, 2])), pad=1, dil=1, pre=bool(rng.random() < 0.5), post=True,
                        t_dtype=DType.U8, t_hi=127, x_dtype=DType.U8)
    x = _x(rng, graph, 5)
    before = os.environ.get("QDSL_SEGMENT_KB")
    os.environ["QDSL_SEGMENT_KB"] = str(kb)
    try:
        cg = _check(graph, x)
        if "avx2" in PATHS:
            cg.run(x, path="avx2")
            plan = _plan(cg)
            assert plan["dw"]["row_band"] == "computed"
            assert plan["expand"]["images_per_pass"] == plan["dw"]["images_per_pass"]
    finally:
        if before is None:
            os.environ.pop("QDSL_SEGMENT_KB")
        else:
            os.environ["QDSL_SEGMENT_KB"] = before


def test_row_band_only_where_it_applies():
    """No row bands when the 1x1 conv's output has another reader (here a graph output too),
    or the conv before the depthwise conv is not 1x1."""
    rng = np.random.default_rng(3)
    graph = _pair_graph(rng, cin=16, c=32, hw=(12, 12), k=(3, 3), stride=1, pad=1, dil=1, pre=False, post=False,
                        t_dtype=DType.U8, t_hi=127, x_dtype=DType.U8)
    two = IntegerGraph(graph.tensors, graph.inputs, ["y", "t"], graph.ops).validate()
    x = _x(rng, graph, 2)
    cg = _check(two, x)
    if "avx2" in PATHS:
        cg.run(x, path="avx2")
        assert _plan(cg)["dw"]["row_band"] is None


_CHILD = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import qdsl.runtime as rt
from qdsl.graph.qgraph import load_graph
cg = rt.CompiledGraph(load_graph(sys.argv[2]))
x = np.load(sys.argv[3])
y = cg.run(x, path="avx2")
np.save(sys.argv[4], y)
print(json.dumps({p["name"]: p.get("row_band") for p in cg.plan()}))
"""


@pytest.mark.skipif("avx2" not in PATHS, reason="row bands run on the AVX2 path")
def test_row_band_env_var_runs_the_two_ops(tmp_path):
    """QDSL_ROW_BAND=0 (read once per process) runs the 1x1 conv and the depthwise conv as two
    ops; both settings give the reference's bytes."""
    from qdsl.graph.reference import execute
    from qdsl.graph.qgraph import save_graph

    rng = np.random.default_rng(7)
    graph = _pair_graph(rng, cin=16, c=40, hw=(17, 13), k=(3, 3), stride=2, pad=1, dil=1, pre=False, post=True,
                        t_dtype=DType.U8, t_hi=127, x_dtype=DType.U8)
    x = _x(rng, graph, 2)
    save_graph(graph, str(tmp_path / "g.qg"))
    np.save(tmp_path / "x.npy", x)
    want = execute(graph, [x]).outputs[0]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for flag, expect in (("0", None), ("1", "computed")):
        env = dict(os.environ, QDSL_ROW_BAND=flag, QDSL_IGEMM_ALL="1")
        out = subprocess.run([sys.executable, "-c", _CHILD, root, str(tmp_path / "g.qg"), str(tmp_path / "x.npy"),
                              str(tmp_path / "y.npy")], env=env, capture_output=True, text=True, check=True)
        assert json.loads(out.stdout.strip().splitlines()[-1])["dw"] == expect
        np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), want)


def test_mobilenet_v2_7bit_row_bands_match_reference():
    """A torchvision-shaped MobileNetV2 (tests.export.tv_models, 3 x 32 x 32) quantized with the bundled
    int8-default spec and 7-bit activations: the C++ runtime equals the reference executor on
    every path (QDSL_IGEMM_ALL unset: the shapes the runtime picks itself), and on AVX2 the
    expansion convs that run as implicit GEMMs are computed by their depthwise convs."""
    os.environ.pop("QDSL_IGEMM_ALL", None)
    graph, x = mobilenet_v2_7bit()
    cg = _check(graph, x)
    if "avx2" in PATHS:
        for threads in (1, 2):
            _with_threads(threads, lambda: cg.run(x, path="avx2"))
            bands = [p for p in cg.plan() if p.get("row_band") == "computed"]
            assert len(bands) >= 5

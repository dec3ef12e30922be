"""The implicit-GEMM conv's vpdpbusd kernels (csrc/kernels/x86/igemm_u8s8_vnni_avx512.cc): on a CPU
with AVX512_VNNI and AVX512VL (e.g. Zen 4, which has no VEX AVX-VNNI, so the runtime's own VNNI
paths stay off and the AVX2 path runs), the AVX2 path's vpmaddubsw-kind convs (7-bit codes or
small weights) run on vpdpbusd instead, bit-identical to the reference; the plan says so
(``implicit_gemm_vnni``), and QDSL_EVEX_VNNI=0 (or its earlier name QDSL_IGEMM_VNNI=0) runs the
vpmaddubsw kernels again.  vpdpbusd is exact for any u8 codes, so exact 8-bit convs (full-range
codes, full-range int8 weights) take that kind too instead of the int16 one, and the int GEMM
(Linear/MatMul) runs its EVEX VNNI kernel on the AVX2 path with no activation-bound scan; with
QDSL_EVEX_VNNI=0 test_kernels.py's GEMM tests run again in a subprocess on the vpmaddubsw/int16
kernels.  Skipped on CPUs without the instructions (the other tests cover the AVX2 kernels there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import DType  # noqa: E402

from tests.runtime.test_conv_igemm import _FIXTURE_OK, _one_conv, threads  # noqa: E402,F401
from tests.runtime.test_graph import PATHS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _cpu_has_vnni() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))


needs_vnni = pytest.mark.skipif(not (_cpu_has_vnni() and "avx2" in PATHS), reason="no AVX512_VNNI + AVX512VL")


@pytest.fixture(autouse=True)
def _every_shape(monkeypatch):
    monkeypatch.setenv("QDSL_IGEMM_ALL", "1")


@needs_vnni
@settings(max_examples=30, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), k=st.sampled_from([1, 1, 3, 5]), stride=st.sampled_from([1, 2]),
       xdtype=st.sampled_from([DType.U8, DType.I8]), out=st.sampled_from([DType.U8, DType.I8, DType.I32]),
       bias=st.booleans(), wmag=st.sampled_from([16, 64]))
def test_vnni_igemm_conv_matches_reference(threads, seed, k, stride, xdtype, out, bias, wmag):
    """Random convs (odd channel counts, padding, dilation, strip and panel tails, batch 1-3)
    whose weights allow the vpmaddubsw kind (within +-64 for full-range codes; any int8 weights
    behind a 7-bit clamp is the driver's other case, the MobileNetV2 test below) equal the
    reference on every path, the AVX2 one running the vpdpbusd kernels (this CPU has them)."""
    rng = np.random.default_rng(seed)
    layouts, kinds = _one_conv(rng, k, stride, xdtype, out, bias, wmag,
                               in_zp=int(rng.integers(-5, 6)) if xdtype is DType.I8 else int(rng.integers(0, 9)))
    assert kinds == {"conv": False}  # the vpmaddubsw kind ran (IgemmConv) ...
    assert layouts["conv"][0]


_SCRIPT = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import qdsl.runtime as rt
from tests.runtime.test_conv_igemm import _one_conv
from qdsl.graph.ir import DType
import tests.runtime.test_graph as tg
from qdsl.graph.qgraph import save_graph
out = {}
for seed in range(6):
    rng = np.random.default_rng(seed)
    _one_conv(rng, 3 if seed % 2 else 1, 1 + seed % 2, DType.U8, DType.U8, True, 64, 2)
# the plan of one conv run on the AVX2 path
from qdsl.graph.ir import IntegerGraph
rng = np.random.default_rng(7)
from tests.runtime.test_conv_igemm import _attrs, _weights
from qdsl.graph.ir import Op, OpType, Tensor
wt = _weights(rng, 40, 30, 3, int(sys.argv[2]))
if int(sys.argv[2]) > 64:
    wt[:, :2, 0, 0] = 127  # a pair vpmaddubsw cannot sum in int16 at code 255
graph = IntegerGraph([Tensor("x", DType.U8, (-1, 30, 9, 11)), Tensor("w", DType.I8, wt.shape, wt),
                      Tensor("y", DType.U8, (-1, 40, 9, 11))], ["x"], ["y"],
                     [Op(OpType.CONV2D, "conv", ["x", "w"], ["y"], _attrs(rng, 40, DType.U8, 3, 1, 1))]).validate()
cg = rt.CompiledGraph(graph)
x = rng.integers(0, 256, (2, 30, 9, 11)).astype(np.uint8)
y = cg.run(x, path="avx2")
plan = cg.plan()[0]
assert np.array_equal(y, tg.execute(graph, [x]).outputs[0])  # == the reference executor
print(json.dumps({"vnni": plan.get("implicit_gemm_vnni"), "int16": plan.get("implicit_gemm_int16"),
                  "evex": rt.kernels.evex_vnni(), "y": y.reshape(-1).tolist()}))
"""


def _run_script(env_extra: dict, wmag: int) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("QDSL_EVEX_VNNI", "QDSL_IGEMM_VNNI")}
    e.update(QDSL_IGEMM_ALL="1", **env_extra)
    res = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT), str(wmag)], env=e, capture_output=True,
                         text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@needs_vnni
@pytest.mark.parametrize("wmag", [64, 127], ids=["small_weights", "full_range_8bit"])
def test_vnni_switch_in_subprocess(wmag):
    """By default (QDSL_EVEX_VNNI unset) the conv runs the vpdpbusd kind, also with full-range
    weights on full-range 8-bit codes (the exact 8-bit graphs, which took the int16 kind before);
    QDSL_EVEX_VNNI=0, and its earlier name QDSL_IGEMM_VNNI=0 (read once per process), turn it
    off: the vpmaddubsw kind for small weights, the int16 kind for full-range ones.  The plan
    keys follow, every conv equals the reference (_one_conv checks), and the outputs of all the
    kernels are the same bytes."""
    on = _run_script({}, wmag)
    assert on["evex"] is True and on["vnni"] is True and on["int16"] is False
    for off_env in ({"QDSL_EVEX_VNNI": "0"}, {"QDSL_IGEMM_VNNI": "0"}):
        off = _run_script(off_env, wmag)
        assert off["evex"] is False and off["vnni"] is False and off["int16"] is (wmag > 64), off_env
        assert off["y"] == on["y"]


@needs_vnni
@settings(max_examples=30, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), k=st.sampled_from([1, 1, 3, 5]), stride=st.sampled_from([1, 2]),
       xdtype=st.sampled_from([DType.U8, DType.I8]), out=st.sampled_from([DType.U8, DType.I8, DType.I32]),
       bias=st.booleans(), zp_at=st.sampled_from(["lo", "hi", "mid", "zero"]))
def test_vnni_igemm_exact_8bit_conv_matches_reference(threads, seed, k, stride, xdtype, out, bias, zp_at):
    """Exact 8-bit convs (full-range U8/I8 codes incl. both ends, full-range int8 weights with a
    pair vpmaddubsw would saturate, input zero points at the dtype's ends, odd C/O, padding,
    dilation, batch 1-3, 1/2 threads) run the vpdpbusd kind, not the int16 one, and equal the
    reference on every path."""
    rng = np.random.default_rng(seed)
    lo, hi = xdtype.range
    in_zp = {"lo": lo, "hi": hi, "mid": int(rng.integers(lo, hi + 1)), "zero": 0}[zp_at]
    layouts, kinds = _one_conv(rng, k, stride, xdtype, out, bias, 127, in_zp)
    assert kinds == {"conv": False}  # not the int16 kind
    assert layouts["conv"][0]


@needs_vnni
def test_gemm_kernel_tests_pass_with_evex_vnni_off():
    """QDSL_EVEX_VNNI=0: test_kernels.py's int GEMM tests (hypothesis shapes, zero points, the
    activation bound and its check, the output stage, threads) on the vpmaddubsw / int16 AVX2
    kernels, which the default no longer runs on this CPU."""
    e = {k: v for k, v in os.environ.items() if k not in ("QDSL_EVEX_VNNI", "QDSL_IGEMM_VNNI", "QDSL_KERNELS")}
    e["QDSL_EVEX_VNNI"] = "0"
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           str(ROOT / "tests" / "runtime" / "test_kernels.py"), "-k", "gemm"]
    out = subprocess.run(cmd, env=e, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


@needs_vnni
def test_igemm_conv_tests_pass_with_evex_vnni_off():
    """QDSL_EVEX_VNNI=0: test_conv_igemm.py (register stage, fused ADD, twins, inverted residual
    blocks, row tables) on the vpmaddubsw / int16 AVX2 kernels and their AVX2 stages (the int32
    tile passes for twins and fused ADDs; the convs by kernel rows, ConvParams::ig_rows, and the RGB
    stems before a max pool), which the default no longer runs on this CPU; and the
    twin test of this file, whose convs then take those paths."""
    e = {k: v for k, v in os.environ.items() if k not in ("QDSL_EVEX_VNNI", "QDSL_IGEMM_VNNI", "QDSL_KERNELS")}
    e["QDSL_EVEX_VNNI"] = "0"
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")])
    probe = subprocess.run([sys.executable, "-c", "import qdsl.runtime as rt; print(rt.kernels.evex_vnni())"], env=e,
                           cwd=ROOT, capture_output=True, text=True)
    assert probe.stdout.strip() == "False", probe.stdout + probe.stderr
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           str(ROOT / "tests" / "runtime" / "test_conv_igemm.py"),
           str(ROOT / "tests" / "runtime" / "test_igemm_vnni.py") + "::test_vnni_igemm_twin_from_registers_matches_reference"]
    out = subprocess.run(cmd, env=e, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


@needs_vnni
def test_vnni_mobilenet_v2_7bit_matches_reference(monkeypatch):
    """A torchvision-shaped MobileNetV2 at 7-bit activations (any int8 weights behind the 7-bit
    clamp: the driver's main case, with row bands and segments) equals the reference on every
    path (the shapes the runtime picks itself), and on AVX2 its 1x1 convs ran on vpdpbusd."""
    from tests.runtime.test_depthwise_maddubs import mobilenet_v2_7bit
    from tests.runtime.test_graph import _check

    monkeypatch.delenv("QDSL_IGEMM_ALL")
    graph, x = mobilenet_v2_7bit()
    cg = _check(graph, x)
    cg.run(x, path="avx2")
    vnni = [p["name"] for p in cg.plan() if p.get("implicit_gemm_vnni")]
    assert len(vnni) >= 10, cg.plan()


def _twin_block(rng, k, cin, c, h, w, stride, twin_kind, u8_rounding, ties, per_tensor):
    """x -> clamp (7-bit) -> proj (k x k, U8, FIXED_SINGLE) with its I32 twin proj_i32 (same
    conv, `twin_kind` stage: "fixed" FIXED_SINGLE with left or right shifts, "pot" POT shifts,
    "ident" POT 0) -> blk (1x1 on proj, I32) + proj_i32 -> ADD (U8, POT, fused into blk) ->
    head -> y: a MobileNetV2 projection, the next block and its residual ADD, as exported."""
    from qdsl.graph.ir import IntegerGraph, Op, OpType, OutputStage, Rescale, RescaleKind, Tensor
    from qdsl.graph.requant import make_rescale
    from tests.runtime.test_conv_igemm import _attrs, _weights

    pad = k // 2
    oh, ow = ((n + 2 * pad - k) // stride + 1 for n in (h, w))
    n_scales = 1 if per_tensor else c
    if ties:  # about one sum in 2^k on a rounding tie: most calls take the exact recompute
        scales = rng.choice([1.0, 3.0, 5.0], n_scales) * 2.0 ** -rng.integers(6, 12, n_scales).astype(np.float64)
    else:
        scales = rng.uniform(1e-4, 0.05, n_scales)
    zp = int(rng.integers(0, 128))
    qmin = zp if rng.random() < 0.4 else int(rng.integers(0, zp + 1))
    u8 = OutputStage(make_rescale(scales, u8_rounding, allow_pot=False, single=True), zp, qmin, 127)
    r32 = int(rng.integers(0, 4))
    n32 = 1 if rng.random() < 0.3 else c
    if twin_kind == "fixed":  # factors 2^-6 .. 2^12: right shifts and left ones (the exported twins' ~2^10)
        f = 2.0 ** rng.uniform(-6, 12, n32)
        twin = OutputStage(make_rescale(f, r32, allow_pot=False, single=True), 0, -(2**31), 2**31 - 1)
    elif twin_kind == "pot":
        twin = OutputStage(Rescale(RescaleKind.POT, [1] * n32, [int(s) for s in rng.integers(-12, 12, n32)], r32),
                           0, -(2**31), 2**31 - 1)
    else:
        twin = OutputStage(Rescale(RescaleKind.POT, [1] * n32, [0] * n32, r32), 0, -(2**31), 2**31 - 1)
    if rng.random() < 0.3:  # a clamp on the I32 output
        twin = OutputStage(twin.rescale, 0, int(rng.integers(-(2**20), 0)), int(rng.integers(0, 2**20)))
    base = {"stride": [stride, stride], "padding": [pad, pad], "dilation": [1, 1], "groups": 1, "in_zp": 0,
            "w_zp": [0], "acc_bits": 32, "overflow": 0}
    wp, wb, wh = _weights(rng, c, cin, k, 127), _weights(rng, c, c, 1, 127), _weights(rng, 17, c, 1, 127)
    tensors = [Tensor("x", DType.U8, (-1, cin, h, w)), Tensor("xc", DType.U8, (-1, cin, h, w)),
               Tensor("wp", DType.I8, wp.shape, wp), Tensor("bp", DType.I32, (c,), rng.integers(-20000, 20000, c)),
               Tensor("wb", DType.I8, wb.shape, wb), Tensor("wh", DType.I8, wh.shape, wh),
               Tensor("p", DType.U8, (-1, c, oh, ow)), Tensor("p32", DType.I32, (-1, c, oh, ow)),
               Tensor("b32", DType.I32, (-1, c, oh, ow)), Tensor("sum", DType.U8, (-1, c, oh, ow)),
               Tensor("y", DType.U8, (-1, 17, oh, ow))]
    # the exported ADD: both I32 inputs on one grid (POT 0), a POT output stage
    in_rq = {"in_zp": [0, 0], "in_kind": [1, 1], "in_multiplier": [1, 1], "in_shift": [0, 0], "in_rounding": [0, 0]}
    add_out = OutputStage(Rescale(RescaleKind.POT, [1], [int(rng.integers(8, 14))], int(rng.integers(0, 4))),
                          int(rng.integers(0, 128)), 0, 127)
    blk = OutputStage(make_rescale(2.0 ** rng.uniform(-2, 2, c), int(rng.integers(0, 4)), allow_pot=False, single=True),
                      0, -(2**31), 2**31 - 1)
    ops = [Op(OpType.CLAMP, "clamp", ["x"], ["xc"], {"out_min": 0, "out_max": 127}),
           Op(OpType.CONV2D, "proj", ["xc", "wp", "bp"], ["p"], {**base, **u8.attrs()}),
           Op(OpType.CONV2D, "proj_i32", ["xc", "wp", "bp"], ["p32"], {**base, **twin.attrs()}),
           Op(OpType.CONV2D, "blk", ["p", "wb"], ["b32"], {**base, "stride": [1, 1], "padding": [0, 0], **blk.attrs()}),
           Op(OpType.ADD, "add", ["p32", "b32"], ["sum"], {**in_rq, "pre_shift": 0, **add_out.attrs()}),
           Op(OpType.CONV2D, "head", ["sum", "wh"], ["y"], _attrs(rng, 17, DType.U8, 1, 1, 0, in_zp=0))]
    return IntegerGraph(tensors, ["x"], ["y"], ops).validate()


@needs_vnni
@settings(max_examples=40, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), k=st.sampled_from([1, 1, 3]), stride=st.sampled_from([1, 1, 2]),
       twin_kind=st.sampled_from(["fixed", "fixed", "pot", "ident"]), u8_rounding=st.integers(0, 3),
       ties=st.booleans(), per_tensor=st.booleans())
def test_vnni_igemm_twin_from_registers_matches_reference(threads, seed, k, stride, twin_kind, u8_rounding, ties,
                                                         per_tensor):
    """A conv whose U8 output and I32 twin (the copy a residual ADD reads, as in exported
    MobileNetV2s) are both stored NHWC writes both from the kernel's registers (the AVX-512
    epilogue, IgemmStageTwinKernel): U8 FIXED_SINGLE stages of every rounding (ties: most calls
    recompute exactly), I32 FIXED_SINGLE stages with left shifts (sums that saturate x * 2^left
    take the reference rule) and right shifts, POT shifts of both signs and 0, every rounding,
    clamps; odd channel counts (partial panels: masked stores), M tails, batch 1-3, 1 and 2
    threads.  Both outputs, the ADD that reads the twin and the head equal the reference on
    every path; the plan shows the I32 twin's stage prepared for the registers and the next
    conv's fused ADD applied from its registers (IgemmStageAddKernel)."""
    from tests.runtime.test_graph import _check

    rng = np.random.default_rng(seed)
    cin, c = int(rng.choice([8, 13, 16, 30])), int(rng.choice([8, 16, 17, 24, 40]))
    h, w = int(rng.integers(k, k + 12)), int(rng.integers(k, k + 16))
    graph = _twin_block(rng, k, cin, c, h, w, stride, twin_kind, u8_rounding, ties, per_tensor)
    x = rng.integers(0, 256, (int(rng.integers(1, 4)), cin, h, w)).astype(np.uint8)
    cg = _check(graph, x)
    cg.run(x, path="avx2")
    plan = {p["name"]: p for p in cg.plan()}
    assert plan["proj"]["nhwc_output"] and plan["proj_i32"]["nhwc_output"]
    assert plan["proj"]["register_stage"] and plan["proj_i32"]["register_stage"]
    # blk (1x1, K = c <= 40) takes the ADD into its epilogue, from the registers unless
    # QDSL_EVEX_VNNI=0 (test_igemm_conv_tests_pass_with_evex_vnni_off reruns this test so)
    assert plan["blk"]["fused_add_stage"]
    assert plan["blk"]["fused_add_registers"] is rt.kernels.evex_vnni()

"""Cache-aware segments (csrc/runtime/segment.cc): runs of per-image ops whose whole-batch
tensors outgrow a cache budget run a slice of the batch at a time.  The outputs must be the
same bytes as the whole-batch run (``QDSL_SEGMENT=0``) and the reference's, with the overflow
counts summed over the slices, on every kernel path, at 1 and 2 threads, for any batch and
slice size (a small ``QDSL_SEGMENT_KB`` budget segments small graphs).  The graphs are
MobileNetV2 / ResNet-shaped: an F32 input quantized, a strided stem, depthwise and 1x1 convs,
a residual ADD the project conv computes itself (fused), twin convs, pools, and an op that
ends the segments; the plan (``CompiledGraph.plan()["images_per_pass"]``) must say the
early ops ran sliced, and never an op outside the per-image set."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qdsl.runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason=f"C++ runtime not built: {rt.load_error()}")

from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Rescale, Tensor  # noqa: E402
from qdsl.graph.reference import execute  # noqa: E402

from tests.runtime.test_graph import PATHS, _rand, _stage  # noqa: E402

_FIXTURE_OK = [HealthCheck.function_scoped_fixture]
# the ops the planner may put in a segment (segment.cc PerImageOpcode)
_PER_IMAGE = {OpType.QUANTIZE, OpType.REQUANTIZE, OpType.CONV2D, OpType.ADD, OpType.CLAMP, OpType.MAXPOOL2D,
              OpType.AVGPOOL2D}


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = rt.get_num_threads()
    rt.set_num_threads(request.param)
    yield request.param
    rt.set_num_threads(before)


class _Builder:
    """A graph built op by op with random quantization parameters (NCHW shapes, batch -1)."""

    def __init__(self, rng, seven_bit: bool):
        self.rng, self.tensors, self.ops, self.shapes = rng, [], [], {}
        self.hi = 127 if seven_bit else 255  # the activations' clamp (7-bit: MobileNetV2 a7)

    def _act(self, name, dtype, shape):
        self.tensors.append(Tensor(name, dtype, (-1, *shape)))
        self.shapes[name] = (dtype, tuple(shape))
        return name

    def input(self, c, h, w):
        return self._act("x", DType.F32, (c, h, w))

    def quantize(self, x):
        c, h, w = self.shapes[x][1]
        self.ops.append(Op(OpType.QUANTIZE, "quant", [x], ["q"], {"scale": 0.03, "zero_point": 60, "qmin": 0,
                                                                 "qmax": self.hi, "rounding": 1}))
        return self._act("q", DType.U8, (c, h, w))

    def conv(self, name, x, cout, k, stride=1, depthwise=False, out=DType.U8, weights=None, bias=None, in_zp=None):
        rng = self.rng
        cin, h, w = self.shapes[x][1]
        groups = cin if depthwise else 1
        cout = cin if depthwise else cout
        pad = k // 2
        if weights is None:
            weights = np.clip(rng.integers(-127, 128, (cout, cin // groups, k, k)), -64, 64).astype(np.int8)
            bias = rng.integers(-3000, 3000, cout)
        self.tensors += [Tensor(name + ".w", DType.I8, weights.shape, weights),
                         Tensor(name + ".b", DType.I32, (cout,), bias)]
        if out is DType.I32:  # the exporter's residual accumulator: the sums as they are
            stage = OutputStage(Rescale(1, (1,), (0,), 0), 0, -(2**31), 2**31 - 1).attrs()
        else:
            stage = _stage(rng, cout, 0, self.hi)
        attrs = {"stride": [stride, stride], "padding": [pad, pad], "dilation": [1, 1], "groups": groups,
                 "in_zp": int(rng.integers(0, 40)) if in_zp is None else in_zp, "w_zp": [0], "acc_bits": 32, "overflow": 0, **stage}
        self.ops.append(Op(OpType.CONV2D, name, [x, name + ".w", name + ".b"], [name], attrs))
        oh, ow = ((n + 2 * pad - k) // stride + 1 for n in (h, w))
        return self._act(name, out, (cout, oh, ow)), (weights, bias)

    def add(self, name, a, b):
        """ADD of an I32 accumulator (taken as is) and an 8-bit tensor rescaled up to it."""
        rng = self.rng
        self.ops.append(Op(OpType.ADD, name, [a, b], [name], {
            "in_zp": [0, int(rng.integers(0, 20))], "in_kind": [1, 1], "in_multiplier": [1, 1],
            "in_shift": [0, -int(rng.integers(3, 9))], "in_rounding": [1, 1], "pre_shift": 0,
            **OutputStage(Rescale(1, (1,), (int(rng.integers(8, 13)),), 1), int(rng.integers(0, 20)), 0,
                          self.hi).attrs()}))
        return self._act(name, DType.U8, self.shapes[b][1])

    def maxpool(self, name, x):
        c, h, w = self.shapes[x][1]
        self.ops.append(Op(OpType.MAXPOOL2D, name, [x], [name], {"kernel": [2, 2], "stride": [2, 2],
                                                                 "padding": [0, 0], "dilation": [1, 1]}))
        return self._act(name, DType.U8, (c, h // 2, w // 2))

    def global_pool(self, name, x):
        c = self.shapes[x][1][0]
        self.ops.append(Op(OpType.GLOBAL_AVGPOOL, name, [x], [name], {"in_zp": 3, **_stage(self.rng, 1, 0, 255)}))
        return self._act(name, DType.U8, (c, 1, 1))

    def graph(self, outputs):
        return IntegerGraph(self.tensors, ["x"], outputs, self.ops).validate()


def _mobilenet_like(rng, seven_bit, hw, widths=(8, 16, 8, 24)):
    """Quantize, stem 3x3/2, depthwise, 1x1; an inverted residual (expand, depthwise, project to
    I32, ADD); twin 1x1/2 convs (U8 and I32 outputs of the same sums) joined by an ADD; a max
    pool; a global pool that no segment may take.  Graph outputs: the depthwise's output too
    (read outside any segment) and the last tensor."""
    c1, c2, c3, c4 = widths
    b = _Builder(rng, seven_bit)
    q = b.quantize(b.input(3, hw, hw))
    t1, _ = b.conv("stem", q, c1, 3, stride=2)
    t2, _ = b.conv("dw1", t1, 0, 3, depthwise=True)
    t3, _ = b.conv("pw1", t2, c2, 1)
    e, _ = b.conv("expand", t3, c3, 1)
    d, _ = b.conv("dw2", e, 0, 3, depthwise=True)
    pj, _ = b.conv("project", d, c2, 1, out=DType.I32)
    r = b.add("res", pj, t3)
    ta, wb = b.conv("twin_a", r, c4, 1, stride=2, in_zp=5)
    tb, _ = b.conv("twin_b", r, c4, 1, stride=2, out=DType.I32, weights=wb[0], bias=wb[1], in_zp=5)
    j = b.add("join", tb, ta)
    m = b.maxpool("pool", j)
    gp = b.global_pool("gpool", m)
    return b.graph([t2, gp])


def _run(cg, x, path, env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        out = cg.run(x, path=path)
        return out, cg.overflow_counts(), {p["name"]: p["images_per_pass"] for p in cg.plan()}
    finally:
        for k in env:
            monkeypatch.delenv(k)


def _check_segmented(graph, x, budget_kb, monkeypatch):
    """Every path: the segmented run == the whole-batch run == the reference; returns the
    plan's images per pass (last path) by op name."""
    want = execute(graph, [x])
    cg = rt.CompiledGraph(graph)
    steps = None
    for path in PATHS:
        whole, wc, wsteps = _run(cg, x, path, {"QDSL_SEGMENT": "0"}, monkeypatch)
        assert not any(wsteps.values())  # QDSL_SEGMENT=0: no segments
        seg, sc, steps = _run(cg, x, path, {"QDSL_SEGMENT_KB": str(budget_kb)}, monkeypatch)
        for got_w, got_s, w in zip(whole, seg, want.outputs):
            np.testing.assert_array_equal(got_s, got_w, err_msg=f"path {path}: segmented vs whole batch")
            np.testing.assert_array_equal(got_s, w, err_msg=f"path {path}: segmented vs reference")
        assert sc == wc
    return steps


@settings(max_examples=20, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(seed=st.integers(0, 2**31), batch=st.integers(1, 9), hw=st.sampled_from([12, 15, 16, 21]),
       budget_kb=st.sampled_from([1, 2, 3, 5, 8]), seven_bit=st.booleans())
def test_segmented_runs_equal_whole_batch(threads, monkeypatch, seed, batch, hw, budget_kb, seven_bit):
    rng = np.random.default_rng(seed)
    graph = _mobilenet_like(rng, seven_bit, hw)
    x = (rng.standard_normal((batch, 3, hw, hw)) * 2).astype(np.float32)
    steps = _check_segmented(graph, x, budget_kb, monkeypatch)
    kinds = {op.name: op.type for op in graph.ops}
    assert all(kinds[n] in _PER_IMAGE for n, s in steps.items() if s), steps
    assert all(s < batch for s in steps.values())
    if batch >= 2 and budget_kb == 1:  # (the dense 3x3 stem stays whole-batch, and so the quantize before it)
        assert steps["dw1"] == 1 and steps["pw1"] == 1 and steps["twin_b"] == 1, steps
        assert steps["stem"] == 0 and steps["quant"] == 0, steps


@pytest.mark.parametrize("batch", [5, 8, 9])
def test_nhwc_planned_tensors_inside_segments(threads, monkeypatch, batch):
    """Every conv eligible for the implicit-GEMM NHWC conv (QDSL_IGEMM_ALL), so the segments'
    tensors are stored NHWC (a slice is still whole images); a budget of two images of the
    residual ADD (9 KiB each), so the slices hold 2 images and the last one 1 when the batch is odd."""
    monkeypatch.setenv("QDSL_IGEMM_ALL", "1")
    rng = np.random.default_rng(batch)
    graph = _mobilenet_like(rng, True, 16, widths=(16, 24, 32, 16))
    x = (rng.standard_normal((batch, 3, 16, 16)) * 2).astype(np.float32)
    steps = _check_segmented(graph, x, 20, monkeypatch)
    assert steps["project"] == steps["res"] == 2, steps
    if "avx2" in PATHS:
        cg = rt.CompiledGraph(graph)
        monkeypatch.setenv("QDSL_SEGMENT_KB", "20")
        cg.run(x, path="avx2")
        assert any(p["nhwc_output"] and p["images_per_pass"] for p in cg.plan())


def test_mobilenet_v2_stem_is_segmented_by_default(monkeypatch):
    """MobileNetV2's first layers at 224 x 224 with the default budget: at batch 8 every op from
    the first depthwise to the stride-2 depthwise runs one image at a time (their whole-batch
    tensors are 3-10 MB; the dense 3x3 stem stays whole-batch); at batch 1 nothing is
    segmented; the outputs equal the whole-batch run's."""
    monkeypatch.delenv("QDSL_SEGMENT", raising=False)
    monkeypatch.delenv("QDSL_SEGMENT_KB", raising=False)
    rng = np.random.default_rng(0)
    b = _Builder(rng, True)
    q = b.quantize(b.input(3, 224, 224))
    t, _ = b.conv("stem", q, 32, 3, stride=2)
    t, _ = b.conv("dw1", t, 0, 3, depthwise=True)
    t, _ = b.conv("pw1", t, 16, 1)
    t, _ = b.conv("expand", t, 96, 1)
    t, _ = b.conv("dw2", t, 0, 3, stride=2, depthwise=True)
    t, _ = b.conv("project", t, 24, 1)
    graph = b.graph([t])
    cg = rt.CompiledGraph(graph)
    x = (rng.standard_normal((8, 3, 224, 224)) * 2).astype(np.float32)
    seg = cg.run(x)
    steps = {p["name"]: p["images_per_pass"] for p in cg.plan()}
    assert [steps[n] for n in ("dw1", "pw1", "expand", "dw2")] == [1] * 4 and steps["stem"] == 0, steps
    monkeypatch.setenv("QDSL_SEGMENT", "0")
    np.testing.assert_array_equal(seg, cg.run(x))
    monkeypatch.delenv("QDSL_SEGMENT")
    cg.run(x[:1])
    assert not any(p["images_per_pass"] for p in cg.plan())


def test_weight_heavy_convs_stay_whole_batch(monkeypatch):
    """1x1 convs with 256 channels at 7 x 7 (64 KB of weights, 25 KB of activations per
    image): a pass would re-read the weights, so even at batch 64 (1.6 MB of tensors per conv)
    they are not segmented; 1x1 convs on a 56 x 56 plane with 16 channels (activation-heavy)
    are; dense 3x3 convs (ResNet's) never are (their batch-1 tiling is slower per image)."""
    monkeypatch.delenv("QDSL_SEGMENT", raising=False)
    monkeypatch.delenv("QDSL_SEGMENT_KB", raising=False)
    rng = np.random.default_rng(1)
    for c, hw, k, segmented in ((256, 7, 1, False), (16, 56, 1, True), (16, 56, 3, False)):
        b = _Builder(rng, True)
        q = b.quantize(b.input(c, hw, hw))
        t, _ = b.conv("a", q, c, k)
        t, _ = b.conv("b", t, c, k)
        cg = rt.CompiledGraph(b.graph([t]))
        cg.run((rng.standard_normal((64, c, hw, hw))).astype(np.float32))
        steps = {p["name"]: p["images_per_pass"] for p in cg.plan()}
        assert (steps["a"] > 0 and steps["b"] > 0) == segmented, (c, hw, k, steps)

"""nn.Upsample / F.interpolate lower to RESIZE (qdsl/export/lower_resize.py, docs/qgraph.md §4.4):
nearest is an exact copy of codes, (bi)linear interpolates with 11-bit fixed-point weights and
rounds once at the output quantizer.  Models with specs/int8-default.qspec unedited go
apply -> train -> calibrate -> freeze -> export; C++ == reference; graph vs fake-quant."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdsl
from qdsl.export.lower_resize import FRAC_BITS, linear_taps
from qdsl.export.values import ExportError
from qdsl.graph import execute
from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Rescale, Rounding, Tensor

from .e2e import assert_close, flow, op_types


class UpNet(nn.Module):
    """conv -> BN -> ReLU(inplace) -> upsample -> conv (U-Net decoder style)."""

    def __init__(self, up, rank: int = 2):
        super().__init__()
        conv = nn.Conv2d if rank == 2 else nn.Conv1d
        bn = nn.BatchNorm2d if rank == 2 else nn.BatchNorm1d
        self.c1 = conv(3, 8, 3, padding=1)
        self.bn = bn(8)
        self.relu = nn.ReLU(inplace=True)
        self.up = up
        self.c2 = conv(8, 4, 3, padding=1)

    def forward(self, x):
        y = self.relu(self.bn(self.c1(x)))
        y = self.up(y) if isinstance(self.up, nn.Module) else self.up(y)
        return self.c2(y)


class FnUp(nn.Module):
    """A parameterless holder so F.interpolate is called from a module's forward."""

    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, x):
        return F.interpolate(x, **self.kw)


UPSAMPLES = {
    "nearest-x2": (lambda: nn.Upsample(scale_factor=2), 2),
    "nearest-x3x2": (lambda: nn.Upsample(scale_factor=(3, 2)), 2),
    "nearest-size": (lambda: nn.Upsample(size=(9, 13)), 2),
    "nearest-exact-size": (lambda: nn.Upsample(size=(11, 7), mode="nearest-exact"), 2),
    "UpsamplingNearest2d": (lambda: nn.UpsamplingNearest2d(scale_factor=2), 2),
    "bilinear-x2": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), 2),
    "bilinear-x2-ac": (lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), 2),
    "bilinear-size": (lambda: nn.Upsample(size=(9, 13), mode="bilinear"), 2),
    "bilinear-size-ac": (lambda: nn.Upsample(size=(9, 13), mode="bilinear", align_corners=True), 2),
    "bilinear-x1.5": (lambda: nn.Upsample(scale_factor=1.5, mode="bilinear"), 2),
    "UpsamplingBilinear2d": (lambda: nn.UpsamplingBilinear2d(scale_factor=2), 2),
    "F.interpolate-bilinear": (lambda: FnUp(scale_factor=2, mode="bilinear", align_corners=False), 2),
    "F.interpolate-nearest": (lambda: FnUp(size=(12, 10)), 2),
    "linear-1d-x2": (lambda: nn.Upsample(scale_factor=2, mode="linear"), 1),
    "linear-1d-size-ac": (lambda: nn.Upsample(size=17, mode="linear", align_corners=True), 1),
    "nearest-1d-x4": (lambda: nn.Upsample(scale_factor=4), 1),
}


DYADIC = {"bilinear-x2", "linear-1d-x2", "F.interpolate-bilinear"}


@pytest.mark.parametrize("spec", ["int8-default", "pot-asic"])
@pytest.mark.parametrize("name", sorted(UPSAMPLES))
def test_upsample_models_export_and_agree(name, spec):
    build, rank = UPSAMPLES[name]
    model = UpNet(build(), rank)
    shape = (4, 3, 6, 5) if rank == 2 else (4, 3, 7)
    graph, diff = flow(model, spec, shape, "c2")
    assert OpType.RESIZE in op_types(graph)
    # nearest copies codes: exact on every spec; linear rounds once, within 1 LSB; with
    # power-of-two scales and dyadic weights (x2, align_corners=False: 1/4, 3/4) the whole
    # interpolation is exact integer arithmetic and a shift: bit-exact
    assert_close(diff, exact="nearest" in name.lower() or (spec == "pot-asic" and name in DYADIC))


def test_nearest_is_a_copy_of_codes_on_a_quantized_value():
    # c1's output quantized (an explicit rule), then nearest: RESIZE with the identity stage
    model = UpNet(nn.Upsample(scale_factor=2))
    spec = (open("specs/int8-default.qspec").read() + "\nrule c1 {\n  output = a8\n}\n")
    graph, diff = flow(model, spec, (2, 3, 5, 4), "c2")
    op = next(op for op in graph.ops if op.type is OpType.RESIZE)
    assert op.attrs["frac_bits"] == 0 and set(op.attrs["weight"]) == {0}
    assert Rescale.from_attrs(op.attrs) == Rescale.identity() and op.attrs["in_zp"] == op.attrs["out_zp"] == 0
    assert diff.max() == 0


@pytest.mark.parametrize("n_in,n_out,ac,scale", [
    (5, 10, False, 2.0), (5, 10, True, None), (6, 9, False, None), (6, 9, True, None), (4, 6, False, 1.5),
    (7, 3, False, None), (7, 3, True, None), (1, 4, False, None), (1, 4, True, None), (4, 1, True, None),
])
def test_linear_taps_are_torchs_coordinates(n_in, n_out, ac, scale):
    # interpolating the positions themselves gives torch's source coordinate i0 + λ
    pos = torch.arange(n_in, dtype=torch.float64).reshape(1, 1, n_in)
    kw = dict(scale_factor=scale) if scale else dict(size=n_out)
    src = F.interpolate(pos, mode="linear", align_corners=ac, **kw).reshape(-1).numpy()
    assert src.size == n_out
    i0, w = linear_taps(n_in, n_out, ac, scale)
    i1 = np.minimum(np.array(i0) + 1, n_in - 1)
    ours = (np.array(i0) * ((1 << FRAC_BITS) - np.array(w)) + i1 * np.array(w)) / (1 << FRAC_BITS)
    np.testing.assert_allclose(ours, src, atol=2.0 ** -(FRAC_BITS + 1) * max(1, n_in))


def _graph(x_shape, out_dtype, attrs):
    x = Tensor("x", DType.U8, x_shape)
    y = Tensor("y", out_dtype, x_shape[:2] + tuple(attrs["size"]))
    return IntegerGraph([x, y], ["x"], ["y"], [Op(OpType.RESIZE, "up", ["x"], ["y"], attrs)]).validate()


@pytest.mark.parametrize("size,ac", [((12, 10), False), ((12, 10), True), ((11, 17), False), ((11, 17), True),
                                     ((9, 7), False), ((4, 3), False)])
def test_bilinear_error_vs_float_bilinear(size, ac, capsys):
    # RESIZE on codes at one grid (s_in = s_out, zero point 131, rounding half-even) against
    # (a) the exact bilinear of the codes (float64, torch's coordinates) rounded the same way:
    #     only the 11-bit weights can move a code, and
    # (b) torch's float32 bilinear of the dequantized values (scale 0.05), the fake-quant
    #     model's arithmetic: float rounding also decides the exact ties (x2: weights 1/4, 3/4
    #     put many values on a half code)
    from qdsl.graph.requant import make_rescale

    rng = np.random.default_rng(0)
    h, w, zp, s = 6, 5, 131, 0.05
    q = rng.integers(0, 256, (8, 4, h, w))
    index, weight = [], []
    for n_in, n_out in zip((h, w), size):
        i0, wt = linear_taps(n_in, n_out, ac, None)
        index += i0
        weight += wt
    rq = make_rescale(1.0 / (1 << 2 * FRAC_BITS), Rounding.HALF_EVEN, True, single=True)
    g = _graph(q.shape, DType.U8, dict(size=size, index=tuple(index), weight=tuple(weight), frac_bits=FRAC_BITS,
                                       in_zp=zp, **rq.attrs(), out_zp=zp, out_min=0, out_max=255))
    got = execute(g, q.astype(np.uint8)).outputs[0].astype(np.int64)
    exact64 = F.interpolate(torch.tensor(q - zp, dtype=torch.float64), size=size, mode="bilinear", align_corners=ac)
    want64 = np.clip(np.rint(exact64.numpy()) + zp, 0, 255).astype(np.int64)
    real = torch.tensor((q - zp) * s, dtype=torch.float32)
    want_real = F.interpolate(real, size=size, mode="bilinear", align_corners=ac)
    want32 = np.clip(np.rint(want_real.numpy() / np.float32(s)) + zp, 0, 255).astype(np.int64)
    d64, d32 = np.abs(got - want64), np.abs(got - want32)
    same64, same32 = np.mean(d64 == 0), np.mean(d32 == 0)
    with capsys.disabled():
        print(f"\nbilinear {q.shape[2:]}->{size} align_corners={ac}: equal to exact bilinear on {same64:.4%} of codes "
              f"(max diff {d64.max()}), to torch float32 bilinear on {same32:.4%} (max diff {d32.max()})")
    assert d64.max() <= 1 and d32.max() <= 1
    # a code differs from the exact one only where the 11-bit weights (error <= 2^-12 per tap
    # pair and axis, times |x1 - x0| <= 255) can cross a rounding boundary
    bound = 2 * 2.0 ** -(FRAC_BITS + 1) * 255
    exact = exact64.numpy()
    off = np.abs(exact - np.floor(exact) - 0.5)[d64 != 0]
    assert np.all(off <= bound), f"a code moved {off.max():.3f} LSB from a rounding boundary (bound {bound:.3f})"


def test_unsupported_modes_are_located_errors():
    for up, msg in [(nn.Upsample(scale_factor=2, mode="bicubic"), "mode='bicubic'"),
                    (FnUp(scale_factor=2, mode="bilinear", antialias=True), "antialias")]:
        model = UpNet(up)
        qdsl.apply(model, "specs/int8-default.qspec")
        qdsl.calibrate(model, [torch.randn(2, 3, 6, 6)])
        qdsl.freeze(model)
        with pytest.raises(ExportError, match=rf"cannot export 'up'.*{msg}"):
            qdsl.export(model, torch.randn(1, 3, 6, 6))


def test_frac_bits_keep_an_int8_sum_in_int32():
    # the validator's bound: 255 · 2^(2F) < 2^31
    assert 255 * (1 << 2 * FRAC_BITS) < 2 ** 31 and not 255 * (1 << 2 * (FRAC_BITS + 1)) < 2 ** 31
    assert math.isclose(2.0 ** -(FRAC_BITS + 1) * 255, 0.0623, rel_tol=1e-2)


@pytest.mark.parametrize("up", [nn.Upsample(scale_factor=2), nn.Upsample(size=(9, 13), mode="bilinear"),
                                nn.UpsamplingBilinear2d(scale_factor=2)], ids=["nearest", "bilinear", "bilinear-ac"])
def test_onnx_form_runs_in_onnxruntime_and_agrees(up):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from qdsl.export.onnx import export_onnx

    torch.manual_seed(0)
    model = UpNet(up).eval()
    qdsl.apply(model, "specs/int8-default.qspec")
    qdsl.calibrate(model, [torch.randn(4, 3, 6, 5) for _ in range(3)])
    qdsl.freeze(model)
    proto = export_onnx(model, torch.randn(2, 3, 6, 5))
    assert "Gather" in {n.op_type for n in proto.graph.node}
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    x = torch.randn(8, 3, 6, 5)
    y = ort.InferenceSession(proto.SerializeToString(), opts).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        fq = model(x).numpy()
    assert np.abs(y - fq).max() <= 0.01 * np.abs(fq).max()


class TinyUNet(nn.Module):
    """Encoder conv -> max-pool -> conv -> upsample -> torch.cat with the skip -> conv."""

    def __init__(self, up):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.down = nn.MaxPool2d(2)
        self.mid = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.up = up
        self.dec = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1), nn.ReLU(inplace=True))
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        skip = self.enc(x)
        y = self.up(self.mid(self.down(skip)))
        return self.head(self.dec(torch.cat([y, skip], dim=1)))


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_unet_with_upsample_and_skip_concat(mode):
    up = nn.Upsample(scale_factor=2, mode=mode, align_corners=False if mode == "bilinear" else None)
    graph, diff = flow(TinyUNet(up), "int8-default", (2, 3, 8, 8), "head")
    assert {OpType.RESIZE, OpType.CONCAT, OpType.MAXPOOL2D} <= set(op_types(graph))
    assert_close(diff)


def test_lint_reads_the_upsample_as_the_profile_op_upsample():
    from qdsl.lint import lint
    from qdsl.parse import parse_file

    model = TinyUNet(nn.Upsample(scale_factor=2))
    diags = lint(parse_file("specs/int8-default.qspec"), "tflite-int8", model)
    # the profile lists no 'upsample': lint says so (and knows the construct: no unknown-op finding)
    assert "op 'upsample' is not supported by tflite-int8" in [d.message for d in diags]

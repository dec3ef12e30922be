"""One-pass native fake quantization (qdsl.quantizers.native_fq, issue 23 eval before freeze):
the C++ kernels against the torch passes they replace (``proxy._affine_passes``), bit for
bit, on both kernel paths; the bundled specs' evaluation forward with and without them; the
path taken only where it applies."""

import copy
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import qdsl
from qdsl.quantizers import TensorQuantizer, native_fq as NFQ
from qdsl.quantizers import functional as F
from qdsl.quantizers.eval_fast import affine_passes as _affine_passes
from qdsl.resolve.plan import QuantizerRecipe
from qdsl.spec.model import Granularity, GranularityKind, Kind, ObserverSpec, Role

pytestmark = pytest.mark.skipif(not NFQ.available(), reason="native library without the fake-quant kernels")

SPECS = Path(__file__).resolve().parents[2] / "specs"
PATHS = [0, 2]  # the best path here (AVX2 on x86), the portable C++
SPECIAL = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38,
           0.5, -0.5, 1.5, -2.5]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


@st.composite
def grids(draw):
    """``(qmin, qmax)`` of an int grid: bits 2-16, signed/unsigned, narrow or not, and a zero point in it."""
    bits = draw(st.integers(2, 16))
    signed, narrow = draw(st.booleans()), draw(st.booleans())
    qmin, qmax = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    if narrow:
        qmin += 1
    zp = draw(st.integers(qmin, qmax)) if draw(st.booleans()) else (0 if signed else qmin)
    return qmin - zp, qmax - zp


scales = st.floats(1e-30, 1e30).map(_f32)


@st.composite
def values(draw, n, s):
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(n, generator=g) * draw(st.sampled_from([1e-3, 1.0, 100.0, 1e5])) * s * 50
    if draw(st.booleans()):  # exact ties of the grid: (k + 1/2)·s
        x = (torch.round(x / s) + 0.5) * s
    for i in draw(st.lists(st.integers(0, n - 1), max_size=6)):
        x[i] = draw(st.sampled_from(SPECIAL))
    return x


@settings(max_examples=400, deadline=None)
@given(st.data(), st.integers(1, 70), scales, grids(), st.sampled_from(PATHS))
def test_per_tensor_kernel_equals_the_torch_passes_bit_for_bit(data, n, s, grid, path):
    x = data.draw(values(n, s))
    s = _f32(s)
    inv = float(F.reciprocal(torch.tensor(s)))
    lo, hi = grid
    want = _affine_passes(x, s, inv, lo, hi, False)
    got = NFQ.fake_quant(x, (s, inv, lo, hi, None), path)
    assert got is not None
    assert torch.equal(_bits(got), _bits(want)), (x, s, lo, hi)


@st.composite
def layouts(draw):
    """A tensor shape, a channel axis, and how it is stored (contiguous, channels_last, permuted)."""
    dims = draw(st.integers(2, 4))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=dims, max_size=dims)))
    axis = draw(st.integers(0, dims - 1))
    order = draw(st.permutations(range(dims)))
    return shape, axis, order


@settings(max_examples=250, deadline=None)
@given(st.data(), layouts(), grids(), st.booleans(), st.sampled_from(PATHS))
def test_per_channel_kernel_equals_the_torch_passes(data, layout, grid, channel_zp, path):
    shape, axis, order = layout
    c = shape[axis]
    s = torch.tensor([data.draw(st.floats(1e-6, 1e3)) for _ in range(c)], dtype=torch.float32)
    stored = [shape[d] for d in order]
    x = data.draw(values(int(torch.Size(shape).numel()), 0.1)).reshape(stored)
    x = x.permute([order.index(d) for d in range(len(shape))])  # logical `shape`, memory in `order`
    assert x.shape == shape
    sv, iv = F.param_view(s, x, axis), F.param_view(F.reciprocal(s), x, axis)
    lo, hi = grid
    if channel_zp:  # per-channel zero points: tensor bounds
        z = torch.tensor([data.draw(st.integers(-3, 3)) for _ in range(c)], dtype=torch.float32)
        lo, hi = lo - F.param_view(z, x, axis), hi - F.param_view(z, x, axis)
    want = _affine_passes(x, sv, iv, lo, hi, False)
    got = NFQ.fake_quant(x, (sv, iv, lo, hi, None), path)
    if c == 1:  # one value per "channel": per-tensor parameters held in tensors
        got = NFQ.fake_quant(x, (sv, iv, lo, hi, ("affine", float(s), float(iv), lo, hi)), path) \
            if isinstance(lo, int) else got
        if got is None:
            return
    assert got is not None
    assert got.stride() == x.stride()
    if channel_zp:
        # torch's clamp with tensor bounds turns a rounded -0.0 into +0.0 or not depending on its
        # vector loop: equal as numbers, and bit for bit once zeros are made +0.0
        assert torch.equal(_bits(got + 0.0), _bits(want + 0.0))
    else:
        assert torch.equal(_bits(got), _bits(want))


@settings(max_examples=200, deadline=None)
@given(st.data(), st.integers(1, 70), st.sampled_from(PATHS))
def test_aminmax_equals_torch(data, n, path):
    x = data.draw(values(n, 1.0))
    lo, hi = NFQ.aminmax(x, path)
    tlo, thi = torch.aminmax(x)
    if torch.isnan(x).any():
        assert lo != lo and hi != hi
    else:
        assert (lo, hi) == (tlo.item(), thi.item())


# ---------------------------------------------------------------- where it applies
def _static(bits=8, signed=False, symmetric=False, gran=Granularity(), dynamic=False):
    r = QuantizerRecipe(Kind.INT, bits, signed, False, symmetric, "float", gran, ObserverSpec("minmax", ()),
                        "half_even", dynamic)
    return TensorQuantizer(r, Role.OUTPUT)


def _calibrated(q, x):
    q.observing = True
    q(x)
    q.observing = False
    return q


@pytest.mark.parametrize("gran", [Granularity(), Granularity(GranularityKind.CHANNEL, 1)])
@pytest.mark.parametrize("dynamic", [False, True])
def test_eval_takes_the_native_path_and_training_does_not(monkeypatch, gran, dynamic):
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5, 5)
    q = _calibrated(_static(gran=gran, dynamic=dynamic), x)
    q.eval()
    NFQ.STATS.reset()
    with torch.no_grad():
        fast = q(x)
    assert NFQ.STATS.fake_quant == 1
    assert NFQ.STATS.aminmax == (1 if dynamic and gran.kind is not GranularityKind.CHANNEL else 0)
    monkeypatch.setattr(NFQ, "_switch", False)  # (QDSL_NATIVE_FQ=0 is read at import)
    with torch.no_grad():
        slow = q(x)
    assert torch.equal(_bits(fast), _bits(slow))
    monkeypatch.setattr(NFQ, "_switch", True)
    NFQ.STATS.reset()
    xg = x.clone().requires_grad_()
    q.train()
    y = q(xg)  # the autograd path: straight-through, untouched
    y.sum().backward()
    assert NFQ.STATS.fake_quant == 0 and NFQ.STATS.aminmax == 0
    assert torch.equal(xg.grad, torch.ones_like(x) * (xg.grad != 0))
    assert torch.equal(y.detach(), slow)


def test_not_taken_for_other_dtypes_devices_layouts_or_when_tracing(monkeypatch):
    v = (0.5, 2.0, -128, 127, ("affine", 0.5, 2.0, -128, 127))
    x = torch.randn(6, 8)
    assert NFQ.fake_quant(x, v) is not None
    assert NFQ.fake_quant(x.double(), v) is None
    assert NFQ.fake_quant(x.bfloat16(), v) is None
    assert NFQ.fake_quant(x[:, ::2], v) is None  # not dense
    assert NFQ.fake_quant(x.t(), v) is not None  # dense, transposed
    with torch.enable_grad():
        assert NFQ.fake_quant(x.clone().requires_grad_(), v) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert NFQ.fake_quant(x, v) is None


def test_without_the_library_the_torch_passes_run(monkeypatch):
    monkeypatch.setattr(NFQ, "_fns", None)
    monkeypatch.setattr(NFQ, "_loaded", True)
    assert not NFQ.available()
    x = torch.randn(3, 4, 5)
    q = _calibrated(_static(), x).eval()
    NFQ.STATS.reset()
    with torch.no_grad():
        y = q(x)
    assert NFQ.STATS.fake_quant == 0
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(_bits(q(x)), _bits(y))
    assert NFQ.STATS.fake_quant == 1


def test_library_without_the_kernels_is_not_used(monkeypatch, tmp_path):
    monkeypatch.setenv("QDSL_RUNTIME_LIB", str(tmp_path / "missing.so"))
    monkeypatch.setattr(NFQ, "_fns", None)
    monkeypatch.setattr(NFQ, "_loaded", False)
    assert not NFQ.available()
    assert NFQ.fake_quant(torch.randn(4), (1.0, 1.0, 0, 255, None)) is None


# ---------------------------------------------------------------- bundled specs
class _Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(24, 24)
        self.layer = torch.nn.TransformerEncoderLayer(24, 4, 48, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.layer(self.inp(x))


class _Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.Hardtanh())
        self.head = torch.nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


def _bundled(model: str):
    names = sorted(p.name for p in SPECS.glob("*.qspec"))
    if model == "transformer":
        return [n for n in names if n.startswith("transformer") or n == "int8-dynamic.qspec"]
    return [n for n in names if not n.startswith("transformer")]


@pytest.mark.parametrize("model,spec", [(m, s) for m in ("cnn", "transformer") for s in _bundled(m)])
def test_bundled_spec_eval_equals_with_and_without_the_native_path(monkeypatch, model, spec):
    torch.manual_seed(0)
    if model == "cnn":
        net, x = _Cnn(), torch.randn(4, 3, 6, 6)
    else:
        net, x = _Encoder(), torch.randn(3, 7, 24)
    qdsl.apply(net, str(SPECS / spec))
    qdsl.calibrate(net, [x], progress=False)
    net.train()
    # a training step with and without the native kernels: the same loss and gradients (only a
    # quantizer whose input needs no gradient, the network input's, can take them in training)
    twin = copy.deepcopy(net)
    monkeypatch.setattr(NFQ, "_switch", False)  # (QDSL_NATIVE_FQ=0 is read at import)
    twin(x).square().mean().backward()
    monkeypatch.setattr(NFQ, "_switch", True)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    opt.zero_grad()
    net(x).square().mean().backward()
    for (name, p), q in zip(net.named_parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    opt.step()
    net.eval()
    NFQ.STATS.reset()
    for channels_last in ([False, True] if model == "cnn" else [False]):
        xin = x.contiguous(memory_format=torch.channels_last) if channels_last else x
        with torch.no_grad():
            fast = net(xin)
        taken = NFQ.STATS.fake_quant
        monkeypatch.setattr(NFQ, "_switch", False)  # (QDSL_NATIVE_FQ=0 is read at import)
        with torch.no_grad():
            slow = net(xin)
        monkeypatch.setattr(NFQ, "_switch", True)
        assert torch.equal(fast, slow)
        NFQ.STATS.reset()
        if spec in ("int8-dynamic.qspec", "transformer-int8.qspec", "int8-default.qspec"):
            assert taken > 0  # the specs the issue measures take it


# ---------------------------------------------------------------- fp8 activations (mxfp4 spec)
@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(1, 70), st.floats(1e-20, 1e20).map(_f32), st.sampled_from(["fp8_e4m3", "fp8_e5m2"]),
       st.sampled_from(PATHS))
def test_minifloat_kernel_equals_the_float8_cast_path_bit_for_bit(data, n, s, name, path):
    from qdsl.quantizers.formats import minifloat as MF

    fmt = MF.MINIFLOAT_PRESETS[name]
    dtype = MF._TORCH_FP8[name]
    x = data.draw(values(n, s))
    if data.draw(st.booleans()):  # ties of the float8 grid itself, in the subnormals and the normals
        x = (torch.randint(-64, 64, (n,), generator=torch.Generator().manual_seed(n)) + 0.5) * 2.0 ** -9 * s
    st_ = torch.tensor(s, dtype=torch.float32)
    want = MF._cast_round(x / st_, fmt, dtype, scale=st_, inplace=True)
    MF._native_round(x, st_, fmt, dtype)  # fills the NaN cache
    got = NFQ.fake_quant_minifloat(x, float(st_), fmt.max_normal, fmt.emin, fmt.mantissa, MF._NAN_BITS[dtype], path)
    assert got is not None
    assert torch.equal(_bits(got), _bits(want)), (x, s)


def test_mxfp4_activation_takes_the_native_path(monkeypatch):
    torch.manual_seed(0)
    net, x = _Cnn(), torch.randn(4, 3, 6, 6)
    qdsl.apply(net, str(SPECS / "mxfp4.qspec"))
    qdsl.calibrate(net, [x], progress=False)
    net.eval()
    NFQ.STATS.reset()
    with torch.no_grad():
        fast = net(x)
    assert NFQ.STATS.minifloat >= 2  # both convs' and the head's fp8 inputs
    monkeypatch.setattr(NFQ, "_switch", False)  # (QDSL_NATIVE_FQ=0 is read at import)
    with torch.no_grad():
        slow = net(x)
    assert torch.equal(_bits(fast), _bits(slow))


# ------------------------------------------------------------------- the switch
def test_switch_is_read_once_and_set_at_run_time():
    import subprocess
    import sys

    code = ("import os; from qdsl.quantizers import native_fq as N; a = N.enabled(); "
            "os.environ['QDSL_NATIVE_FQ'] = '1'; b = N.enabled(); N.set_enabled(None); c = N.enabled(); "
            "print(a, b, c == N.available())")
    env = dict(__import__("os").environ, QDSL_NATIVE_FQ="0")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True"]  # read at import; set_enabled(None) reads again


def test_disabled_block_takes_the_torch_passes_and_restores():
    if not NFQ.available():
        pytest.skip("no native library")
    x = torch.randn(64)
    v = (0.05, 20.0, -128, 127, ("affine", 0.05, 20.0, -128, 127))
    assert NFQ.fake_quant(x, v) is not None
    with NFQ.disabled():
        assert not NFQ.enabled() and NFQ.fake_quant(x, v) is None
    assert NFQ.enabled()
    prev = NFQ.set_enabled(False)
    assert prev is True and NFQ.fake_quant(x, v) is None
    NFQ.set_enabled(prev)
    assert NFQ.enabled()

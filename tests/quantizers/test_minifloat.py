"""Minifloat quantizers (qdsl.quantizers.formats.minifloat) against independent oracles.

* fp8_e4m3 / fp8_e5m2 equal torch's ``float8_e4m3fn`` / ``float8_e5m2`` casts,
  ``(x / s).to(float8) · s``, values and bit patterns, on hypothesis-generated tensors
  that include exact ties, subnormals and values past the largest finite one (torch's
  e5m2 cast overflows to inf there, so saturation is checked on its own);
* fp6 / fp4 round to the nearest entry of the enumerated value table (ties to the even
  code), written here by brute force over the table;
* MX (``group(32), scale=pot``) and NVFP4 (``group(16), scale=fp8_e4m3``) equal a
  written-out OCP computation in plain Python over each block;
* stochastic rounding, the QAT gradient, ``int_repr`` codes and ragged last blocks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qdsl.quantizers.formats.minifloat import decode, e8m0_codes, minifloat_round, split_scale
from qdsl.quantizers.proxy import TensorQuantizer
from qdsl.resolve.plan import QuantizerRecipe
from qdsl.spec.formats import MINIFLOAT_PRESETS, minifloat_format
from qdsl.spec.model import Granularity, GranularityKind, ObserverSpec, Role

TORCH_F8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_CACHE: dict = {}


def quantizer(kind, *, scale="float", gran=None, rounding="half_even", observer="minmax", role=Role.WEIGHT):
    fmt = MINIFLOAT_PRESETS.get(kind) or minifloat_format(kind)
    recipe = QuantizerRecipe(kind, fmt.bits, True, False, True, scale, gran or Granularity(), ObserverSpec(observer),
                             rounding, False, format=fmt)
    return TensorQuantizer(recipe, role)


def group(n):
    return Granularity(GranularityKind.GROUP, group_size=n)


def _special_values(fmt):
    """Every representable value, the midpoints between neighbours (ties), a little on
    either side of each midpoint, subnormals, and values past max_normal."""
    v = np.array(fmt.values(), dtype=np.float64)
    mids = (v[1:] + v[:-1]) / 2
    out = np.concatenate([v, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf),
                          [fmt.max_normal * 1.01, fmt.max_normal * 3, fmt.min_subnormal / 3]])
    out = out[np.abs(out) < 3e38].astype(np.float32)
    return np.concatenate([out, -out])


@st.composite
def tensors(draw, fmt):
    special = _special_values(fmt)
    n = draw(st.integers(1, 64))
    idx = draw(st.lists(st.integers(0, len(special) - 1), min_size=n, max_size=n))
    noise = draw(st.lists(st.floats(-2 * fmt.max_normal, 2 * fmt.max_normal, width=32), min_size=n, max_size=n))
    pick = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    y = np.where(pick, special[idx], np.array(noise, dtype=np.float32)).astype(np.float32)
    # a scale that is a power of two keeps the ties exact after y·s / s
    e = draw(st.integers(-8, 8))
    return torch.from_numpy(y), torch.tensor(2.0 ** e)


@pytest.mark.parametrize("kind", list(TORCH_F8))
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_fp8_equals_torch_cast(kind, data):
    fmt = MINIFLOAT_PRESETS[kind]
    y, s = data.draw(tensors(fmt))
    x = y * s
    q = _CACHE.setdefault(kind, quantizer(kind))
    zp = torch.zeros((), dtype=torch.int32)
    got = q._fake(x, s, zp, None)
    ref8 = (x / s).to(TORCH_F8[kind])
    inside = (x / s).abs() <= fmt.max_normal
    assert torch.equal(got[inside], ref8.float()[inside] * s)
    assert torch.equal(q._ops.codes(q, x, s, zp, None)[inside], ref8.view(torch.uint8)[inside])
    # past the largest finite value: saturation to ±max_normal (torch's e5m2 cast gives inf)
    outside = ~inside
    assert torch.equal(got[outside], torch.sign(x[outside]) * fmt.max_normal * s)


@pytest.mark.parametrize("kind", list(TORCH_F8))
@settings(max_examples=60, deadline=None)
@given(x=st.lists(st.floats(-1e5, 1e5, width=32), min_size=1, max_size=40),
       s=st.floats(2.0 ** -10, 2.0 ** 10, width=32))
def test_fp8_equals_torch_cast_at_any_float_scale(kind, x, s):
    x, s = torch.tensor(x), torch.tensor(s)
    q = _CACHE.setdefault(kind, quantizer(kind))
    got = q._fake(x, s, torch.zeros((), dtype=torch.int32), None)
    y = x / s
    inside = y.abs() <= MINIFLOAT_PRESETS[kind].max_normal
    assert torch.equal(got[inside], (y.to(TORCH_F8[kind]).float() * s)[inside])


def test_saturation_and_non_finite():
    for kind, fmt in MINIFLOAT_PRESETS.items():
        y = torch.tensor([fmt.max_normal * 1.06, -1e30, float("inf"), -float("inf"), float("nan")])
        got = minifloat_round(y, fmt)
        assert got[:4].tolist() == [fmt.max_normal, -fmt.max_normal, fmt.max_normal, -fmt.max_normal]
        assert math.isnan(got[4])


def _table_round(v: float, fmt) -> float:
    """Nearest entry of the enumerated value table; a tie goes to the even code (the even
    mantissa field: the table index is the code of a non-negative value)."""
    table = fmt.values()
    a = min(abs(v), fmt.max_normal)
    best = min(range(len(table)), key=lambda i: (abs(table[i] - a), i % 2))
    return math.copysign(table[best], v)


@pytest.mark.parametrize("kind", list(MINIFLOAT_PRESETS))
def test_grid_equals_the_enumerated_table(kind):
    fmt = MINIFLOAT_PRESETS[kind]
    ys = _special_values(fmt)
    if len(ys) > 2000:
        ys = ys[np.random.default_rng(0).choice(len(ys), 2000, replace=False)]
    got = minifloat_round(torch.from_numpy(ys), fmt).tolist()
    assert got == [_table_round(float(v), fmt) for v in ys]


def test_fp4_and_fp6_codes_are_sign_exponent_mantissa():
    fp4 = MINIFLOAT_PRESETS["fp4_e2m1"]
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    q = quantizer("fp4_e2m1")
    zp = torch.zeros((), dtype=torch.int32)
    codes = q._ops.codes(q, torch.cat([vals, -vals]), torch.tensor(1.0), zp, None)
    assert codes.dtype == torch.uint8
    assert codes.tolist() == list(range(8)) + list(range(8, 16))
    e3m2 = MINIFLOAT_PRESETS["fp6_e3m2"]
    assert decode(torch.arange(64, dtype=torch.uint8), e3m2)[:32].tolist() == e3m2.values()
    assert decode(torch.arange(16, dtype=torch.uint8), fp4)[8:].tolist() == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


# -- MX and NVFP4 against a written-out OCP computation --------------------------------------------------


def _ocp_mx_block(block: list[float], fmt) -> tuple[float, list[float]]:
    """OCP MX v1.0 (section 6.3): X = 2^(floor(log2(max|v|)) - emax_elem), clamped to E8M0;
    P_i = the element format's rounding of v_i / X, saturating."""
    amax = max(abs(v) for v in block)
    e = math.floor(math.log2(amax)) - fmt.emax if amax > 0 else -127
    e = max(-127, min(127, e))
    scale = 2.0 ** e
    return scale, [_table_round(v / scale, fmt) * scale for v in block]


@pytest.mark.parametrize("kind", list(MINIFLOAT_PRESETS))
@pytest.mark.parametrize("cols", [64, 40])  # 40: a ragged last block of 8
def test_mx_equals_ocp_reference(kind, cols):
    fmt = MINIFLOAT_PRESETS[kind]
    g = torch.Generator().manual_seed(cols)
    w = torch.randn(6, cols, generator=g) * torch.exp(torch.randn(6, 1, generator=g) * 3)
    w[0, :32] = 0.0  # an all-zero block
    w[1, 5] = 2.0 ** 3  # a block max exactly a power of two
    q = quantizer(kind, scale="pot", gran=group(32))
    got = q(w)
    want, scales = [], []
    for row in w.tolist():
        out = []
        for j in range(0, cols, 32):
            s, vals = _ocp_mx_block(row[j:j + 32], fmt)
            out += vals
            scales.append(s)
        want.append(out)
    assert got.tolist() == want
    assert q.qparams(w)[0].flatten().tolist() == scales
    assert torch.equal(torch.exp2(e8m0_codes(q.qparams(w)[0]).float() - 127), q.qparams(w)[0])


def _nvfp4_reference(w: torch.Tensor, block: int = 16):
    """NVFP4 as written out: per-tensor power-of-two s_t above max(amax/6)/448, block scale
    e4m3(amax/6/s_t)·s_t (nearest, ties to even, at least the smallest subnormal), elements
    fp4_e2m1 of v/scale."""
    fp4, e4m3 = MINIFLOAT_PRESETS["fp4_e2m1"], MINIFLOAT_PRESETS["fp8_e4m3"]
    rows = w.tolist()
    raws = [[max(abs(v) for v in r[j:j + block]) / 6 for j in range(0, len(r), block)] for r in rows]
    top = max(max(r) for r in raws)
    s_t = 2.0 ** math.ceil(math.log2(top / 448))
    out = []
    for r, raw in zip(rows, raws):
        o = []
        for j, a in enumerate(raw):
            s = max(_table_round(a / s_t, e4m3), e4m3.min_subnormal) * s_t
            s = float(np.float32(s))
            o += [_table_round(float(np.float32(v) / np.float32(s)), fp4) * s for v in r[j * block:(j + 1) * block]]
        out.append(o)
    return out


def test_nvfp4_equals_reference():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 48, generator=g) * torch.exp(torch.randn(8, 1, generator=g) * 2)
    q = quantizer("fp4_e2m1", scale="fp8_e4m3", gran=group(16))
    assert q(w).tolist() == _nvfp4_reference(w)
    scale = q.qparams(w)[0]
    s_t, codes = split_scale(scale)
    assert torch.equal(decode(codes, MINIFLOAT_PRESETS["fp8_e4m3"]) * s_t, scale)
    assert float(torch.log2(s_t)).is_integer()


# -- rounding, gradients, codes ------------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased_and_stays_on_neighbours():
    fmt = MINIFLOAT_PRESETS["fp4_e2m1"]
    gen = torch.Generator().manual_seed(0)
    y = torch.full((40000,), 2.4)  # between 2 and 3
    r = minifloat_round(y, fmt, "stochastic", gen)
    assert set(r.unique().tolist()) == {2.0, 3.0}
    assert abs(r.mean().item() - 2.4) < 0.01
    q = quantizer("fp4_e2m1", rounding="stochastic")
    q.generator = torch.Generator().manual_seed(1)
    out = q._fake(torch.full((1000,), 0.7), torch.tensor(1.0), torch.zeros((), dtype=torch.int32), None)
    assert set(out.unique().tolist()) == {0.5, 1.0}


def test_qat_gradient_is_the_clipping_mask():
    from qdsl.quantizers.proxy_grad import qat_grad_path

    q = quantizer("fp4_e2m1")
    q.grad_path = qat_grad_path
    w = torch.tensor([[0.3, -1.0, 2.0, 6.0]], requires_grad=True)
    s = torch.tensor(0.25)  # saturates above 6 · 0.25 = 1.5
    out = q._with_grad(w, s, torch.zeros((), dtype=torch.int32), None)
    assert out.tolist() == [[0.25, -1.0, 1.5, 1.5]]
    out.sum().backward()
    assert w.grad.tolist() == [[1.0, 1.0, 0.0, 0.0]]


def test_int_repr_codes_decode_to_the_fake_values():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(4, 40, generator=g)
    for kind in MINIFLOAT_PRESETS:
        q = quantizer(kind, scale="pot", gran=group(32))
        q.freeze(w)
        codes = q.int_repr(w)
        assert codes.dtype == torch.uint8 and int(codes.max()) < (1 << q.format.bits)
        sv = torch.repeat_interleave(q.scale, 32, dim=1)[:, :40]
        assert torch.equal(decode(codes, q.format) * sv, q(w))
        grid = q.format.operand_codes(codes.numpy())
        assert np.array_equal(grid * q.format.grid_step(q.format.bits) * sv.numpy(), q(w).numpy())


def test_per_channel_scale_is_amax_over_max_normal():
    w = torch.tensor([[1.0, -448.0 * 3], [0.5, 0.25]])
    q = quantizer("fp8_e4m3", gran=Granularity(GranularityKind.CHANNEL, axis=0))
    s = q.qparams(w)[0]
    assert s.tolist() == [3.0, float(torch.tensor(0.5) / 448)]
    assert q(w)[0, 1].item() == -448.0 * 3


def test_mse_search_never_worse_than_max_abs():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(8, 64, generator=g)
    w[:, 0] = 12.0  # an outlier per row: clipping it pays off on a 4-bit grid
    err = {}
    for obs in ("minmax", "mse"):
        q = quantizer("fp4_e2m1", scale="float", gran=Granularity(GranularityKind.CHANNEL, axis=0), observer=obs)
        err[obs] = ((q(w) - w) ** 2).sum().item()
    assert err["mse"] < err["minmax"]


def test_generic_minifloat_uses_the_family_ops():
    q = quantizer("fp6_e3m2_b2")
    y = torch.tensor([1.0, 56.0, 100.0, 2.0 ** -3, 2.0 ** -5])
    got = q._fake(y, torch.tensor(1.0), torch.zeros((), dtype=torch.int32), None)
    assert got.tolist() == [1.0, 56.0, 56.0, 2.0 ** -3, 0.0]  # bias 2: max 56, smallest subnormal 2^(-1-2)


@pytest.mark.parametrize("kind", ["fp4_e2m1", "fp8_e4m3"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_mx_equals_ocp_reference_on_generated_blocks(kind, data):
    fmt = MINIFLOAT_PRESETS[kind]
    cols = data.draw(st.integers(1, 80))
    vals = data.draw(st.lists(st.floats(-1e4, 1e4, width=32), min_size=2 * cols, max_size=2 * cols))
    w = torch.tensor(vals).reshape(2, cols)
    q = _CACHE.setdefault(("mx", kind), quantizer(kind, scale="pot", gran=group(32)))
    want = [sum((_ocp_mx_block(row[j:j + 32], fmt)[1] for j in range(0, cols, 32)), []) for row in w.tolist()]
    assert q(w).tolist() == want

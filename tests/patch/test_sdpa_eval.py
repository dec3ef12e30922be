"""The decomposed ``F.scaled_dot_product_attention`` of the ``scores``/``probs`` roles without
autograd (qdsl/patch/softmax_roles.py ``_sdpa_eval``): the reference decomposition's result
bit for bit (shapes, layouts, masks incl. fully masked rows, scores at ``finfo.min``, NaN,
quantizers static / frozen / off / absent), without copying q, k, v and without a ``where``
over the scores; training keeps the reference (outputs and gradients)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import qdsl
from qdsl.parse import parse_text
from qdsl.patch import softmax_roles as R


def _static_a8(x: torch.Tensor, signed: bool = False):
    from qdsl.quantizers import TensorQuantizer
    from qdsl.resolve.plan import QuantizerRecipe
    from qdsl.spec.model import Granularity, Kind, ObserverSpec, Role

    r = QuantizerRecipe(Kind.INT, 8, signed, False, False, "float", Granularity(), ObserverSpec("minmax", ()),
                        "half_even", False)
    q = TensorQuantizer(r, Role.SCORES)
    q.observing = True
    q(x)
    q.observing = False
    return q


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _operands(data, b, h, length, s_len, d, d_v, layout, three_d):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    mag = data.draw(st.sampled_from([1.0, 3.0, 1e19]), label="magnitude")

    def make(n, width):
        if layout == "hf":  # Hugging Face: views of (B, L, H, D)
            return torch.randn(b, n, h * width, generator=g).view(b, n, h, width).transpose(1, 2)
        if layout == "t":  # rows and columns swapped in memory
            return torch.randn(b, h, width, n, generator=g).transpose(-2, -1)
        return torch.randn(b, h, n, width, generator=g)

    q, k, v = make(length, d), make(s_len, d), make(s_len, d_v)
    q.mul_(mag)  # 1e19: scores at or beyond finfo.min / 2, some infinite
    k.mul_(mag)
    if data.draw(st.booleans(), label="nan"):
        q[(0,) * q.dim()] = float("nan")
    if three_d:
        q, k, v = q[0], k[0], v[0]
    return q, k, v


def _mask(data, b, h, length, s_len, three_d):
    kind = data.draw(st.sampled_from(["none", "bool", "bool", "float", "causal"]), label="mask")
    if kind in ("none", "causal"):
        return None, kind == "causal"
    shape = data.draw(st.sampled_from([(b, 1, length, s_len), (b, 1, 1, s_len), (length, s_len), (b, h, length, s_len)]),
                      label="mask shape")
    if three_d:
        shape = shape[-2:] if len(shape) == 4 and shape[1] == 1 else (h, length, s_len)[-len(shape[-3:]):]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="mask seed"))
    keep = torch.rand(shape, generator=g) > data.draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]), label="p masked")
    if data.draw(st.booleans(), label="full row") and keep.numel():
        keep[(0,) * (keep.dim() - 1)] = False  # a fully masked row
    if kind == "bool":
        return keep, False
    m = torch.zeros(shape).masked_fill_(~keep, torch.finfo(torch.float32).min)  # Hugging Face's additive form
    return m, False


def _quantizers(data):
    mode = data.draw(st.sampled_from(["none", "static", "static", "frozen", "off", "scores", "probs", "signed"]),
                     label="quantizers")
    if mode == "none":
        return None, None
    sq = _static_a8(torch.randn(64) * 3, signed=mode == "signed")
    pq = _static_a8(torch.rand(64))
    if mode == "frozen":
        sq.freeze()
        pq.freeze()
    if mode == "off":
        sq.enabled = pq.enabled = False
    return (sq, None) if mode == "scores" else (None, pq) if mode == "probs" else (sq, pq)


@given(st.data())
def test_eval_sdpa_equals_the_reference_bit_for_bit(data):
    b, h = data.draw(st.integers(1, 4), label="batch"), data.draw(st.integers(1, 5), label="heads")
    length, s_len = data.draw(st.integers(1, 13), label="L"), data.draw(st.integers(1, 13), label="S")
    d, d_v = data.draw(st.integers(1, 40), label="D"), data.draw(st.integers(1, 17), label="Dv")
    layout = data.draw(st.sampled_from(["hf", "contiguous", "t"]), label="layout")
    three_d = data.draw(st.booleans(), label="3-d")
    q, k, v = _operands(data, b, h, length, s_len, d, d_v, layout, three_d)
    mask, causal = _mask(data, b, h, length, s_len, three_d)
    sq, pq = _quantizers(data)
    scale = data.draw(st.sampled_from([None, 0.3, 1.0]), label="scale")
    factor = 1.0 / math.sqrt(d) if scale is None else scale
    with torch.no_grad():
        want = R._sdpa_reference(q, k, v, mask, 0.0, causal, factor, sq, pq, "m")
        got = R._sdpa(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, sq=sq, pq=pq, who="m")
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(_bits(got), _bits(want))


def _hf_operands(b=3, h=4, length=9, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, length, h * d, generator=g).view(b, length, h, d).transpose(1, 2) for _ in range(3))
    keep = torch.ones(b, 1, length, length, dtype=torch.bool)
    keep[0, ..., 5:] = False
    keep[1, :, 2] = False  # a fully masked row
    return q, k, v, keep


def _quantizers_seen_by(q, k, v, keep):
    with torch.no_grad():
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return _static_a8(scores[keep.expand_as(scores)]), _static_a8(torch.rand(64))


def test_eval_sdpa_quantized_fully_masked_rows_are_zero_and_equal_the_reference():
    q, k, v, keep = _hf_operands()
    sq, pq = _quantizers_seen_by(q, k, v, keep)
    for frozen in (False, True):
        if frozen:
            sq.freeze()
            pq.freeze()
        with torch.no_grad():
            want = R._sdpa_reference(q, k, v, keep, 0.0, False, 1 / math.sqrt(8), sq, pq, "m")
            got = R._sdpa(q, k, v, attn_mask=keep, sq=sq, pq=pq, who="m")
        assert torch.equal(_bits(got), _bits(want))
        assert torch.equal(got[1, :, 2], torch.zeros_like(got[1, :, 2]))


class _Ops(TorchDispatchMode):
    """The aten ops run: name, first argument's shape and data pointer."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        if isinstance(first, torch.Tensor):
            self.ops.append((func.overloadpacket.__name__, tuple(first.shape), first.data_ptr()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("quantized", [False, True])
def test_eval_sdpa_reuses_its_operand_copies_and_takes_no_where_over_the_scores(quantized):
    # the reference clones q, k and v (matmul's reshape of Hugging Face's head views) into
    # fresh tensors and runs two wheres over the scores (the mask; the masked entries back
    # after quantizing); evaluation copies into the same buffers each call, masks in place
    q, k, v, keep = _hf_operands()
    sq, pq = _quantizers_seen_by(q, k, v, keep) if quantized else (None, None)
    runs = []
    for _ in range(2):
        with torch.no_grad(), _Ops() as ops:
            R._sdpa(q, k, v, attn_mask=keep, sq=sq, pq=pq, who="m")
        runs.append(ops.ops)
    for ops in runs:
        assert not [o for o in ops if o[0] == "clone"]
        assert not [o for o in ops if o[0] == "where" and o[1] == (3, 4, 9, 9)]
        assert len([o for o in ops if o[0] == "copy_" and len(o[1]) == 4]) == 3
    assert [o[2] for o in runs[0] if o[0] == "copy_"] == [o[2] for o in runs[1] if o[0] == "copy_"]
    with torch.no_grad(), _Ops() as ref:
        R._sdpa_reference(q, k, v, keep, 0.0, False, 1 / math.sqrt(8), sq, pq, "m")
    assert [o[0] for o in ref.ops].count("clone") == 3  # the test sees the reference's copies
    assert [o[0] for o in ref.ops].count("where") == (2 if quantized else 1)


def test_training_sdpa_is_the_reference_outputs_and_gradients():
    q0, k0, v0, keep = _hf_operands()
    sq, pq = _quantizers_seen_by(q0, k0, v0, keep)
    outs, grads = [], []
    for fn in (lambda q, k, v: R._sdpa(q, k, v, attn_mask=keep, sq=sq, pq=pq, who="m"),
               lambda q, k, v: R._sdpa_reference(q, k, v, keep, 0.0, False, 1 / math.sqrt(8), sq, pq, "m")):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q0, k0, v0))
        out = fn(q, k, v)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad for t in (q, k, v)])
    assert torch.equal(_bits(outs[0]), _bits(outs[1]))
    for a, b in zip(*grads):
        assert torch.equal(_bits(a), _bits(b))


class _Attention(nn.Module):
    def __init__(self, e: int = 16, heads: int = 2):
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(e, 3 * e)

    def forward(self, x, mask=None):
        b, length, e = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_calibration_and_eval_of_a_patched_model_equal_the_reference(monkeypatch):
    # calibration runs without autograd: the observers see what they saw through the reference
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16)
    mask = torch.ones(3, 1, 1, 7, dtype=torch.bool)
    mask[0, ..., 4:] = False
    spec = parse_text("version 1\nquantizer a8 = int(bits=8, unsigned, asymmetric, observer=minmax)\n"
                      "rule type:_Attention { scores = a8  probs = a8 }\n", "t.qspec")
    results = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(R, "_eval_operands", lambda *a: False)
        torch.manual_seed(1)
        model = _Attention().eval()
        handle = qdsl.apply(model, spec)
        qdsl.calibrate(model, [(x, mask)], inputs="all")
        scales = [q.qparams()[0].clone() for q in handle.quantizers().values()]
        with torch.no_grad():
            before = model(x, mask)
        qdsl.freeze(model)
        with torch.no_grad():
            after = model(x, mask)
        results.append((scales, before, after))
    (s0, b0, a0), (s1, b1, a1) = results
    assert all(torch.equal(a, b) for a, b in zip(s0, s1))
    assert torch.equal(_bits(b0), _bits(b1)) and torch.equal(_bits(a0), _bits(a1))


@given(st.data())
def test_training_masked_softmax_takes_the_where_with_the_gathers_values_and_gradients(data):
    # training quantized the kept scores by gathering them (nonzero, index, masked_scatter
    # and their backward); a static integer quantizer's where gives the same value and gradient
    from qdsl.quantizers.proxy_grad import qat_grad_path

    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    shape = (data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 7)),
             data.draw(st.integers(1, 9)))
    x0 = torch.randn(shape, generator=g) * data.draw(st.sampled_from([1.0, 4.0, 40.0]), label="magnitude")
    masked = torch.rand(shape, generator=g) < data.draw(st.sampled_from([0.0, 0.3, 0.8]), label="p masked")
    if data.draw(st.booleans(), label="full row"):
        masked[(0,) * (len(shape) - 1)] = True
    fill = data.draw(st.sampled_from([float("-inf"), torch.finfo(torch.float32).min]), label="fill")
    x0 = x0.masked_fill(masked, fill)
    upstream = torch.randn(shape, generator=g)
    upstream[torch.rand(shape, generator=g) < 0.2] = -0.0  # zero signs must survive as well
    sq = _static_a8(torch.randn(64, generator=g) * 3, signed=data.draw(st.booleans(), label="signed"))
    pq = _static_a8(torch.rand(64, generator=g)) if data.draw(st.booleans(), label="probs") else None
    if data.draw(st.booleans(), label="qat grad path"):
        sq.grad_path = qat_grad_path
        if pq is not None:
            pq.grad_path = qat_grad_path
    assert R._elementwise(sq, x0.clone().requires_grad_())
    results = []
    for where in (True, False):
        x = x0.clone().requires_grad_()
        if where:
            p = R.quantized_softmax(x, -1, sq, pq, "m")
        else:
            keep = R._elementwise
            R._elementwise = lambda q, x: False
            try:
                p = R.quantized_softmax(x, -1, sq, pq, "m")
            finally:
                R._elementwise = keep
        (p * upstream).sum().backward()
        results.append((p.detach(), x.grad))
    (p0, g0), (p1, g1) = results
    assert torch.equal(_bits(p0), _bits(p1)) and torch.equal(_bits(g0), _bits(g1))


def test_training_masked_softmax_gathers_for_a_learned_scale():
    from qdsl.quantizers.proxy import TensorQuantizer

    sq = _static_a8(torch.randn(64) * 3)
    x = torch.randn(2, 5).masked_fill(torch.tensor([[False] * 4 + [True]] * 2), float("-inf")).requires_grad_()
    assert R._elementwise(sq, x)
    learned = type("Learned", (TensorQuantizer,), {"learned": property(lambda self: True)})
    sq.__class__ = learned
    assert not R._elementwise(sq, x) and R._elementwise(sq, x.detach())


def test_eval_sdpa_under_a_float64_default_dtype():
    q, k, v, keep = _hf_operands()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad():
            got = R._sdpa(q, k, v, attn_mask=keep, sq=None, pq=None, who="m")
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        want = R._sdpa_reference(q, k, v, keep, 0.0, False, 1 / math.sqrt(8), None, None, "m")
    assert got.dtype == torch.float32 and torch.equal(_bits(got), _bits(want))

"""Straight-through estimators for quantization-aware training (pure torch).

Forward values come from :mod:`qdsl.quantizers.functional` (the arithmetic PTQ, export
and the reference executor share), so a model in QAT computes exactly what it will
compute once frozen; this module only adds the documented surrogate gradients.  None
of it knows about proxies, specs or plans, so it is tested on bare tensors.  The
gradients in closed form (``g`` is the incoming gradient, ``v = x·(1/s)``,
``q = clamp(round(v) + z, qmin, qmax)``, ``inside = qmin <= round(v) + z <= qmax``):

* :func:`fake_quant` - affine int, ``x̂ = (q - z)·s``::

      dx̂/dx = inside                                        (clipping-mask STE)
      dx̂/ds = round(v) - v   if inside,  q - z otherwise   (LSQ, Esser et al. 2020)
      dx̂/dz = 0              if inside,  -s    otherwise   (LSQ+, Bhalgat et al. 2020)

  The scale and zero-point gradients are multiplied by ``grad_factor`` (LSQ's
  ``1/sqrt(numel·qmax)``, see :func:`lsq_grad_factor`) and summed per scale slot.  The
  mask is taken on the rounded code, as ``torch.fake_quantize_per_tensor_affine``
  does, so both agree on the boundary (and this equals torch's fused LSQ kernel).
* :func:`pot_scale` - ``s = 2^round(t)`` from a learned ``t = log2 s`` (rounded in the
  log domain exactly as ``functional.pot_scale``); straight-through, ``ds/dt = s·ln 2``.
* :func:`sign_ste` / :func:`binary_act` - ``sign(x)`` with ``sign(0) = +1`` (truly
  binary, as XNOR-popcount needs) and BNN's clipped STE ``d/dx = 1{|x| <= clip}``.
* :func:`binary_weight` - XNOR-Net ``α·sign(W)``, ``α = mean|W|`` per output channel;
  α stays differentiable, so the gradient is the exact derivative of the surrogate
  ``α(W)·sign_ste(W)``: ``Σ_j g_j sign(W_j) sign(W_i)/n + α g_i 1{|W_i| <= 1}``.
* :func:`ternary_weight` - TWN: ``Δ = 0.7·mean|W|``, codes ``sign(W)·1{|W| > Δ}``, ``α`` =
  mean |W| over the kept weights, per output channel; codes straight-through, α
  differentiable.
* :func:`pot_weight` - each weight ``±s·2^k`` (``k = 0..-(n-1)``) or 0, linearly nearest;
  identity gradient where ``|w| <= s``, zero where clipped; ``d/ds = value/s``.
* :func:`unsigned_binary` - {0, s} with the threshold at s/2; ``d/dx = 1{0 <= x <= s}``,
  ``d/ds = code``.

Scales and zero points use ``functional``'s convention: shape ``[]`` (per tensor),
``[C]`` with ``axis``, or ``[C, G]`` with ``group_size``.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch import Tensor

from qdsl.quantizers import fq_op
from qdsl.quantizers import functional as F

__all__ = [
    "round_ste",
    "scale_grad",
    "lsq_grad_factor",
    "fake_quant",
    "pot_scale",
    "sign_ste",
    "binary_act",
    "binary_weight",
    "unsigned_binary",
    "ternary_weight",
    "pot_weight",
]


class _RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, rounding: str) -> Tensor:
        return F.round_(x, rounding)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None


def round_ste(x: Tensor, rounding: str = "half_even") -> Tensor:
    """``round(x)`` forward (any ``functional.ROUNDINGS`` mode), identity backward.

    >>> t = torch.tensor([0.4, 1.6], requires_grad=True)
    >>> y = round_ste(t); y.sum().backward(); y.tolist(), t.grad.tolist()
    ([0.0, 2.0], [1.0, 1.0])
    """
    return _RoundSTE.apply(x, rounding)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g * ctx.factor, None


def scale_grad(x: Tensor, factor: float) -> Tensor:
    """Identity forward; multiplies the gradient by ``factor`` (LSQ's gradient scaling).

    >>> t = torch.tensor(2.0, requires_grad=True)
    >>> (3 * scale_grad(t, 0.5)).backward(); t.grad.item()
    1.5
    """
    return _ScaleGrad.apply(x, float(factor))


def lsq_grad_factor(numel: int, qmax: int) -> float:
    """LSQ's step-size gradient scale ``1/sqrt(numel·qmax)``.

    ``numel`` is the number of elements that share one scale (per sample for
    activations, as in the LSQ paper); ``qmax`` the largest positive code (at least 1).

    >>> lsq_grad_factor(100, 4)
    0.05
    """
    return 1.0 / math.sqrt(max(1, int(numel)) * max(1, int(qmax)))


def _view(p: Tensor, x: Tensor, axis: Optional[int], group_size: Optional[int]) -> Tensor:
    # without axis/group, a parameter is taken as already broadcastable against x
    if axis is None and group_size is None:
        return p
    return F.param_view(p, x, axis, group_size)


def _fused_form(x, scale, zero_point, qmin, qmax, rounding, axis, group_size) -> bool:
    """The quantizers the fused computation covers (torch's fused per-tensor kernel, the
    blocked per-channel passes), whatever autograd and the compiler want of it."""
    if rounding != "half_even" or x.dtype != torch.float32 or group_size is not None:
        return False
    if qmax - qmin >= 2**16:  # the fused kernels are for narrow integer ranges
        return False
    if axis is None:
        return scale.numel() == 1 and (zero_point is None or zero_point.numel() == 1)
    return scale.dim() == 1 and (zero_point is None or zero_point.shape == scale.shape)


def _qparams_need_grad(scale, zero_point) -> bool:
    return scale.requires_grad or (zero_point is not None and zero_point.requires_grad)


def _fused_ok(x, scale, zero_point, qmin, qmax, rounding, axis, group_size) -> bool:
    if torch.is_grad_enabled() and _qparams_need_grad(scale, zero_point):
        return False
    if torch.compiler.is_compiling():
        # the fused kernels (per tensor with tensor qparams, per channel) have no
        # fake-tensor support: they would break the graph; the compiler fuses the plain ops
        return False
    return _fused_form(x, scale, zero_point, qmin, qmax, rounding, axis, group_size)


class _FakeQuant(torch.autograd.Function):
    """Works on broadcast-shaped ``scale``/``zero_point``; see :func:`fake_quant`."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin, qmax, rounding, grad_factor):
        # the same float32 operation order as functional.fake_quant_affine (and torch's
        # kernel): multiply by the reciprocal, round, add z, clamp, subtract z, scale.
        # (ones/scale is F.reciprocal without its cast to float32, so float64 gradient
        # checks stay in float64; for float32 it is the same correctly rounded value)
        v = x * (torch.ones_like(scale) / scale)
        code = F.round_(v, rounding)
        if zero_point is not None:
            code = code + zero_point
        need_s = ctx.needs_input_grad[1]
        need_z = zero_point is not None and ctx.needs_input_grad[2]
        ctx.flags = (need_s, need_z)
        ctx.zshape = None if zero_point is None else zero_point.shape
        ctx.grad_factor = grad_factor
        ctx.float_mask = not (need_s or need_z) and torch.compiler.is_compiling()
        if ctx.float_mask:
            # compiled: no bool tensor for the compiler to save (inductor's CPU code converts a
            # bool mask element by element: storing it cost more than the whole fake
            # quantization).  The clamp's displacement d = code - clamp(code) is 0 inside
            # the grid, an integer >= 1 in magnitude outside, NaN for NaN; the backward's
            # mask 1 - fmin(|d|, 1) is 1, 0 and 0 (fmin ignores NaN), the bool mask's values
            clamped = code.clamp(qmin, qmax)
            ctx.save_for_backward(code - clamped)
            code = clamped
        else:
            inside = (code >= qmin) & (code <= qmax)
            code = code.clamp(qmin, qmax)
        if zero_point is not None:
            code = code - zero_point
        if need_s or need_z:
            ctx.save_for_backward(inside, v, code, scale)
        elif not ctx.float_mask:
            ctx.save_for_backward(inside)
        return code * scale

    @staticmethod
    def backward(ctx, g):
        need_s, need_z = ctx.flags
        if ctx.float_mask:
            (d,) = ctx.saved_tensors
            gx = g * (1.0 - torch.fmin(d.abs(), torch.ones_like(d)))
        else:
            inside = ctx.saved_tensors[0]
            gx = g * inside
        gs = gz = None
        if need_s or need_z:
            _, v, code, scale = ctx.saved_tensors
            if need_s:
                # inside: round(v) - v (= code - v); outside: the clamped code minus z
                ds = torch.where(inside, code - v, code)
                gs = (g * ds).sum_to_size(scale.shape) * ctx.grad_factor
            if need_z:
                dz = torch.where(inside, torch.zeros_like(g), -scale.expand_as(g))
                gz = (g * dz).sum_to_size(ctx.zshape) * ctx.grad_factor
        return gx, gs, gz, None, None, None, None


_BLOCK_ELEMENTS = 1 << 16


def _channel_fq_mask(x, s, inv, z, qmin, qmax) -> tuple[Tensor, Tensor]:
    # _ChannelFakeQuant's value and clipping mask (see its docstring); no autograd
    out = torch.empty_like(x)
    mask = torch.empty_like(x, dtype=torch.bool)  # x's strides (fq_op's fake gives the same)
    n = x.shape[0] if x.dim() else 1
    per_row = x.numel() // max(1, n)
    blockable = x.dim() > 0 and x.is_contiguous() and s.dim() == x.dim() and s.shape[0] == n > 1
    rows = max(1, _BLOCK_ELEMENTS // max(1, per_row)) if blockable else n
    scratch = torch.empty((min(rows, n),) + tuple(x.shape[1:]) if blockable else x.shape,
                          dtype=x.dtype, device=x.device)
    for i in range(0, n, rows):
        if blockable:
            sl = slice(i, i + rows)
            xb, o, m, sb, ib = x[sl], out[sl], mask[sl], s[sl], inv[sl]
            zb = None if z is None else z[sl]
            v = scratch[: xb.shape[0]]
        else:
            xb, o, m, sb, ib, zb, v = x, out, mask, s, inv, z, scratch
        # v = round(x·(1/s)) + z; o = clamp(v); inside = (v == o): one compare
        torch.mul(xb, ib, out=v)
        v.round_()
        if zb is not None:
            v.add_(zb)
        torch.clamp(v, qmin, qmax, out=o)
        torch.eq(v, o, out=m)
        if zb is not None:
            o.sub_(zb)
        o.mul_(sb)
    return out, mask


class _ChannelFakeQuant(torch.autograd.Function):
    """Per-channel fake quantization, half-even, no scale/zero-point gradient: the value
    of ``functional.fake_quant_affine`` (same float32 operations in the same order; only a
    zero's sign may differ) and the clipping-mask STE.

    Written for speed (a QAT step quantizes every weight): the output and the mask are
    filled in blocks of rows (channels along dim 0, about ``_BLOCK_ELEMENTS`` per block) by
    in-place ops, so each block stays in cache through all passes and nothing but the
    output and the bool mask is allocated.  Other layouts take one block.
    """

    @staticmethod
    def forward(ctx, x, s, inv, z, qmin, qmax):
        out, mask = _channel_fq_mask(x, s, inv, z, qmin, qmax)
        ctx.save_for_backward(mask)
        return out

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        # a 0-d tensor, not the Python scalar 0.0: torch's scalar-other overload is slower
        return torch.where(mask, g, g.new_zeros(())), None, None, None, None, None


def _qparams32(x, scale, zero_point):
    s32 = scale.detach().to(torch.float32)
    z32 = (torch.zeros(s32.shape, dtype=torch.int32, device=x.device) if zero_point is None
           else zero_point.detach().to(torch.int32))
    return s32, z32


def fused_fake_quant_mask(x: Tensor, scale: Tensor, zero_point: Optional[Tensor], qmin: int, qmax: int,
                          axis: Optional[int]) -> tuple[Tensor, Tensor]:
    """The value and clipping mask :func:`fake_quant`'s fused eager path computes (torch's
    fused per-tensor kernel, or the blocked per-channel passes), without autograd: the
    implementation of the compiled op ``qdsl::fake_quant_mask`` (qdsl.quantizers.fq_op)."""
    s32, z32 = _qparams32(x, scale, zero_point)
    if axis is None:
        return torch._fake_quantize_per_tensor_affine_cachemask_tensor_qparams(
            x, s32.reshape(()), z32.reshape(()), torch.ones((), dtype=torch.long, device=x.device), qmin, qmax)
    sv, inv, zv = F._prep(x, s32, z32, axis, None)
    return _channel_fq_mask(x, sv, inv, None if zero_point is None else zv, qmin, qmax)


def fake_quant(
    x: Tensor,
    scale: Tensor,
    zero_point: Optional[Tensor] = None,
    qmin: int = -128,
    qmax: int = 127,
    *,
    rounding: str = "half_even",
    axis: Optional[int] = None,
    group_size: Optional[int] = None,
    grad_factor: float = 1.0,
) -> Tensor:
    """Affine fake quantization with the clipping-mask STE and LSQ/LSQ+ gradients.

    Values equal ``functional.fake_quant_affine`` bit for bit.  ``zero_point`` must hold
    integer values (pass a learned one through :func:`round_ste` first); ``None`` means
    symmetric.  Gradients reach ``scale``/``zero_point`` only if they require grad,
    multiplied by ``grad_factor``.

    >>> x = torch.tensor([-3.0, 0.26, 0.9, 5.0], requires_grad=True)
    >>> s = torch.tensor(0.5, requires_grad=True)
    >>> y = fake_quant(x, s, None, -4, 3); y.tolist()
    [-2.0, 0.5, 1.0, 1.5]
    >>> y.sum().backward(); x.grad.tolist()
    [0.0, 1.0, 1.0, 0.0]
    >>> round(s.grad.item(), 4)  # (-4) + (1 - 0.52) + (2 - 1.8) + 3
    -0.32
    """
    if (torch.compiler.is_compiling() and os.environ.get("QDSL_FQ_OP") == "1"
            and not _qparams_need_grad(scale, zero_point)
            and _fused_form(x, scale, zero_point, qmin, qmax, rounding, axis, group_size)):
        # opt-in (QDSL_FQ_OP=1): the same fused computation as below, one opaque op to the
        # compiler (qdsl.quantizers.fq_op; measured: compile time and step unchanged)
        return fq_op.fake_quant_mask(x, scale.detach(), None if zero_point is None else zero_point.detach(),
                                     qmin, qmax, None if axis is None else axis % x.dim())[0]
    if _fused_ok(x, scale, zero_point, qmin, qmax, rounding, axis, group_size):
        # torch's fused kernel: one pass computing the value and the clipping mask, the
        # same float32 arithmetic as functional.fake_quant_affine (reciprocal multiply,
        # half-even), and the same mask STE in backward.  Only when no gradient to the
        # scale/zero point is needed (it does not give LSQ's).
        s32, z32 = _qparams32(x, scale, zero_point)
        if axis is None:
            return torch.fake_quantize_per_tensor_affine(x, s32.reshape(()), z32.reshape(()), qmin, qmax)
        # per channel: torch's fused per-channel kernel is scalar (not vectorised) code,
        # slower than the blocked in-place ops below (benchmarks/qat_step.py, w4-auto)
        sv, inv, zv = F._prep(x, s32, z32, axis, None)
        return _ChannelFakeQuant.apply(x, sv, inv, None if zero_point is None else zv, qmin, qmax)
    s = _view(scale, x, axis, group_size)
    z = None if zero_point is None else _view(zero_point.to(x.dtype), x, axis, group_size)
    return _FakeQuant.apply(x, s, z, qmin, qmax, rounding, float(grad_factor))


class _PotScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, mode: str) -> Tensor:
        s = F.pot_scale(torch.exp2(t), mode).to(t.dtype)
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx, g: Tensor):
        (s,) = ctx.saved_tensors
        return g * s * math.log(2.0), None


def pot_scale(log2_scale: Tensor, *, ceil: bool = False) -> Tensor:
    """The power of two nearest ``2^t`` in the log domain (``functional.pot_scale``), or the
    smallest one ``>= 2^t`` with ``ceil``; straight-through: ``ds/dt = s·ln 2``.

    Rounding to nearest can shrink the scale by up to √2 (clipping the largest values);
    ``ceil`` never clips but can be up to 2× coarser.

    >>> t = torch.tensor(-2.7, requires_grad=True)
    >>> s = pot_scale(t); s.backward(); s.item(), round(t.grad.item(), 6)
    (0.125, 0.086643)
    """
    return _PotScale.apply(log2_scale, "ceil" if ceil else "round")


class _SignSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, clip: float) -> Tensor:
        ctx.save_for_backward(x.abs() <= clip)
        return torch.where(x >= 0, torch.ones_like(x), -torch.ones_like(x))

    @staticmethod
    def backward(ctx, g: Tensor):
        (mask,) = ctx.saved_tensors
        return g * mask, None


def sign_ste(x: Tensor, clip: float = 1.0) -> Tensor:
    """``sign(x)`` in {-1, +1} (0 maps to +1); gradient ``1{|x| <= clip}`` (BNN's hardtanh STE).

    >>> x = torch.tensor([-2.0, -0.5, 0.0, 0.3, 1.5], requires_grad=True)
    >>> y = sign_ste(x); y.sum().backward(); y.tolist(), x.grad.tolist()
    ([-1.0, -1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0, 0.0])
    """
    return _SignSTE.apply(x, float(clip))


def binary_act(x: Tensor, scale: Optional[Tensor] = None, axis: Optional[int] = None) -> Tensor:
    """Binary activation ``s·sign(x)``; the STE passes gradient where ``|x| <= s`` (s = 1 if None).

    >>> binary_act(torch.tensor([-0.2, 3.0]), torch.tensor(0.5)).tolist()
    [-0.5, 0.5]
    """
    if scale is None:
        return sign_ste(x, 1.0)
    s = _view(scale, x, axis, None)
    # d(s·sign(x))/dx through the clip |x| <= s: a ±s step whose surrogate slope is 1
    return s * sign_ste(x, 1.0).detach() + (x - x.detach()) * (x.detach().abs() <= s.detach())


def _dims(ndim: int, axis: Optional[int]) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axis = axis % ndim
    return tuple(d for d in range(ndim) if d != axis)


def binary_weight(w: Tensor, axis: Optional[int] = 0) -> Tensor:
    """XNOR-Net weights ``α·sign(W)``, ``α = mean|W|`` per slice along ``axis`` (None: per tensor).

    >>> w = torch.tensor([[0.5, -1.5], [0.2, 0.0]])
    >>> binary_weight(w).tolist()
    [[1.0, -1.0], [0.10000000149011612, 0.10000000149011612]]
    """
    alpha = w.abs().mean(dim=_dims(w.dim(), axis), keepdim=axis is not None)
    return alpha * sign_ste(w, 1.0)


def unsigned_binary(x: Tensor, scale: Tensor, axis: Optional[int] = None) -> Tensor:
    """{0, s}: ``s`` where ``x >= s/2`` (``functional.fake_quant_binary(signed=False)``).

    Gradients: ``d/dx = 1{0 <= x <= s}`` (the representable range), ``d/ds = code``.

    >>> unsigned_binary(torch.tensor([-1.0, 0.24, 0.25, 0.9]), torch.tensor(0.5)).tolist()
    [0.0, 0.0, 0.5, 0.5]
    """
    s = _view(scale, x, axis, None)
    xd, sd = x.detach(), s.detach()
    code = (xd >= sd * 0.5).to(x.dtype)
    inside = ((xd >= 0) & (xd <= sd)).to(x.dtype)
    return s * code + (x - xd) * inside


def ternary_weight(w: Tensor, axis: Optional[int] = 0, threshold: float = 0.7) -> Tensor:
    """TWN ternary weights ``α·sign(W)·1{|W| > Δ}``, ``Δ = threshold·mean|W|`` per slice.

    Values equal ``functional.fake_quant_ternary`` with ``functional.ternary_params``
    (for the default threshold).  ``α`` is the mean |W| of the kept weights; the codes
    are straight-through (identity gradient) and α is differentiable.

    >>> ternary_weight(torch.tensor([[1.0, -0.1, -2.0, 0.3]])).tolist()
    [[1.5, 0.0, -1.5, 0.0]]
    """
    dims = _dims(w.dim(), axis)
    keep = axis is not None
    wd = w.detach()
    delta = threshold * wd.abs().mean(dim=dims, keepdim=keep)
    mask = (wd.abs() > delta).to(w.dtype)
    count = mask.sum(dim=dims, keepdim=keep).clamp_min(1.0)
    alpha = (w.abs() * mask).sum(dim=dims, keepdim=keep) / count
    codes = torch.sign(wd) * mask
    return alpha * codes + alpha.detach() * (w - wd)


def pot_weight(w: Tensor, scale: Tensor, bits: int, axis: Optional[int] = None) -> Tensor:
    """Each weight becomes ``±s·2^k`` (``k = 0..-(n-1)``, ``n = 2^(bits-1) - 1``) or 0.

    Values equal ``functional.fake_quant_pot_weight`` (linearly nearest level; ``|w| > s``
    clips to ``s``).  Gradients: identity where ``|w| <= s``, zero where clipped, and
    ``value/s`` to the scale.

    >>> pot_weight(torch.tensor([0.8, -0.7, 0.3, 0.05, 3.0]), torch.tensor(1.0), 3).tolist()
    [1.0, -0.5, 0.25, 0.0, 1.0]
    """
    wd = w.detach()
    s = _view(scale, w, axis, None)
    sd = s.detach()
    value = F.fake_quant_pot_weight(wd, scale.detach(), bits, axis).to(w.dtype)
    inside = (wd.abs() <= sd).to(w.dtype)
    out = value + (w - wd) * inside
    if scale.requires_grad:
        out = out + (s - sd) * (value / sd)
    return out

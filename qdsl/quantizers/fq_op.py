"""Affine fake quantization as one opaque op under ``torch.compile`` (``qdsl::fake_quant_mask``).

By default a compiled QAT step traces each quantizer's fake quantization as a handful of
aten ops (multiply by ``1/s``, round, add ``z``, clamp, compare, subtract ``z``, scale) that
inductor fuses into the neighbouring kernels and generates C++ for, forward and backward
(the backward recomputes the mask).  With ``QDSL_FQ_OP=1`` the value and the clipping mask
are one custom op whose CPU implementation is the
eager QAT path itself (:func:`qdsl.quantizers.ste.fake_quant` without a scale gradient:
torch's fused per-tensor kernel, the blocked per-channel passes), so a compiled step
computes exactly what an eager step computes, and inductor only generates the backward's
``where(mask, g, 0)``.

Guarantees:

* values and the mask equal the eager path's bit for bit (the same code runs);
* the gradient to ``x`` is the clipping-mask STE of the eager path (``g·mask`` per
  tensor, as torch's fused kernel; ``where(mask, g, 0)`` per channel); no gradient to the
  scale or zero point: :func:`qdsl.quantizers.ste.fake_quant` uses the op only where none is
  needed (not for a learned scale, LSQ) and only while compiling (eager keeps calling the
  same code directly: the op's dispatch costs more than it saves there);
* opt-in: only with ``QDSL_FQ_OP=1`` in the environment (read when a graph is traced);
  by default the aten passes are traced.  Measured (``benchmarks/qat_compile.py
  --fq-op-ab`` and per-compile A/Bs in both orders, CPU of the process tree, load 10-12):
  compile time op vs aten pot-asic 28.5/26.0/30.9 vs 29.3/27.1/29.4 s, int8-default
  23.9/26.2/26.5 vs 27.9/25.2/23.4 s, w4a8 22.2/24.1 vs 25.2/21.2 s: no difference beyond
  the noise, and the step is unchanged (1.03/1.02/1.08 vs 1.05/1.01/1.07x float eager).
  The fake quantization was fused into kernels inductor generates anyway (the BN/hardtanh
  epilogue, each weight's range reduction); the op removes ops from them, not kernels, and
  inductor's cost is per generated kernel (gcc ~1.1 s each);
* inductor may hand the op any dense layout (``flexible_layout``: a channels-last
  activation is not copied to and from NCHW around it);
* a fake (meta) implementation gives the output ``x``'s strides and a bool mask of the
  same strides, as the real one does.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["fake_quant_mask"]


@torch.library.custom_op("qdsl::fake_quant_mask", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def fake_quant_mask(x: Tensor, scale: Tensor, zero_point: Optional[Tensor], qmin: int, qmax: int,
                    axis: Optional[int]) -> tuple[Tensor, Tensor]:
    """``(x̂, inside)``: the fake-quantized ``x`` (scale ``[]`` or ``[C]`` along ``axis``,
    zero point of the same shape or None) and the clipping mask of the STE."""
    from qdsl.quantizers import ste

    return ste.fused_fake_quant_mask(x, scale, zero_point, qmin, qmax, axis)


@fake_quant_mask.register_fake
def _fake(x, scale, zero_point, qmin, qmax, axis):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def _setup_context(ctx, inputs, output) -> None:
    ctx.per_tensor = inputs[5] is None
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, g: Tensor, _gmask):
    (mask,) = ctx.saved_tensors
    gx = g * mask if ctx.per_tensor else torch.where(mask, g, g.new_zeros(()))
    return gx, None, None, None, None, None


fake_quant_mask.register_autograd(_backward, setup_context=_setup_context)

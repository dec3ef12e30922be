"""``int_tensors(model)``: the integers a frozen fake-quant model computes with.

For people simulating integer-only hardware: per patched layer with a weight, the
integer weight codes, the int32 bias and every scale and zero point - the exact values
the fake quantizers used (the frozen record of :mod:`qdsl.patch.frozen`), so::

    acc = sum((x_q - x_zp) · (w_q - w_zp)) + b_q         (int64 accumulate)
    y   = acc · (x_scale · w_scale)                       (per output channel)

reproduces the layer's fake-quant output before its output quantizer, up to float32
rounding of the float model's sum (the test uses ``atol = 1e-5 · max|y|``).  Weights are
BN-folded when ``fold_bn`` is on.  The model must be frozen (scales fixed).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

from qdsl.patch.frozen import frozen_layer
from qdsl.patch.handle import State, get_handle
from qdsl.spec.diagnostics import QdslError

__all__ = ["LayerInts", "int_tensors"]


@attrs.frozen
class LayerInts:
    """Integer view of one layer (``None`` where that tensor is not quantized)."""

    fqn: str
    weight: torch.Tensor | None
    """Integer codes (int8/uint8/int16/int32 by range; binary/ternary codes in {-1, 0, 1};
    minifloats: uint8 bit patterns ``sign | exponent | mantissa`` in the low ``bits`` bits,
    ``value = decode(code) · weight_scale`` with ``qdsl.quantizers.formats.minifloat.decode``)."""
    weight_scale: torch.Tensor | None
    """float32, ``[]``/``[C]``/``[C, G]`` (groups; minifloat MX blocks: powers of two, E8M0
    code ``log2(s) + 127``; NVFP4: ``s_t · e4m3``, ``minifloat.split_scale`` separates them)."""
    weight_zero_point: torch.Tensor | None
    weight_kind: str | None
    bias: torch.Tensor | None
    """int32 codes (or the bias quantizer's dtype), ``bias_float ≈ bias · bias_scale``."""
    bias_scale: torch.Tensor | None
    """``float32(input_scale × weight_scale)`` for a derived bias."""
    input_scale: torch.Tensor | None
    input_zero_point: torch.Tensor | None
    output_scale: torch.Tensor | None
    output_zero_point: torch.Tensor | None
    folded_bn: str | None
    """The BatchNorm folded into this layer, if any."""
    float_bias: torch.Tensor | None = None
    """The bias in float when it is not quantized (folded or the module's own)."""
    weight_format: Any = None
    """The weight's number format (qdsl.spec.formats), whose ``operand_codes`` give the
    integers an accumulator multiplies."""


def int_tensors(model: nn.Module) -> dict[str, LayerInts]:
    """``{fqn: LayerInts}`` for every patched layer that has a weight (see module doc)."""
    handle = get_handle(model)
    if handle.state not in (State.FROZEN, State.EXPORTED):
        raise QdslError(
            f"int_tensors needs fixed scales, but the model is {handle.state.value}: call qdsl.freeze(model) first"
        )
    out: dict[str, LayerInts] = {}
    for fqn, patch in handle.layers.items():
        r = frozen_layer(patch)  # the record freeze produced (copies: callers may edit theirs)
        if not r.has_weight:
            continue
        c = lambda t: None if t is None else t.clone()  # noqa: E731
        out[fqn] = LayerInts(
            fqn=fqn,
            weight=c(r.weight_codes),
            weight_scale=c(r.weight_scale),
            weight_zero_point=c(r.weight_zero_point),
            weight_kind=r.weight_format.name if r.weight_format is not None else None,
            weight_format=r.weight_format,
            bias=c(r.bias_codes),
            bias_scale=c(r.bias_scale),
            input_scale=c(r.input_scale),
            input_zero_point=c(r.input_zero_point),
            output_scale=c(r.output_scale),
            output_zero_point=c(r.output_zero_point),
            folded_bn=r.folded_bn,
            float_bias=None if r.bias_codes is not None else c(r.bias_float),
        )
    return out

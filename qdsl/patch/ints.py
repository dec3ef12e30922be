"""``int_tensors(model)``: the integers a frozen fake-quant model computes with.

For people simulating integer-only hardware: per patched layer with a weight, the
integer weight codes, the int32 bias and every scale and zero point - the exact values
the fake quantizers used (same proxies, same ``int_repr``), so::

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

from qdsl.patch.handle import State, get_handle
from qdsl.spec.diagnostics import QdslError

__all__ = ["LayerInts", "int_tensors"]


@attrs.frozen
class LayerInts:
    """Integer view of one layer (``None`` where that tensor is not quantized)."""

    fqn: str
    weight: torch.Tensor | None
    """Integer codes (int8/uint8/int16/int32 by range; binary/ternary codes in {-1, 0, 1})."""
    weight_scale: torch.Tensor | None
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


def _qp(q):
    if q is None or q.dynamic:
        return None, None
    return q.scale.clone(), q.zero_point.clone()


def int_tensors(model: nn.Module) -> dict[str, LayerInts]:
    """``{fqn: LayerInts}`` for every patched layer that has a weight (see module doc)."""
    handle = get_handle(model)
    if handle.state not in (State.FROZEN, State.EXPORTED):
        raise QdslError(
            f"int_tensors needs fixed scales, but the model is {handle.state.value}: call qdsl.freeze(model) first"
        )
    out: dict[str, LayerInts] = {}
    with torch.no_grad():
        for fqn, patch in handle.layers.items():
            w, b = patch.float_params()
            if w is None:
                continue
            wq, bq = patch.wq, patch.bq
            w_int = wq.int_repr(w) if wq is not None else None
            b_int = b_scale = None
            if bq is not None and b is not None and bq.frozen:
                b_int, b_scale = bq.int_repr(b), bq.scale.clone()
            in_s, in_z = _qp(patch.iq)
            out_s, out_z = _qp(patch.oq)
            out[fqn] = LayerInts(
                fqn=fqn,
                weight=w_int,
                weight_scale=wq.scale.clone() if wq is not None else None,
                weight_zero_point=wq.zero_point.clone() if wq is not None else None,
                weight_kind=wq.format.name if wq is not None else None,
                weight_format=wq.format if wq is not None else None,
                bias=b_int,
                bias_scale=b_scale,
                input_scale=in_s,
                input_zero_point=in_z,
                output_scale=out_s,
                output_zero_point=out_z,
                folded_bn=patch.bn_fqn,
                float_bias=None if b_int is not None or b is None else b.detach().clone(),
            )
    return out

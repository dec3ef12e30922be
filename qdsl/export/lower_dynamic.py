"""Lowering of dynamic activation quantization: a Linear whose input quantizer is
``dynamic`` becomes QUANTIZE_DYNAMIC + LINEAR_DYNAMIC (docs/qgraph.md §4.4), as torch.ao's
dynamic Linear: the input's scale is computed per batch (per tensor or per row) when the
graph runs, the weights are per-channel int8, the result is F32 (the next layer quantizes
it again, dynamically or with a static QUANTIZE).

A dynamic quantizer lowers only where the graph computes exactly what the fake quantizer
does: int format, <= 8 bits, the ``minmax`` observer (``auto`` resolves to it at 8 bits),
a ``float`` scale, a built-in rounding, and ``tensor`` granularity or ``channel(0)`` on a
rank-2 input (one scale per row: per token).  Anything else is an :class:`ExportError`
naming the quantizer and the change that lowers it.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import numpy as np
from torch import nn

from qdsl.export.lower_layers import weight_ints, wide
from qdsl.export.values import ROUNDINGS, Builder, ExportError, FloatVal, Pending, QVal
from qdsl.graph.ir import DType, Op, OpType
from qdsl.graph.ops.dynamic import f32_bits
from qdsl.quantizers.observers import MinMaxObserver

__all__ = ["DynIn", "DynOut", "dynamic_input", "linear_dynamic", "as_float", "dynamic_attrs"]


@attrs.frozen
class DynIn:
    """A float tensor ``name`` that a Linear's dynamic input quantizer (``attrs``) reads."""

    name: str
    shape: tuple[int, ...]
    attrs: dict
    where: str
    origin: str


@attrs.define(eq=False)
class DynOut:
    """A LINEAR_DYNAMIC result (F32), emitted when read so a following ReLU fuses into it."""

    origin: str
    shape: tuple[int, ...]
    emit: Callable[[bool], str]
    relu: bool = False
    cache: dict = attrs.field(factory=dict)

    def with_relu(self, lo: float, hi: float, where: str) -> "DynOut":
        if lo != 0.0 or hi != math.inf:
            raise ExportError(where, "only a ReLU fuses into a dynamic Linear's float output (no ReLU6/hardtanh)",
                              "use nn.ReLU after a dynamically quantized Linear")
        return DynOut(self.origin, self.shape, self.emit, True)

    def materialize(self) -> FloatVal:
        if "name" not in self.cache:
            self.cache["name"] = self.emit(self.relu)
        return FloatVal(self.origin, self.shape, self.cache["name"])


def _dyn_attrs(proxy, where: str, shape: tuple[int, ...]) -> dict:
    rec = proxy.recipe
    if proxy.format.activation_lowering(rec.signed) != "int":
        raise ExportError(where, f"a dynamic {proxy.format.name} quantizer has no integer lowering", "use an int quantizer")
    if rec.bits > 8:
        raise ExportError(where, f"{rec.bits}-bit dynamic activations are wider than the graph's 8 bits",
                          "use bits <= 8")
    if type(proxy.observer) is not MinMaxObserver:
        raise ExportError(where, f"the dynamic quantizer's observer ({type(proxy.observer).__name__}) has no "
                                 "run-time form in the graph", "use `observer = minmax` for dynamic quantizers")
    if rec.scale != "float":
        raise ExportError(where, f"a dynamic '{rec.scale}' scale has no run-time form in the graph",
                          "use `scale = float` for dynamic quantizers")
    rounding = ROUNDINGS.get(rec.rounding)
    if rounding is None:
        raise ExportError(where, f"rounding '{rec.rounding}' has no integer lowering", f"use one of {', '.join(ROUNDINGS)}")
    if proxy.offset.numel() or proxy.codes.numel():
        raise ExportError(where, "a dynamic quantizer with PTQ offsets or fixed codes has no integer lowering")
    token = getattr(proxy, "token", False)  # per row of the last axis, any rank: QUANTIZE_DYNAMIC's per_row
    if proxy.group_size is not None or proxy.axis not in (None, 0) or (proxy.axis == 0 and len(shape) != 2
                                                                        and not token):
        raise ExportError(where, "dynamic scales lower per tensor or per row only",
                          "use `granularity = tensor`, `per_token` (one scale per row of the last axis), or "
                          "`channel(0)` on a (batch, features) input (per row)")
    return dict(qmin=int(proxy.qmin), qmax=int(proxy.qmax), symmetric=int(bool(rec.symmetric)),
                per_row=int(proxy.axis == 0), rounding=int(rounding))


def dynamic_attrs(proxy, where: str, shape: tuple[int, ...]) -> dict:
    """QUANTIZE_DYNAMIC's attributes for the dynamic quantizer ``proxy`` reading a value of
    ``shape`` (an ExportError naming ``where`` when the graph cannot compute it)."""
    return _dyn_attrs(proxy, where, shape)


def as_float(b: Builder, value: Any, where: str) -> FloatVal:
    """``value`` as an F32 tensor of the graph: a dynamic Linear's output, the graph input,
    or an integer value dequantized (DEQUANTIZE: exactly ``(q - zp) · scale`` in binary32)."""
    if isinstance(value, DynOut):
        return value.materialize()
    if isinstance(value, FloatVal) and value.name is not None and value.reshape is None:
        return value
    if isinstance(value, Pending) and value.kind == "acc" and not value.post:
        w = wide(b, value, value.origin)
        name = b.op(OpType.DEQUANTIZE, where, [w.name], DType.F32, value.shape, {"scale": w.scale, "zero_point": 0})
        return FloatVal(value.origin, value.shape, name)
    if isinstance(value, QVal) and value.dtype is not DType.BIN:
        name = b.op(OpType.DEQUANTIZE, where, [value.name], DType.F32, value.shape,
                    {"scale": value.scale, "zero_point": value.zp})
        return FloatVal(where, value.shape, name)
    origin = getattr(value, "origin", "?")
    raise ExportError(where, f"a dynamic quantizer reads a value from '{origin}' that the graph has no float form of",
                      "a dynamic quantizer reads the graph input, a layer's result or a dynamic Linear's output; "
                      f"a layer result that is reshaped first needs an output quantizer (`output = a8` for '{origin}')")


def dynamic_input(lw, value: Any, fqn: str, role: str, proxy, module: nn.Module | None) -> DynIn:
    """The dynamic ``role`` quantizer of module ``fqn`` applied to ``value`` (see module doc)."""
    where = f"{fqn or '<model>'}:{role}"
    if role != "input" or not isinstance(module, nn.Linear):
        kind = type(module).__name__ if module is not None else "model"
        raise ExportError(fqn, f"a dynamic {role} quantizer of a {kind} has no integer lowering (the graph "
                                 "quantizes dynamically only a Linear's input: QUANTIZE_DYNAMIC + LINEAR_DYNAMIC)",
                          "set `dynamic = false` for this quantizer and calibrate")
    f = as_float(lw.b, value, where)
    return DynIn(f.name, tuple(f.shape), _dyn_attrs(proxy, where, f.shape), where, f.origin)


def linear_dynamic(b: Builder, fqn: str, m: nn.Module, patch, x: DynIn, shape) -> DynOut:
    """QUANTIZE_DYNAMIC + LINEAR_DYNAMIC for the Linear ``m`` on the dynamic input ``x``."""
    if patch is None or patch.wq is None:
        raise ExportError(fqn, "a dynamic input needs a quantized weight", "quantize this layer's weight in the spec")
    if patch.bq is not None:
        raise ExportError(fqn, "a quantized bias needs a static input scale; a dynamic Linear keeps its bias float "
                               "(as torch.ao's dynamic Linear)", "set `bias = float` for this layer")
    codes, wdtype, s_w, w_zp, bias_f = weight_ints(patch, fqn)
    if wdtype not in (DType.I8, DType.I4, DType.I2) or np.any(w_zp != 0):
        raise ExportError(fqn, f"a dynamic Linear takes symmetric signed int weights (<= 8 bits), not {wdtype.name}"
                               + (" with zero points" if np.any(w_zp != 0) else ""),
                          "use a signed symmetric weight quantizer")
    s_w32 = s_w.astype(np.float32)
    if not np.array_equal(s_w32.astype(np.float64), s_w):  # the fake quantizer's scales are binary32
        raise ExportError(fqn, "weight scales are not binary32 values")
    bias = () if bias_f is None else f32_bits(bias_f.detach().float().reshape(-1).numpy())
    a = dict(x.attrs)

    def emit(relu: bool) -> str:
        q = b.tensor(f"{fqn}:quantize_dynamic", DType.I8 if a["qmin"] < 0 else DType.U8, x.shape)
        qp = b.tensor(f"{fqn}:qparams", DType.F32, x.shape[:-1] + (2,))
        b.ops.append(Op(OpType.QUANTIZE_DYNAMIC, fqn, [x.name], [q, qp], a))
        w = b.tensor(f"{fqn}.weight", wdtype, codes.shape, codes)
        b.info[w] = (s_w, w_zp)
        return b.op(OpType.LINEAR_DYNAMIC, fqn, [q, qp, w], DType.F32, tuple(shape),
                    {"w_scale": f32_bits(s_w32), "bias": bias, "relu": int(relu)})

    return DynOut(fqn, tuple(shape), emit)

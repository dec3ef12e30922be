"""Lowering of ``a * b`` on two quantized activations to MUL (squeeze-excitation's ``scale * x``).

Both operands must be 8-bit quantized values: the product of two codes minus their zero
points is exact in int32, and one output stage rescales it by ``s_a · s_b / s_out`` to the
next quantizer (docs/qgraph.md, MUL), so the result is a :class:`Pending` like an add's.
A layer's raw accumulator is not accepted (its product with another value would need a
second rescale before the multiply); the plan's implied quantizers
(:mod:`qdsl.patch.implied`) put an output quantizer on each operand's module when the spec
leaves it unquantized.  A product with a constant has no lowering.
"""

from __future__ import annotations

from typing import Any

from qdsl.export.values import Builder, ExportError, FloatVal, Pending, QVal, Target
from qdsl.graph.ir import DType, OpType
from qdsl.graph.ops.mul import broadcast_shape
from qdsl.graph.requant import make_rescale

__all__ = ["mul_pending", "int8_operand"]


def int8_operand(v: Any, where: str) -> QVal:
    """``v`` as an 8-bit quantized value, else the error naming what it is and the spec fix."""
    if isinstance(v, QVal) and v.dtype in (DType.I8, DType.U8):
        return v
    if isinstance(v, QVal):
        raise ExportError(where, f"a product reads a {v.dtype.name} value; MUL multiplies 8-bit codes",
                          "quantize both operands to int8/uint8")
    origin = getattr(v, "origin", "") or ""
    place = f" in '{origin}'" if origin else " at the model's top level"
    what = f"the unquantized result of a {v.kind}{place}" if isinstance(v, Pending) else \
        f"an unquantized value{place}"
    hint = (f"add `output = a8` (an activation quantizer) for '{origin}' in the spec" if origin else
            "a function's result has no module to carry a quantizer: compute it with a module "
            "(e.g. nn.Sigmoid() instead of torch.sigmoid) so the plan can quantize it")
    raise ExportError(where, f"the product of two activations reads {what}", hint)


def mul_pending(where: str, a: Any, b: Any, shape: tuple[int, ...]) -> Pending:
    """``a * b`` of two quantized activations, requantized when the next quantizer is known."""
    values = [x for x in (a, b) if isinstance(x, (QVal, Pending, FloatVal))]
    if len(values) < 2:
        raise ExportError(where, "a product of an activation and a constant has no integer lowering",
                          "fold the constant into the layer before or after it (its weights)")
    x0, x1 = int8_operand(a, where), int8_operand(b, where)
    if broadcast_shape(x0.shape, x1.shape) != tuple(shape):
        raise ExportError(where, f"the product of shapes {x0.shape} and {x1.shape} broadcasts beyond what MUL "
                                 "supports (same rank, each dimension equal or 1, equal batch)")

    def emit(bld: Builder, t: Target, lo: float, hi: float):
        if t.dtype not in (DType.I8, DType.U8):
            raise ExportError(where, f"the product must be int8-quantized, not {t.dtype.name} ({t.where})")
        factor = x0.scale * x1.scale / t.scale  # float64: the exact product of the two scales, once rounded
        try:
            rescale = make_rescale(factor, t.rounding, single=bld.single_rounding)
        except ValueError as e:
            raise ExportError(where, f"the product's requantization factor is out of range ({e})") from None
        out_min, out_max = t.clamp_codes(lo, hi)
        attrs_ = dict(in_zp=(x0.zp, x1.zp), **rescale.attrs(), out_zp=t.zp, out_min=out_min, out_max=out_max)
        return bld.op(OpType.MUL, where, [x0.name, x1.name], t.dtype, shape, attrs_, out=f"{where}:mul"), shape

    return Pending("mul", where, tuple(shape), emit)

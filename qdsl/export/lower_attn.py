"""Lowering of attention's pieces: act × act products (MATMUL), softmax (SOFTMAX) and
layer normalization (LAYERNORM), with the transposes that feed a product.

* A transpose or permute of a quantized activation costs no op: it is a :class:`View`
  (the value and a permutation of its dims) that only a product reads, as the operand
  permutation of its MATMUL; a transpose of a product's result becomes the product's
  output permutation.  So ``q.view(B, L, H, d).transpose(1, 2)`` is a RESHAPE and a view,
  and ``(p @ v).transpose(1, 2).reshape(B, L, E)`` is one MATMUL then a RESHAPE.
* A product reads two 8-bit quantized values (the plan implies their quantizers as for
  MUL: "implied by matmul in ..."); its result is a :class:`MatmulPending` requantized
  by ``s_a · s_b · c / s_out`` when the next quantizer is known, ``c`` a positive
  constant factor folded in (attention's ``/ sqrt(d)``).
* Softmax along the last axis reads an 8-bit value and lands on the next quantizer's grid
  through an exact exp table (:mod:`qdsl.graph.ops.softmax`); with masks (:class:`MaskInput`:
  a key or attention mask, a graph input or a constant) it is SOFTMAX_MASKED
  (:mod:`qdsl.graph.ops.softmax_masked`), masked positions at probability exactly 0.
* LayerNorm over the last axis reads an 8-bit value, or - when its input is not quantized -
  the residual sum it normalizes at a wide int32 grid: a layer's accumulator plus a
  quantized value (BERT's ``LayerNorm(dense(h) + x)``) or a quantized value plus a constant
  (the word embedding plus the position and token-type embeddings); its affine weight
  becomes 14-bit codes and its bias accumulator units (:mod:`qdsl.graph.ops.layernorm`).
  A result read unquantized (a residual add, the model output) stays wide: LAYERNORM writes
  its I32 accumulator once and 8-bit readers REQUANTIZE it (:class:`WidePending`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import attrs
import numpy as np

from qdsl.export.lower_mul import int8_operand
from qdsl.export.lower_layers import AddPending, term_grid
from qdsl.export.values import (Builder, ExportError, FloatVal, OffsetVal, Pending, QVal, Target, WidePending,
                               wide_scale)
from qdsl.graph.ir import DType, OpType, Rescale, RescaleKind, Rounding
from qdsl.graph.ops.layernorm import WIDE_MAX_N, layernorm_constants, wide_output_bound, wide_sum_grid
from qdsl.graph.ops.matmul import MAX_DEPTH, matmul_shape
from qdsl.graph.ops.softmax import SOFTMAX_FRAC_BITS, softmax_table
from qdsl.graph.requant import INT32_MAX, INT32_MIN, make_rescale

__all__ = ["View", "SeqFirst", "MatmulPending", "MaskInput", "permute_value", "matmul_pending", "scale_pending",
           "softmax_pending", "layernorm_pending", "softmax_table", "wide_sum_grid"]


@attrs.frozen
class View:
    """A quantized activation read through a permutation of its dims (batch first)."""

    base: QVal
    perm: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape[p] for p in self.perm)

    @property
    def origin(self) -> str:
        return self.base.name


@attrs.frozen
class SeqFirst:
    """A rank-3 value read with its first two dims swapped: ``x.transpose(0, 1)`` of a
    batch-first ``(N, L, E)`` value, the ``(L, N, E)`` a ``batch_first=False``
    MultiheadAttention reads (lower_mha.py; its result is one too).  No graph op moves the
    batch axis, so only such an attention or a transpose back reads it."""

    value: Any

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.value.shape
        return (s[1], s[0], *s[2:])

    @property
    def origin(self) -> str:
        return getattr(self.value, "origin", getattr(self.value, "name", "?"))


@attrs.define(eq=False)
class MatmulPending(Pending):
    """A product's result: the operands, their permutations, the output permutation and the
    constant factor, so a later transpose or constant scale rebuilds it."""

    args: tuple = ()


def _compose(perm: Sequence[int], outer: Sequence[int]) -> tuple[int, ...]:
    # applying `outer` to a value already permuted by `perm`
    return tuple(perm[p] for p in outer)


def permute_value(where: str, value: Any, perm: Sequence[int]) -> Any:
    """``value`` with its dims permuted by ``perm`` (batch first): a view or a rebuilt product."""
    perm = tuple(int(p) for p in perm)
    if perm == (1, 0, 2) and isinstance(value, SeqFirst):  # back to batch first
        return value.value
    if perm == (1, 0, 2) and isinstance(value, (QVal, Pending, FloatVal)):
        return SeqFirst(value)
    if perm[0] != 0:
        raise ExportError(where, f"a permutation {perm} that moves the batch dimension has no integer lowering",
                          "only a (N, L, E) value transposed for a batch_first=False MultiheadAttention, and its "
                          "result transposed back, may swap the first two dims")
    if perm == tuple(range(len(perm))):
        return value
    if isinstance(value, QVal):
        return View(value, perm)
    if isinstance(value, View):
        return View(value.base, _compose(value.perm, perm))
    if isinstance(value, MatmulPending) and not value.post and value.lo == -math.inf and value.hi == math.inf:
        x0, p0, x1, p1, out_perm, factor = value.args
        return matmul_pending(where, x0, p0, x1, p1, _compose(out_perm, perm), factor)
    origin = getattr(value, "origin", "?")
    raise ExportError(where, f"a transpose reads a value from '{origin}' that is not a quantized activation",
                      f"quantize it: add `output = a8` (an activation quantizer) for '{origin}' in the spec")


def _as_view(v: Any, where: str) -> tuple[QVal, tuple[int, ...]]:
    if isinstance(v, View):
        return v.base, v.perm
    q = int8_operand(v, where)
    return q, tuple(range(len(q.shape)))


def matmul_pending(where: str, x0: QVal, p0: tuple[int, ...], x1: QVal, p1: tuple[int, ...],
                   out_perm: tuple[int, ...] | None = None, factor: float = 1.0) -> MatmulPending:
    """``c · (x0 viewed by p0) @ (x1 viewed by p1)``, its result permuted by ``out_perm``."""
    rank = len(p0)
    out_perm = tuple(range(rank)) if out_perm is None else tuple(out_perm)
    shape, why = matmul_shape(x0.shape, x1.shape, p0, p1, out_perm)
    if shape is None:
        raise ExportError(where, f"this product has no MATMUL lowering: {why}",
                          "MATMUL multiplies two activations of the same rank >= 3 (batch first)")
    depth = x0.shape[p0[-1]]
    if depth > MAX_DEPTH:
        raise ExportError(where, f"the product's reduction length {depth} exceeds {MAX_DEPTH} (int32 accumulator)")

    def emit(bld: Builder, t: Target, lo: float, hi: float):
        if t.dtype not in (DType.I8, DType.U8):
            raise ExportError(where, f"the product must be int8-quantized, not {t.dtype.name} ({t.where})")
        try:
            rescale = make_rescale(x0.scale * x1.scale * factor / t.scale, t.rounding, single=bld.single_rounding)
        except ValueError as e:
            raise ExportError(where, f"the product's requantization factor is out of range ({e})") from None
        out_min, out_max = t.clamp_codes(lo, hi)
        a = dict(in_zp=(x0.zp, x1.zp), a_perm=p0, b_perm=p1, out_perm=out_perm, **rescale.attrs(), out_zp=t.zp,
                 out_min=out_min, out_max=out_max)
        return bld.op(OpType.MATMUL, where, [x0.name, x1.name], t.dtype, shape, a, out=f"{where}:matmul"), shape

    return MatmulPending("matmul", where, shape, emit, args=(x0, p0, x1, p1, out_perm, factor))


def product(where: str, a: Any, b: Any) -> MatmulPending:
    """``a @ b`` of two quantized activations (each possibly a transposed view)."""
    x0, p0 = _as_view(a, where)
    x1, p1 = _as_view(b, where)
    if len(p0) != len(p1):
        raise ExportError(where, f"a product of a rank-{len(p0)} and a rank-{len(p1)} activation has no MATMUL lowering",
                          "give both operands the same rank (batch first)")
    return matmul_pending(where, x0, p0, x1, p1)


def scale_pending(where: str, value: Any, factor: float) -> MatmulPending | None:
    """A product's result times a positive constant (folded into its requantization), or
    ``None`` when ``value`` is not a product's untouched result."""
    if not isinstance(value, MatmulPending) or value.post or value.lo != -math.inf or value.hi != math.inf:
        return None
    if not (math.isfinite(factor) and factor > 0):
        raise ExportError(where, f"a product scaled by {factor} has no integer lowering (positive factors only)")
    x0, p0, x1, p1, out_perm, c = value.args
    return matmul_pending(where, x0, p0, x1, p1, out_perm, c * factor)


def _need_int8(where: str, what: str, x: Any) -> QVal:
    if isinstance(x, QVal) and x.dtype in (DType.I8, DType.U8):
        return x
    origin = getattr(x, "origin", "?")
    raise ExportError(where, f"{what} reads an unquantized value from '{origin}': its integer lowering reads 8-bit codes",
                      f"quantize it: add `input = a8` (an activation quantizer) for '{where}' in the spec")


@attrs.frozen
class MaskInput:
    """A mask a softmax reads (SOFTMAX_MASKED, docs/qgraph.md §4.4): the graph tensor ``name``
    (an I32/I8/U8/F32 graph input, an activation, or a constant the lowering added with
    ``Builder.tensor(..., data=...)``), where it sits on the scores (``dims``: per scores
    axis the mask dim indexing it, or -1 to broadcast) and which values attend (``attend``
    1: nonzero attends, Hugging Face's ``attention_mask``; 0: zero attends, torch's bool
    masks and additive F32 0/-inf masks)."""

    name: str
    dims: tuple[int, ...]
    attend: int


def softmax_pending(where: str, x: Any, dim: int, shape: tuple[int, ...], masks: Sequence[MaskInput] = ()) -> Pending:
    """Softmax of the quantized ``x`` along ``dim`` (the last axis only); with one or two
    ``masks``, over the positions they keep (SOFTMAX_MASKED)."""
    v = _need_int8(where, "softmax", x)
    if dim not in (-1, len(v.shape) - 1):
        raise ExportError(where, f"softmax along dim {dim} has no integer lowering (the last axis only)",
                          "move the axis last (transpose) before the softmax")
    masks = tuple(masks)
    if len(masks) > 2:
        raise ExportError(where, f"a softmax with {len(masks)} masks has no integer lowering (at most 2)")
    for mk in masks:
        if len(mk.dims) != len(v.shape):
            raise ExportError(where, f"mask {mk.name!r} is placed on {len(mk.dims)} axes, the scores have "
                                     f"{len(v.shape)}")

    def emit(bld: Builder, t: Target, lo: float, hi: float):
        if t.dtype not in (DType.I8, DType.U8):
            raise ExportError(where, f"the softmax result must be int8-quantized, not {t.dtype.name} ({t.where})")
        rescale = make_rescale(2.0**-SOFTMAX_FRAC_BITS / t.scale, t.rounding, single=bld.single_rounding)
        out_min, out_max = t.clamp_codes(lo, hi)
        a = dict(table=softmax_table(v.scale), **rescale.attrs(), out_zp=t.zp, out_min=out_min, out_max=out_max)
        if not masks:
            return bld.op(OpType.SOFTMAX, where, [v.name], t.dtype, shape, a, out=f"{where}:softmax"), shape
        a.update(mask_dims=tuple(d for mk in masks for d in mk.dims), mask_attend=tuple(mk.attend for mk in masks))
        return bld.op(OpType.SOFTMAX_MASKED, where, [v.name] + [mk.name for mk in masks], t.dtype, shape, a,
                      out=f"{where}:softmax"), shape

    return Pending("softmax", where, shape, emit)


def _pow2_floor(v: float) -> float:
    return math.ldexp(1.0, math.frexp(v)[1] - 1)


def _term_bound(v: Any) -> float | None:
    """The largest ``|real value|`` of one term of a wide sum, or None when not known."""
    if wide_scale(v) is not None:
        return getattr(v, "bound", None)
    if isinstance(v, QVal):
        return max(abs(v.qmin - v.zp), abs(v.qmax - v.zp)) * v.scale
    if isinstance(v, Pending):
        return v.bound
    return float(np.abs(v).max(initial=0))  # a constant


def _wide_terms(where: str, x: Any, n: int, eps: float) -> tuple[list, float] | None:
    """The terms of a LayerNorm input read wide (a residual sum of a layer accumulator and a
    quantized value or a LayerNorm's wide output, or a quantized value plus a constant) and
    their common grid ``s_t`` (:func:`wide_sum_grid`; a sum with a term of unknown bound: the
    finest accumulator or 8-bit grid's, lower_layers.term_grid), or ``None`` for another value."""
    if isinstance(x, AddPending) and not x.post and x.lo == -math.inf and x.hi == math.inf:
        terms = list(x.args)
    elif isinstance(x, OffsetVal):
        terms = [x.base, x.const.detach().double().numpy()]
    else:
        return None
    bounds = [_term_bound(v) for v in terms]
    if any(b is None for b in bounds):
        return terms, term_grid(terms)
    return terms, wide_sum_grid(sum(bounds), n, eps)


def layernorm_pending(where: str, x: Any, normalized_shape: Sequence[int], weight, bias, eps: float,
                      shape: tuple[int, ...], wide_out: bool = False) -> WidePending:
    """LayerNorm over the last axis (``weight``/``bias``: float arrays or None) of the
    quantized ``x`` (the narrow form: one 8-bit input), or of a residual sum read wide: a
    layer's accumulator plus a quantized value or a LayerNorm's wide output, or a quantized
    value plus a constant, each brought to one int32 grid (LAYERNORM's wide form: two
    inputs).  ``wide_out``: the result is also read unquantized (:class:`~qdsl.export.values.WidePending`)."""
    if len(normalized_shape) != 1:
        raise ExportError(where, f"LayerNorm over {len(normalized_shape)} dims has no integer lowering (the last only)")
    n = int(normalized_shape[0])
    wide = _wide_terms(where, x, n, eps)
    if wide is None:
        v = _need_int8(where, "LayerNorm", x)
        terms, s_in = [v], v.scale
    else:
        terms, s_in = wide
        if n > WIDE_MAX_N:
            raise ExportError(where, f"a LayerNorm over {n} channels reading a wide residual sum has no integer "
                                     f"lowering (at most {WIDE_MAX_N})", "quantize its input (`input = a8`)")
    # shared with the fake-quant simulation (qdsl.patch.int_sim): one derivation
    g_int, b_int, unit, eps_int = layernorm_constants(n, weight, bias, eps, s_in)
    if wide is None and n**3 * 255**2 + eps_int >= 2**62:
        raise ExportError(where, f"LayerNorm over {n} channels with eps {eps} overflows the int64 variance sum")
    if wide is not None and eps_int >= 2**61:
        raise ExportError(where, f"LayerNorm eps {eps} at the input grid {s_in:.3g} overflows the int64 variance sum")

    def inputs(bld: Builder, rounding) -> tuple[list[str], dict]:
        names, zps, rescales = [], [], []
        one = Rescale(RescaleKind.POT, [1], [0])
        for v in terms:
            if wide is None:
                names.append(v.name)
                zps.append(v.zp)
                rescales.append(one)
            elif wide_scale(v) is not None:  # a LayerNorm's wide output, rounded onto the sum's grid
                w = v.wide(bld)
                names.append(w.name)
                zps.append(0)
                try:
                    rescales.append(make_rescale(w.scale / s_in, rounding, single=bld.single_rounding))
                except ValueError as e:
                    raise ExportError(where, f"the LayerNorm input rescale is out of range ({e})") from None
            elif isinstance(v, QVal):
                names.append(v.name)
                zps.append(v.zp)
                try:
                    rescales.append(make_rescale(v.scale / s_in, rounding, single=bld.single_rounding))
                except ValueError as e:
                    raise ExportError(where, f"the LayerNorm input rescale is out of range ({e})") from None
            elif isinstance(v, Pending):
                t32 = Target(s_in, 0, INT32_MIN, INT32_MAX, DType.I32, Rounding.HALF_AWAY, where)
                names.append(v.materialize(bld, t32).name)
                zps.append(0)
                rescales.append(one)
            else:  # the constant (1, ...) at the wide grid
                codes = np.rint(v[:1] / s_in).astype(np.int64)
                names.append(bld.tensor(f"{where}.offset", DType.I32, codes.shape, codes))
                bld.info[names[-1]] = (s_in, 0)
                zps.append(0)
                rescales.append(one)
        return names, dict(in_zp=tuple(zps), in_kind=tuple(int(r.kind) for r in rescales),
                           in_multiplier=tuple(int(r.multiplier[0]) for r in rescales),
                           in_shift=tuple(int(r.shift[0]) for r in rescales),
                           in_rounding=tuple(int(r.rounding) for r in rescales))

    def emit(bld: Builder, t: Target, lo: float, hi: float):
        if t.raw:  # the wide output: the accumulator itself, I32 at `unit` (WidePending.wide)
            rescale, rounding = Rescale(RescaleKind.POT, [1], [0]), Rounding.HALF_EVEN
            out_zp, out_min, out_max = 0, INT32_MIN, INT32_MAX
        elif t.dtype not in (DType.I8, DType.U8):
            raise ExportError(where, f"the LayerNorm result must be int8-quantized, not {t.dtype.name} ({t.where})")
        else:
            try:
                rescale = make_rescale(unit / t.scale, t.rounding, single=bld.single_rounding)
            except ValueError as e:
                raise ExportError(where, f"the LayerNorm requantization factor is out of range ({e})") from None
            out_zp, rounding = t.zp, t.rounding
            out_min, out_max = t.clamp_codes(lo, hi)
            if result.wide_out:  # an 8-bit reader of the wide output: REQUANTIZE by the same factor
                w = result.wide(bld)
                a = dict(in_zp=0, **rescale.attrs(), out_zp=out_zp, out_min=out_min, out_max=out_max)
                return bld.op(OpType.REQUANTIZE, t.where, [w.name], t.dtype, shape, a), shape
        names, in_attrs = inputs(bld, rounding)
        a = dict(in_attrs, gamma=tuple(int(g) for g in g_int), beta=tuple(int(b) for b in b_int), eps=eps_int,
                 **rescale.attrs(), out_zp=out_zp, out_min=out_min, out_max=out_max)
        return bld.op(OpType.LAYERNORM, where, names, t.dtype, shape, a, out=f"{where}:layernorm"), shape

    bound = wide_output_bound(g_int, b_int, unit)  # the bound qdsl.patch.residual_sim sizes its grid with
    result = WidePending("layernorm", where, shape, emit, unit=unit, wide_out=wide_out, bound=bound)  # emit reads it
    return result

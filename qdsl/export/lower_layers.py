"""Lowering of the value-producing constructs: layers, residual adds, average pools, concat.

Each function returns a :class:`~qdsl.export.values.Pending` (or a QVal when no
requantization is needed) whose ``emit`` writes the integer op once the next quantizer
is known. Integer weights and biases come from the layer's frozen record
(:mod:`qdsl.patch.frozen`: ``int_repr`` of its own proxies on the BN-folded float weight),
so they are exactly the codes the fake-quant model used.
"""

from __future__ import annotations

import math
from fractions import Fraction

import attrs
import numpy as np
import torch
from torch import nn

from qdsl.graph.ir import DType, OpType, OverflowMode, Rescale, RescaleKind, Rounding
from qdsl.graph.ops.weighted import accumulator_bound
from qdsl.graph.requant import INT32_MAX, INT32_MIN, make_rescale, pot_shift
from qdsl.export.exact_weights import NotExact, exact_weight_ints
from qdsl.export.float8 import float8_target, float8_weight, onnx_float8_type
from qdsl.export.lower_threshold import accumulator_threshold_bias, binarize_codes, channel_thresholds
from qdsl.export.add_grid import add_fraction_bits
from qdsl.export.values import ROUNDINGS, Builder, ExportError, Pending, QVal, Target, wide_scale
from qdsl.patch.frozen import frozen_layer
from qdsl.quantizers.formats.base import FormatOps, NotExportable
from qdsl.spec.model import Overflow, Role

__all__ = ["act_target", "layer_pending", "add_pending", "AddPending", "pool_pending", "concat_value", "weight_ints",
           "decoded_weight", "wide", "raw", "term_grid"]


def act_target(proxy, where: str, float8: bool = False) -> Target:
    """The frozen per-tensor activation quantizer ``proxy`` as a :class:`Target`; with
    ``float8`` (the ONNX writer's mode) an FP8 quantizer is a placeholder int8 target whose
    scale is an :class:`F8Scale` (qdsl/export/float8.py)."""
    if proxy.dynamic:
        raise ExportError(where, "a dynamic quantizer has no static target (only a Linear's input lowers, to "
                                 "QUANTIZE_DYNAMIC + LINEAR_DYNAMIC: qdsl/export/lower_dynamic.py)",
                          "set `dynamic = false` for this quantizer and calibrate")
    if not proxy.frozen or proxy.scale.numel() == 0:
        raise ExportError(where, "the quantizer is not frozen", "call qdsl.freeze(model) after calibration")
    if proxy.scale.numel() != 1:
        raise ExportError(where, "per-channel activation scales have no integer lowering",
                          "use `granularity = tensor` for activations")
    rounding = ROUNDINGS.get(proxy.recipe.rounding)
    if rounding is None:
        raise ExportError(where, f"rounding '{proxy.recipe.rounding}' has no integer lowering",
                          f"use one of {', '.join(ROUNDINGS)}")
    scale = float(proxy.scale.detach().reshape(-1)[0])
    lowering = proxy.format.activation_lowering(proxy.recipe.signed)
    if lowering == "bin":
        return Target(scale, 0, -1, 1, DType.BIN, rounding, where, thresholds=channel_thresholds(proxy))
    if lowering is None and float8 and onnx_float8_type(proxy.format):
        if rounding is not Rounding.HALF_EVEN:
            raise ExportError(where, f"ONNX QuantizeLinear rounds to nearest even; this {proxy.format.name} "
                                     f"quantizer rounds '{proxy.recipe.rounding}'", "use rounding = half_even")
        return float8_target(scale, proxy.format, where)
    if lowering != "int":
        raise ExportError(where, f"{proxy.format.name} activations have no integer lowering", "use int or signed binary")
    if proxy.recipe.bits > 8:
        raise ExportError(where, f"{proxy.recipe.bits}-bit activations are wider than the graph's 8-bit activations",
                          "use bits <= 8 for activations")
    zp = int(proxy.zero_point.reshape(-1)[0])
    return Target(scale, zp, int(proxy.qmin), int(proxy.qmax), DType.I8 if proxy.qmin < 0 else DType.U8, rounding, where)


def weight_ints(patch, where: str, out_axis: int = 0):
    """``(codes, dtype, scale[C] float64, zero points[C], float bias or None)`` of a layer's
    weight, ``C`` the size of its output-channel axis ``out_axis`` (1 for a transposed
    conv's ``in × out/groups × k..`` weight)."""
    wq = patch.wq
    if not wq.frozen:
        raise ExportError(where, "the weight quantizer is not frozen", "call qdsl.freeze(model)")
    if wq.axis not in (None, out_axis) or (wq.group_size and out_axis != 0):
        raise ExportError(where, "non-output-channel weight scales have no integer lowering: an accumulator needs "
                                 "one scale per output channel", "use `granularity = channel`")
    rec = frozen_layer(patch)  # the codes the fake quantizers use, derived once (qdsl.patch.frozen)
    codes = rec.weight_codes.numpy().astype(np.int64)
    scale = rec.weight_scale.detach().double().reshape(-1).numpy()
    c = codes.shape[out_axis]
    # the number format maps its codes to graph constants (pot: onto an integer grid); a
    # format without a mapping (minifloat), and group-wise scales, lower only when the
    # values are exact integers times one scale per output channel (qdsl/export/exact_weights.py)
    try:
        if wq.group_size:
            raise NotExportable("group-wise weight scales have no integer lowering", "use `granularity = channel`")
        zp = np.broadcast_to(rec.weight_zero_point.reshape(-1).numpy().astype(np.int64), (c,)).copy()
        codes, scale, dtype_name = wq._ops.lower_weight(wq, codes, np.broadcast_to(scale, (c,)).copy())
    except NotExportable as exc:
        if not decoded_weight(wq):  # the format's own refusal (pot beyond 4 bits: lint's W320)
            raise ExportError(where, exc.message, exc.hint) from None
        w, _ = patch.float_params()
        got = exact_weight_ints(wq, w, out_axis)
        if isinstance(got, NotExact):
            what = f"{wq.format.name} weights" + (f" with group({wq.group_size}) scales" if wq.group_size else "")
            hints = (exc.hint, "qdsl.export.onnx.export_onnx writes them as FLOAT8"
                     if onnx_float8_type(wq.format) and not wq.group_size else None,
                     _written_at(patch, "granularity" if wq.group_size else "kind"))
            raise ExportError(where, got.message(what), "; ".join(h for h in hints if h) or None) from None
        codes, scale, dtype_name, zp = got.codes, got.scale, got.dtype, np.zeros(c, dtype=np.int64)
    return codes, DType[dtype_name], scale, zp, rec.bias_float


def _written_at(patch, field: str) -> str:
    """Where the spec writes the weight's ``field`` (``"the weight's kind is written at
    m.qspec:4:12 (defaults)"``), from the plan's provenance; empty when unknown."""
    p = getattr(patch.plan, "provenance", {}).get((Role.WEIGHT, field))
    if p is None:
        return ""
    origin = p.via[-1] if p.via else p.set_by
    if not origin.span.known:
        return ""
    return f"the weight's {field} is written at {origin.span.location()} ({origin.label})"


def decoded_weight(wq) -> bool:
    """The weight lowers only through the exact decode (qdsl/export/exact_weights.py):
    group-wise scales, or a format that keeps the default refusal (minifloat) instead of
    mapping its codes to graph constants itself (int, pot, binary, ternary).  Lint asks the
    same (qdsl/lint/exact_export.py)."""
    return bool(wq.group_size) or type(wq._ops).lower_weight is FormatOps.lower_weight


def _bias_ints(patch, b, s_acc: np.ndarray, where: str):
    """int32 bias at scale ``s_acc`` (see lower.py module doc), or None.

    A float bias ``b`` (no bias quantizer) becomes ``rint(b / s_acc)`` (error <= half an
    accumulator LSB); before a sign (BIN output) :func:`_sign_bias` replaces it."""
    if b is None:
        return None
    bq = patch.bq
    if bq is not None:
        if not bq.frozen:
            raise ExportError(where, "the bias quantizer is not frozen", "call qdsl.freeze(model)")
        vals = frozen_layer(patch).bias_at(s_acc)
    else:
        vals = np.rint(b.detach().double().numpy() / s_acc)
    if np.abs(vals).max(initial=0) > INT32_MAX:
        raise ExportError(where, "the bias does not fit int32 at scale input·weight",
                          "the input or weight scale is too small for this bias")
    return vals.astype(np.int64)


def _fake_bias(patch, b, where: str):
    """The bias the fake-quant layer adds (its bias quantizer's value, else the float
    bias), as float32 values per channel, or None."""
    if b is None:
        return None
    with torch.no_grad():
        if patch.bq is not None:
            if not patch.bq.frozen:
                raise ExportError(where, "the bias quantizer is not frozen", "call qdsl.freeze(model)")
            b = patch.bq(b)
        return b.detach().float().reshape(-1).numpy()


def _sign_bias(patch, b, s_acc: np.ndarray, where: str):
    """int32 thresholds ``t[c]`` for a BIN output, or None: ``acc + t[c] < 0`` exactly when
    ``acc·s_acc[c] + b̂[c] < 0``, ``b̂`` the bias the fake-quant layer adds (its bias
    quantizer's value, else the float bias).  For an integer ``acc`` that is
    ``t = floor(b̂ / s_acc)``, taken in exact rationals: near a tie (``acc = -b̂/s_acc``, an
    integer bias code at a scale ``float32(s_x·s_w)`` a rounding away from ``s_acc``) a
    rounded quotient gave the wrong side; the frozen XNOR layer computes this sum exactly
    (qdsl.patch.layer), so the graph's sign is then the fake-quant model's."""
    if b is None:
        return None
    vals = _fake_bias(patch, b, where).tolist()
    s = np.broadcast_to(np.asarray(s_acc, dtype=np.float64), (len(vals),))
    t = np.array([math.floor(Fraction(v) / Fraction(float(si))) for v, si in zip(vals, s)], dtype=np.int64)
    if np.abs(t).max(initial=0) > INT32_MAX:
        raise ExportError(where, "the bias does not fit int32 at scale input·weight",
                          "the input or weight scale is too small for this bias")
    return t


def _rescale(bld: Builder, factors, rounding: Rounding, where: str, allow_pot: bool = True) -> Rescale:
    try:
        return make_rescale(factors, rounding, allow_pot, single=bld.single_rounding)
    except ValueError as e:
        raise ExportError(where, f"a requantization factor is out of range ({e})") from None


def _spatial(m: nn.Module, rank: int, where: str) -> dict:
    if getattr(m, "padding_mode", "zeros") != "zeros":
        raise ExportError(where, f"padding_mode='{m.padding_mode}' has no integer lowering", "use zero padding")
    pad = m.padding
    if isinstance(pad, str):
        if pad != "valid":
            raise ExportError(where, f"padding='{pad}' is not supported by export", "give the padding as integers")
        pad = (0,) * rank
    return dict(stride=tuple(m.stride), padding=tuple(pad), dilation=tuple(m.dilation), groups=int(m.groups))


# transposed convs: their graph op, spatial rank and weight axis of the output channels
_TRANSPOSED = {nn.ConvTranspose1d: (OpType.CONV_TRANSPOSE1D, 1), nn.ConvTranspose2d: (OpType.CONV_TRANSPOSE2D, 2)}


def _transposed(m: nn.Module) -> tuple[OpType, int] | None:
    return next((v for t, v in _TRANSPOSED.items() if isinstance(m, t)), None)


def _output_padding(m: nn.Module, in_shape, out_shape, where: str) -> tuple[int, ...]:
    """The output padding of the traced call: ``m.output_padding``, or what a call with
    ``output_size=`` chose (the traced output shape says which)."""
    out = []
    for i, (n, k, s, p, d) in enumerate(zip(in_shape[2:], m.kernel_size, m.stride, m.padding, m.dilation)):
        extra = out_shape[2 + i] - ((n - 1) * s - 2 * p + d * (k - 1) + 1)
        if not 0 <= extra < max(s, d):
            raise ExportError(where, f"output size {tuple(out_shape[2:])} is not one a transposed conv can give")
        out.append(int(extra))
    return tuple(out)


def layer_pending(b: Builder, fqn: str, m: nn.Module, patch, x: QVal, shape) -> Pending:
    """A Conv1d/Conv2d/Linear/ConvTranspose1d/ConvTranspose2d on the quantized input ``x``."""
    transposed = _transposed(m)
    f8 = None
    if b.onnx_float8:  # ONNX: FP8 weights as float8 (qdsl/export/float8.py), not an int8 decode
        f8 = float8_weight(patch.wq, patch.float_params()[0], 1 if transposed else 0) if patch.wq.frozen else None
    if f8 is not None:
        codes, wdtype, s_w, bias_f = f8.bits, DType.U8, f8.scale, frozen_layer(patch).bias_float
        w_zp = np.zeros(len(s_w), dtype=np.int64)
    else:
        codes, wdtype, s_w, w_zp, bias_f = weight_ints(patch, fqn, 1 if transposed else 0)
    binary = x.dtype is DType.BIN
    if binary and wdtype is not DType.BIN:
        raise ExportError(fqn, "binary activations need binary weights (XNOR-popcount)", "make the weight binary too")
    if transposed:
        if wdtype is DType.BIN:
            # no XNOR form: CONV_TRANSPOSE reads the ±1 input itself (BIN, zero point 0) and
            # the ±1 weight codes as I8 (zero point 0), so the accumulator is the exact
            # Σ ±1·±1 and the stage's factor carries α_x·α_w[c] as for BCONV
            wdtype, binary = DType.I8, False
        # output channel g·og + o has the scale and zero point of weight column o
        s_w, w_zp = np.tile(s_w, m.groups), np.tile(w_zp, m.groups)
    s_acc = np.float64(x.scale) * s_w
    bias = _bias_ints(patch, bias_f, s_acc, fqn)
    rank = transposed[1] if transposed else 1 if isinstance(m, nn.Conv1d) else 2 if isinstance(m, nn.Conv2d) else 0
    if len(x.shape) != rank + 2 and not (rank == 0 and len(x.shape) > 2 and not binary):
        raise ExportError(fqn, f"{type(m).__name__} on a rank-{len(x.shape)} input {x.shape} has no integer lowering",
                          "the integer graph's linear layers take (batch, ..., features) inputs")
    op = transposed[0] if transposed else {
        (0, False): OpType.LINEAR, (1, False): OpType.CONV1D, (2, False): OpType.CONV2D,
        (0, True): OpType.BLINEAR, (1, True): OpType.BCONV1D, (2, True): OpType.BCONV2D}[(rank, binary)]
    acc = patch.plan.accumulator
    attrs_ = {"acc_bits": int(acc.bits),
              "overflow": int(OverflowMode.SATURATE if acc.overflow is Overflow.SATURATE else OverflowMode.WRAP)}
    if transposed:
        attrs_.update(_spatial(m, rank, fqn), output_padding=_output_padding(m, x.shape, shape, fqn))
    elif rank:
        attrs_.update(_spatial(m, rank, fqn))
    if not binary:  # a BIN input (transposed) has zero point 0
        attrs_.update(in_zp=x.zp, w_zp=tuple(int(z) for z in w_zp) if np.any(w_zp != w_zp[0]) else (int(w_zp[0]),))
    if wdtype is DType.BIN and np.any(w_zp != 0):
        raise ExportError(fqn, "binary weights cannot have a zero point")
    inputs = [x.name, b.tensor(f"{fqn}.weight", wdtype, codes.shape, codes)]
    b.info[inputs[1]] = (s_w, w_zp)  # real weight = (w - zp[c]) · s_w[c] (ONNX export reads it)
    if f8 is not None:
        b.info[inputs[1]] = f8.grid(w_zp)
    if bias is not None:
        inputs.append(b.tensor(f"{fqn}.bias", DType.I32, bias.shape, bias))
        b.info[inputs[2]] = (s_acc, np.zeros_like(w_zp))
    sign_bias = _sign_bias(patch, bias_f, s_acc, fqn)
    # |acc| bound per output channel (a learned threshold's always/never cases; a transposed
    # conv's: the whole weight, a loose bound that is enough there)
    x_codes = 1 if binary else max(abs(x.qmin - x.zp), abs(x.qmax - x.zp))
    if transposed:
        acc_max = np.full(len(s_acc), int(np.abs(codes).sum() + np.abs(w_zp).max(initial=0) * codes.size) * x_codes)
    else:
        w_rows = np.abs(codes.reshape(codes.shape[0], -1).astype(np.int64) - np.asarray(w_zp).reshape(-1, 1))
        acc_max = w_rows.sum(axis=1) * x_codes

    def emit(bld: Builder, t: Target, lo: float, hi: float):
        a = dict(attrs_)
        ins = list(inputs)
        if t.dtype is DType.BIN and t.thresholds is not None:
            if len(t.thresholds) != len(s_acc):
                raise ExportError(t.where, f"a learned threshold has {len(t.thresholds)} channels, '{fqn}' has "
                                           f"{len(s_acc)} outputs", "a threshold is per channel along axis 1")
            tb = accumulator_threshold_bias(t, s_acc, _fake_bias(patch, bias_f, fqn), lo, hi, acc_max)
            name = bld.tensor(f"{fqn}.bias_threshold", DType.I32, tb.shape, tb)
            ins = ins[:2] + [name]
        elif t.dtype is DType.BIN and sign_bias is not None and not np.array_equal(sign_bias, bias):
            ins[2] = bld.tensor(f"{fqn}.bias_sign", DType.I32, sign_bias.shape, sign_bias)
        if t.raw:  # the accumulator itself (a per-channel consumer rescales it); ReLU only
            a.update(Rescale(RescaleKind.POT, [1], [0]).attrs(), out_zp=0,
                     out_min=0 if lo >= 0 else INT32_MIN, out_max=INT32_MAX)
        elif t.dtype is not DType.BIN:
            out_min, out_max = t.clamp_codes(lo, hi)
            a.update(_rescale(bld, s_acc / t.scale, t.rounding, fqn).attrs(), out_zp=t.zp, out_min=out_min, out_max=out_max)
        return bld.op(op, fqn, ins, t.dtype, shape, a, out=fqn), shape

    bound = None
    if not binary and not transposed and wdtype is not DType.BIN:
        # every input code within its range of the zero point, every product at its largest
        bound = accumulator_bound(codes, w_zp, max(abs(x.qmin - x.zp), abs(x.qmax - x.zp)), bias, s_acc)
    return Pending("acc", fqn, shape, emit, scales=s_acc, binary_ok=True, bound=bound)


def wide(b: Builder, p: Pending, where: str, fraction_bits: int = 0) -> QVal:
    """A layer result kept as int32 at the power-of-two scale
    ``s_t = 2^(floor(log2 min_c s[c]) - fraction_bits)``: exact when the scales are powers of
    two, else within half an ``s_t`` step (``fraction_bits`` 0: half an accumulator LSB)."""
    if p.kind != "acc" or p.post:
        raise ExportError(where, f"reads the unquantized result of a {p.kind} in '{p.origin}'",
                          f"add `output = a8` (an activation quantizer) for '{p.origin}'")
    low = float(np.min(p.scales))
    s_t = math.ldexp(1.0, math.frexp(low)[1] - 1 - fraction_bits)  # a power of two <= low
    return p.materialize(b, Target(s_t, 0, INT32_MIN, INT32_MAX, DType.I32, Rounding.HALF_AWAY, where))


def _pool_fraction_bits(p: Pending) -> int:
    """Fraction bits below the accumulator LSB for a clamped layer result that a pool sums:
    as many (up to 16) as keep the sum over the whole spatial extent (the largest window)
    of ``[lo, hi]`` values within int32. A binary layer's accumulator unit ``α_x·α_w`` is
    often coarser than the consumer's grid; without them the rounding to ``s_t`` alone moved
    the pooled value by up to one consumer LSB.

    Each value's code also stays below 2^30 (a sum over one element, a 1×1 map, included):
    the factor ``s_acc/s_t`` is then >= 1, applied as ``sat32(acc · 2^left) · m / 2^31``
    with ``m`` in [2^30, 2^31), so an accumulator whose code is above ``m`` saturated to a
    code near ``m``, below the clamp: MobileNetV2 under mixed-precision pooled 4.80 for 4.91
    at features.18.0 (out_max 1.5·2^30, m = 1.2·2^30)."""
    bound = max(abs(p.lo), abs(p.hi))
    if not math.isfinite(bound):
        return 0
    n = max(1, math.prod(d for d in p.shape[2:] if d > 0))
    s_t = math.ldexp(1.0, math.frexp(float(np.min(p.scales)))[1] - 1)
    k = 0
    while k < 16 and (math.ceil(bound / s_t) + 1) * max(n, 2) << (k + 1) <= INT32_MAX:
        k += 1
    return k


def raw(b: Builder, p: Pending, where: str) -> tuple[QVal, np.ndarray | None]:
    """A layer result for a pool: its raw int32 accumulator and per-channel scales, so the
    pool's per-channel stage rounds once (exact up to that rounding); :func:`wide` (and
    ``None`` scales) when a clamp other than ReLU must be applied first."""
    if p.kind == "acc" and not p.post and p.hi == math.inf and p.lo in (-math.inf, 0.0):
        t = Target(1.0, 0, INT32_MIN, INT32_MAX, DType.I32, Rounding.HALF_AWAY, where, raw=True)
        return p.materialize(b, t), np.asarray(p.scales, dtype=np.float64)
    frac = _pool_fraction_bits(p) if p.kind == "acc" and not p.post else 0
    return wide(b, p, where, frac), None


def term_grid(terms) -> float:
    """The common power-of-two grid of a residual sum's terms (layer accumulators, 8-bit
    values, LayerNorm wide outputs): the largest power of two at or below the finest
    accumulator or 8-bit grid, so the sum is exact up to the requantization's rounding.  A
    LayerNorm's wide output (a far finer unit, about ``max|γ|·sqrt(N)/2^30``) is rounded onto
    it instead: its unit would push a layer accumulator out of int32."""
    scales = [s for v in terms if wide_scale(v) is None
              for s in (np.atleast_1d(v.scales) if isinstance(v, Pending) else [v.scale])]
    if not scales:  # wide outputs only: a grid >= 2x each unit, so each term (|acc| < 2^31) halves
        return math.ldexp(1.0, math.frexp(max(wide_scale(v) for v in terms))[1] + 1)
    return math.ldexp(1.0, math.frexp(float(min(scales)))[1] - 1)


def _is_pot(*scales) -> bool:
    return all(pot_shift(float(s)) is not None for s in scales)


def _settled(v, reuse):
    if reuse is not None and isinstance(v, Pending) and v.kind == "add" and not v.post:
        done = [q for (t, _, _), q in v.cache.items() if q.dtype in (DType.I8, DType.U8) and reuse(t)]
        if done:
            return done[0]
    return v


@attrs.define(eq=False)
class AddPending(Pending):
    """A residual add's result: its operands (quantized values or layer accumulators), so a
    LayerNorm reads the sum at a wide grid instead (lower_attn.layernorm_pending)."""

    args: tuple = ()


def add_pending(where: str, a, b_, shape, reuse=None) -> Pending:
    """A residual add of two quantized values and/or layer results (docs/qgraph.md ADD).

    An operand that is an earlier add's result, unquantized but already read by a quantizer
    ``reuse(target)`` accepts (a pre-norm block's ``x + attn(norm1(x))``, quantized only as
    ``norm2``'s input, then added again by the next residual), is read at that quantizer's
    grid: the graph has those codes, the fake-quant model adds the float sum (within half
    an LSB of that grid)."""
    operands = [_settled(v, reuse) for v in (a, b_)]
    for v in operands:
        if isinstance(v, QVal) and v.dtype in (DType.I8, DType.U8):
            continue
        if isinstance(v, Pending) and v.kind == "acc" and not v.post:
            continue
        if wide_scale(v) is not None:  # a LayerNorm's wide output (I32)
            continue
        origin = getattr(v, "origin", "?")
        raise ExportError(where, f"the residual add reads a value from '{origin}' that is neither quantized nor a "
                                 "layer's accumulator", f"add `output = a8` (an activation quantizer) for '{origin}'")

    def emit(bld: Builder, t: Target, lo: float, hi: float):
        if t.dtype not in (DType.I8, DType.U8):
            raise ExportError(where, f"the add result must be int8-quantized, not {t.dtype.name} ({t.where})")
        term_scales = [s for v in operands for s in ([wide_scale(v)] if wide_scale(v) is not None else
                                                      np.atleast_1d(v.scales) if isinstance(v, Pending) else [v.scale])]
        pot = _is_pot(t.scale, *term_scales)
        # exact common scale for powers of two; else as many fraction bits below the output
        # scale as the operands' worst cases leave room for in int32 (qdsl.export.add_grid),
        # so the final factor is an exact shift with the output's rounding
        s_t = term_grid(operands) if pot else math.ldexp(t.scale, -add_fraction_bits(operands, t.scale))
        names, zps, rescales = [], [], []
        for v in operands:
            if wide_scale(v) is not None:  # a LayerNorm's wide output: rounded onto s_t
                w = v.wide(bld)
                names.append(w.name)
                zps.append(0)
                rescales.append(_rescale(bld, w.scale / s_t, t.rounding, where, pot))
            elif isinstance(v, QVal):
                names.append(v.name)
                zps.append(v.zp)
                rescales.append(_rescale(bld, v.scale / s_t, t.rounding, where, pot))
            else:
                wide = Target(s_t, 0, INT32_MIN, INT32_MAX, DType.I32, Rounding.HALF_AWAY, where)
                names.append(v.materialize(bld, wide).name)
                zps.append(0)
                rescales.append(Rescale(RescaleKind.POT, [1], [0]))
        out_min, out_max = t.clamp_codes(lo, hi)
        attrs_ = dict(in_zp=tuple(zps), in_kind=tuple(int(r.kind) for r in rescales),
                      in_multiplier=tuple(r.multiplier[0] for r in rescales), in_shift=tuple(r.shift[0] for r in rescales),
                      in_rounding=tuple(int(r.rounding) for r in rescales), pre_shift=0,
                      **_rescale(bld, s_t / t.scale, t.rounding, where).attrs(), out_zp=t.zp, out_min=out_min, out_max=out_max)
        return bld.op(OpType.ADD, where, names, t.dtype, shape, attrs_, out=f"{where}:add"), shape

    return AddPending("add", where, shape, emit, args=tuple(operands))


def pool_pending(fqn: str, m: nn.Module, v: QVal, shape, scales: np.ndarray | None = None) -> Pending:
    """AvgPool1d/2d or AdaptiveAvgPool (global) on a quantized value (or, with per-channel
    ``scales``, on a raw accumulator from :func:`raw`)."""
    if v.dtype not in (DType.I8, DType.U8, DType.I32, DType.BIN):  # BIN: ±1 codes at zero point 0
        raise ExportError(fqn, f"average pooling of {v.dtype.name} activations has no integer lowering")
    spatial = v.shape[2:]
    if isinstance(m, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d)):
        if any(d != 1 for d in shape[2:]):
            raise ExportError(fqn, f"adaptive average pooling to {tuple(shape[2:])} is not supported (only 1)",
                              "use AdaptiveAvgPool(1) or a fixed AvgPool")
        op, area, a = OpType.GLOBAL_AVGPOOL, math.prod(spatial), {}
    else:
        rank = len(spatial)
        tup = lambda x: tuple(x) if isinstance(x, (tuple, list)) else (x,) * rank  # noqa: E731
        kernel, pad = tup(m.kernel_size), tup(m.padding)
        if m.ceil_mode or getattr(m, "divisor_override", None) or (not m.count_include_pad and any(pad)):
            raise ExportError(fqn, "avg pool with ceil_mode, divisor_override or count_include_pad=False has no "
                                   "integer lowering", "use count_include_pad=True (the default)")
        op = OpType.AVGPOOL1D if rank == 1 else OpType.AVGPOOL2D
        area = math.prod(kernel)
        a = dict(kernel=kernel, stride=tup(m.stride if m.stride is not None else m.kernel_size), padding=pad)

    def emit(bld: Builder, t: Target, lo: float, hi: float):
        if t.dtype not in (DType.I8, DType.U8):
            raise ExportError(fqn, f"the pooled value must be int8-quantized, not {t.dtype.name} ({t.where})")
        out_min, out_max = t.clamp_codes(lo, hi)
        # the divisor is folded into the factor: exact shifts when area and scales are powers of two
        s_in = v.scale if scales is None else scales
        attrs_ = dict(a, in_zp=v.zp, **_rescale(bld, s_in / (area * t.scale), t.rounding, fqn).attrs(),
                      out_zp=t.zp, out_min=out_min, out_max=out_max)
        return bld.op(op, fqn, [v.name], t.dtype, shape, attrs_, out=fqn), shape

    return Pending("pool", fqn, shape, emit)


def concat_value(b: Builder, where: str, values: list, dim: int, shape):
    """``torch.cat`` along any non-batch axis: a CONCAT now if every operand is quantized on one
    grid, else pending.  A pending operand (a layer's result nothing quantized, e.g. flattened
    before the cat) is materialized at the concat's own output grid when that is known:
    quantization is elementwise, so quantizing the concatenation is quantizing each part."""
    for v in values:
        if isinstance(v, QVal) and v.dtype in (DType.I8, DType.U8):
            continue
        if isinstance(v, Pending):
            continue
        raise ExportError(where, f"torch.cat reads an unquantized value from '{getattr(v, 'origin', '?')}'",
                          "quantize every concatenated tensor (an output quantizer on its producer)")
    axis = dim % len(shape)
    if axis == 0:
        raise ExportError(where, "concatenation along the batch dimension has no lowering",
                          "concatenate along a feature axis (dim >= 1, or a negative dim other than -rank)")

    def attrs_for(qs: list, t: Target, lo=-math.inf, hi=math.inf) -> dict:
        rs = [_rescale(b, v.scale / t.scale, t.rounding, where) for v in qs]
        out_min, out_max = t.clamp_codes(lo, hi)
        return dict(axis=axis, in_zp=tuple(v.zp for v in qs), in_kind=tuple(int(r.kind) for r in rs),
                    in_multiplier=tuple(r.multiplier[0] for r in rs), in_shift=tuple(r.shift[0] for r in rs),
                    in_rounding=tuple(int(r.rounding) for r in rs), out_zp=t.zp, out_min=out_min, out_max=out_max)

    first = values[0]
    if all(isinstance(v, QVal) for v in values) and all(
            (v.scale, v.zp, v.qmin, v.qmax, v.dtype) == (first.scale, first.zp, first.qmin, first.qmax, first.dtype)
            for v in values):
        t = Target(first.scale, first.zp, first.qmin, first.qmax, first.dtype, Rounding.HALF_EVEN, where)
        name = b.op(OpType.CONCAT, where, [v.name for v in values], t.dtype, shape, attrs_for(values, t),
                    out=f"{where}:cat")
        return b.q(name, t.scale, t.zp, t.qmin, t.qmax, t.dtype, shape)

    def emit(bld: Builder, t: Target, lo: float, hi: float):
        if t.dtype not in (DType.I8, DType.U8):
            raise ExportError(where, f"the concatenated value must be int8-quantized, not {t.dtype.name} ({t.where})")
        # a pending part lands on the output grid itself (its CONCAT rescale is the identity)
        qs = [v.clamped(lo, hi).materialize(bld, t) if isinstance(v, Pending) else v for v in values]
        return bld.op(OpType.CONCAT, where, [v.name for v in qs], t.dtype, shape, attrs_for(qs, t, lo, hi),
                      out=f"{where}:cat"), shape

    def binarize(bld: Builder, t: Target, lo: float = -math.inf, hi: float = math.inf) -> QVal:
        # a binary quantizer reading the concatenation (xnor-binary's U-Net: a binary conv
        # after the skip cat) is the sign of each part: BINARIZE an int8 part at its zero
        # point, a layer result takes its BIN output (the sign of its accumulator), and the
        # signs are concatenated (CONCAT with a BIN output: identity rescales); learned
        # thresholds: each part at its own channels' slice (qdsl/export/lower_threshold.py)
        parts = []
        if t.thresholds is not None and (axis % len(shape) != 1 or len(t.thresholds) != shape[1]):
            raise ExportError(t.where, f"a learned threshold reads a concatenation along axis {axis}, not the "
                                       "channels", "concatenate along axis 1, or quantize the result to int8 first")
        off = 0
        for v in values:
            if t.thresholds is not None:
                c = v.shape[1]
                tp = attrs.evolve(t, thresholds=t.thresholds[off:off + c])
                off += c
                v = v.clamped(lo, hi).materialize(bld, tp) if isinstance(v, Pending) else \
                    binarize_codes(bld, v, tp, lo, hi)
                parts.append(v)
                continue
            if isinstance(v, Pending):
                v = v.materialize(bld, t)
            elif v.dtype is not DType.BIN:
                name = bld.op(OpType.BINARIZE, t.where, [v.name], DType.BIN, v.shape, {"zero_point": v.zp})
                v = bld.q(name, t.scale, 0, -1, 1, DType.BIN, v.shape)
            parts.append(v)
        one = Rescale(RescaleKind.POT, [1], [0])
        n = len(parts)
        a = dict(axis=axis, in_zp=(0,) * n, in_kind=(int(one.kind),) * n, in_multiplier=(1,) * n, in_shift=(0,) * n,
                 in_rounding=(int(one.rounding),) * n, out_zp=0, out_min=-1, out_max=1)
        name = bld.op(OpType.CONCAT, where, [v.name for v in parts], DType.BIN, shape, a, out=f"{where}:cat_sign")
        return bld.q(name, t.scale, 0, -1, 1, DType.BIN, shape)

    return Pending("concat", where, shape, emit, binarize=binarize)

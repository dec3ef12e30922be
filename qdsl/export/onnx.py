"""ONNX QDQ export: ``export_onnx(model, example_input, path)`` (optional extra ``qdsl[onnx]``).

The model is lowered exactly as :func:`qdsl.export.export` does, then every integer op is
written the way ONNX expresses quantization: float ops between QuantizeLinear /
DequantizeLinear pairs (opset 13, per-channel weights via ``axis=0``; ConvTranspose ``axis=1``). Each graph tensor
becomes a float ONNX tensor holding its real value ``(q - zp) · scale``:

* weights: ``DequantizeLinear(int8 weights, per-channel scale, zero point)`` (int4/int2 and
  ternary codes are stored widened to int8 - ONNX QDQ has no packed types here);
* FP8 weights (``fp8_e4m3`` / ``fp8_e5m2`` per tensor or channel): ``DequantizeLinear(FLOAT8E4M3FN /
  FLOAT8E5M2 weights, scale, float8 zero point)``, opset 19 (qdsl/export/float8.py); with block
  scales (MXFP8) the same with ``block_size``, opset 21; other
  minifloat and block-scaled weights (FP6, FP4, MXFP4, NVFP4) have no ONNX type onnxruntime runs
  (FLOAT4E2M1 / E8M0 block scales are opset 23+, not implemented by its CPU kernels): they are
  written as int8 when each output channel's values are exactly int8 codes times one scale
  (qdsl/export/exact_weights.py, the same values), else the export refuses naming the layer;
* bias: ``DequantizeLinear(int32 bias, s_in · s_w)``;
* each requantized output: ``Clip`` (fused ReLU / narrow range) then
  ``QuantizeLinear -> DequantizeLinear`` at the output quantizer's scale and zero point;
* wide int32 intermediates (residual operands, pooled or final layer results that the
  fake-quant model keeps in float) stay float.

Attention: MATMUL is MatMulInteger on the operands' codes and QuantizeLinear at
``1 / factor``; SOFTMAX(_MASKED) is float Softmax between the QDQ pairs, masks added as
0/-inf (:func:`_matmul`, :func:`_softmax`); LAYERNORM is float LayerNormalization (opset 17,
the model's opset when the graph has one) of the real residual sum (:func:`_layernorm`); LUT
(GELU, SiLU, ...) is a Gather of the table's real values by the input codes, exact
(:func:`_lut`).  LUT_CHANNEL has no ONNX form.

Binary (XNOR) layers, and learned binarisation thresholds (BINARIZE_CHANNEL), have no QDQ
form and raise :class:`ExportError`. onnxruntime runs the
result in float, like the fake-quant model, at its basic optimization level;
tests/export/test_onnx.py states and checks the agreement tolerance. At its full level
onnxruntime fuses QDQ into integer kernels whose u8·s8 form saturates at int16 on CPUs
without VNNI (AVX2 only): a model bound for such a CPU wants 7-bit weights
(``weight = (bits=7)``), or the qdsl runtime, which is exact on every CPU.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, RescaleKind, Rounding
from qdsl.export.float8 import F8_PLACEHOLDER, F8Scale, Float8Grid
from qdsl.export.values import ExportError

__all__ = ["export_onnx", "graph_to_onnx", "OPSET", "LN_OPSET", "FLOAT8_OPSET", "BLOCK_OPSET"]

OPSET = 13
LN_OPSET = 17
"""The opset of a graph with LAYERNORM (ONNX LayerNormalization); QDQ's ops are unchanged from 13 to 17."""
FLOAT8_OPSET = 19
"""The opset of a model with FP8 weights (DequantizeLinear of FLOAT8E4M3FN / FLOAT8E5M2)."""
BLOCK_OPSET = 21
"""The opset of a model with block-scaled FP8 weights (DequantizeLinear's ``block_size``)."""


def _onnx():
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        from qdsl.spec.diagnostics import QdslError

        raise QdslError("ONNX export needs the onnx package: pip install 'qdsl[onnx]'") from exc
    return onnx, TensorProto, helper, numpy_helper


class _Writer:
    def __init__(self, graph: IntegerGraph, info: dict):
        self.onnx, self.TP, self.h, self.nh = _onnx()
        self.graph, self.info = graph, info
        self.nodes: list = []
        self.inits: list = []
        self.count = 0
        self.float8 = 0
        """The opset float8 weights need (19; 21 with block scales), 0 without any."""
        self.dyn: dict[str, tuple[str, str]] = {}
        """QUANTIZE_DYNAMIC codes tensor -> its DynamicQuantizeLinear scale and zero point."""

    def name(self, base: str) -> str:
        self.count += 1
        return f"{base}__{self.count}"

    def const(self, base: str, value: np.ndarray) -> str:
        n = self.name(base)
        self.inits.append(self.nh.from_array(np.asarray(value), n))
        return n

    def node(self, op: str, inputs: list[str], base: str, **attrs) -> str:
        out = self.name(base)
        self.nodes.append(self.h.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def grid(self, tensor: str):
        if tensor not in self.info:
            raise ExportError(tensor, "no quantization grid recorded for this tensor (internal)")
        return self.info[tensor]

    def qdq(self, x: str, tensor: str, out_min: int | None = None, out_max: int | None = None) -> str:
        """Clip to ``[out_min, out_max]`` (codes), then QuantizeLinear/DequantizeLinear on ``tensor``'s grid."""
        t = self.graph.tensor(tensor)
        scale, zp = self.grid(tensor)
        if isinstance(scale, F8Scale):
            return self.qdq_float8(x, tensor, scale, out_min, out_max)
        if t.dtype is DType.I32:  # wide: the fake-quant model holds it in float; only a ReLU clip
            if out_min is not None and out_min == 0:
                return self.node("Relu", [x], tensor)
            return x
        if t.dtype not in (DType.I8, DType.U8):
            raise ExportError(tensor, f"{t.dtype.name} activations have no ONNX QDQ form", "use an 8-bit config")
        lo, hi = t.dtype.range
        if out_min is not None and (out_min > lo or out_max < hi):
            x = self.node("Clip", [x, self.const("lo", np.float32((out_min - zp) * scale)),
                                   self.const("hi", np.float32((out_max - zp) * scale))], tensor + "_clip")
        s = self.const(tensor + "_scale", np.float32(scale))
        z = self.const(tensor + "_zp", np.array(zp, dtype=t.dtype.numpy))
        q = self.node("QuantizeLinear", [x, s, z], tensor + "_q")
        return self.node("DequantizeLinear", [q, s, z], tensor)

    def qdq_float8(self, x: str, tensor: str, scale: "F8Scale", out_min: int | None, out_max: int | None) -> str:
        """An FP8 activation: ``QuantizeLinear -> DequantizeLinear`` with a float8 zero point
        (opset 19: ``x / s`` cast to float8, round to nearest even, saturating).  A fused
        ReLU is a Relu before it; another clamp has only placeholder codes here: refused."""
        if out_min is not None and out_min > -F8_PLACEHOLDER:
            if out_min != 0 or out_max < F8_PLACEHOLDER:
                raise ExportError(tensor, "a clamp other than ReLU before an FP8 activation has no ONNX form in qdsl",
                                  "use an int8 quantizer after it, or plain ReLU")
            x = self.node("Relu", [x], tensor + "_relu")
        tp = getattr(self.TP, scale.onnx_type)
        s = self.const(tensor + "_scale", np.float32(scale))
        z = self.name(tensor + "_zp")
        self.inits.append(self.h.make_tensor(z, tp, [], bytes(1), raw=True))
        self.float8 = max(self.float8, FLOAT8_OPSET)
        q = self.node("QuantizeLinear", [x, s, z], tensor + "_q")
        return self.node("DequantizeLinear", [q, s, z], tensor)

    def weight(self, name: str, axis: int = 0) -> str:
        """``axis``: the output channels' (1 for ConvTranspose, whose per-output-channel
        grid repeats per group: the first group's ``out/groups`` entries are the axis's)."""
        t = self.graph.tensor(name)
        grid = self.grid(name)
        scale, zp = grid
        if axis and np.size(scale) > 1:
            scale, zp = np.asarray(scale)[: t.shape[axis]], np.asarray(zp)[: t.shape[axis]]
        if isinstance(grid, Float8Grid):
            return self.float8_weight(name, t, scale, grid, axis)
        signed = t.dtype not in (DType.U8, DType.U4, DType.U2)
        dtype = np.int8 if signed else np.uint8
        q = self.const(name, t.data.astype(dtype))
        s = self.const(name + "_scale", np.asarray(scale, dtype=np.float32))
        z = self.const(name + "_zp", np.asarray(zp).astype(dtype))
        return self.node("DequantizeLinear", [q, s, z], name + "_dq", axis=axis)

    def float8_weight(self, name: str, t, scale, grid, axis: int) -> str:
        """``DequantizeLinear(float8 weight, scale, float8 zero point 0, axis)`` (opset 19):
        the graph tensor holds the float8 bit patterns (qdsl/export/float8.py).  Block scales
        (opset 21): the weight as ``[C, K]`` rows, blocks of ``block_size`` along axis 1,
        then reshaped back (a conv's blocks run along its flattened ``in × k..`` row)."""
        tp = getattr(self.TP, grid.onnx_type)
        bits = np.asarray(t.data).astype(np.uint8)
        if grid.blocks is not None:
            bits, scale = bits.reshape(bits.shape[0], -1), grid.blocks
        init = self.name(name)  # unique: a layer lowered for two consumers writes its weight twice
        self.inits.append(self.h.make_tensor(init, tp, list(bits.shape), bits.tobytes(), raw=True))
        scale = np.asarray(scale, dtype=np.float32)
        s = self.const(name + "_scale", scale)
        z = self.name(name + "_zp")
        self.inits.append(self.h.make_tensor(z, tp, list(scale.shape), bytes(scale.size), raw=True))
        self.float8 = max(self.float8, FLOAT8_OPSET)
        if grid.blocks is None:
            return self.node("DequantizeLinear", [init, s, z], name + "_dq", axis=axis)
        self.float8 = BLOCK_OPSET
        y = self.node("DequantizeLinear", [init, s, z], name + "_dq", axis=1, block_size=grid.block_size)
        if len(t.shape) == 2:
            return y
        return self.node("Reshape", [y, self.const(name + "_shape", np.array(t.shape, dtype=np.int64))],
                         name + "_rows")

    def bias(self, name: str) -> str:
        scale, _ = self.grid(name)
        t = self.graph.tensor(name)
        q = self.const(name, t.data.astype(np.int32))
        s = self.const(name + "_scale", np.asarray(scale, dtype=np.float32))
        z = self.const(name + "_zp", np.zeros(t.shape, dtype=np.int32))
        return self.node("DequantizeLinear", [q, s, z], name + "_dq", axis=0)


def _stage(a: dict) -> tuple[int | None, int | None]:
    return a.get("out_min"), a.get("out_max")


# ops the writer lowers on the real values between QDQ pairs: the only ones that may read or
# write an FP8 activation (the others compute on integer codes: tables, attention, LayerNorm)
_FLOAT8_OK = frozenset(OpType[n] for n in (
    "QUANTIZE", "DEQUANTIZE", "REQUANTIZE", "CONV1D", "CONV2D", "LINEAR", "CONV_TRANSPOSE1D", "CONV_TRANSPOSE2D",
    "ADD", "MUL", "CONCAT", "CLAMP", "MAXPOOL1D", "MAXPOOL2D", "AVGPOOL1D", "AVGPOOL2D", "GLOBAL_AVGPOOL", "RESHAPE",
    "RESIZE"))


def _float8_reader(w: _Writer, op: Op) -> None:
    names = [n for n in list(op.inputs) + list(op.outputs) if not w.graph.tensor(n).is_constant]
    f8 = [n for n in names if isinstance(w.info.get(n, (None,))[0], F8Scale)]
    if f8 and op.type not in _FLOAT8_OK:
        raise ExportError(op.name, f"{op.type.name} reads or writes an FP8 activation ('{f8[0]}'), and qdsl lowers it "
                                   "to ONNX on integer codes", "quantize that value with an int8 quantizer")


def _op(w: _Writer, op: Op, env: dict[str, str]) -> str:
    t, a = op.type, op.attrs
    out = op.outputs[0]
    xs = [env.get(n, n) for n in op.inputs]
    _float8_reader(w, op)
    if t is OpType.BINARIZE_CHANNEL:
        raise ExportError(op.name, "a learned binarisation threshold (threshold = learned: BINARIZE_CHANNEL) has no "
                                   "ONNX QDQ form", "run the .qgraph, or export an 8-bit config to ONNX")
    if any(w.graph.tensor(o).dtype is DType.BIN for o in op.outputs):  # before its inputs' grids (a sign threshold has none)
        raise ExportError(out, "BIN activations have no ONNX QDQ form", "use an 8-bit config")
    if t in (OpType.BINARIZE, OpType.BCONV1D, OpType.BCONV2D, OpType.BLINEAR):
        raise ExportError(op.name, "binary (XNOR) layers have no ONNX QDQ form", "export 8-bit configs to ONNX")
    if t is OpType.LUT:
        return _lut(w, op, xs[0])
    if t is OpType.LUT_CHANNEL:
        raise ExportError(op.name, "a per-channel lookup table (LUT_CHANNEL: PReLU with one slope per channel) has no "
                                   "ONNX QDQ form in qdsl",
                          "export models without it to ONNX, or run the .qgraph")
    if t is OpType.QUANTIZE:
        return w.qdq(xs[0], out, a["qmin"], a["qmax"])
    if t is OpType.DEQUANTIZE:
        return w.node("Identity", [xs[0]], out)
    if t in (OpType.CONV1D, OpType.CONV2D, OpType.LINEAR):
        ins = [xs[0], w.weight(op.inputs[1])] + ([w.bias(op.inputs[2])] if len(op.inputs) == 3 else [])
        if t is OpType.LINEAR and len(w.graph.tensor(op.inputs[0]).shape) > 2:
            # N×…×K features last: Gemm takes 2-D inputs only; MatMul broadcasts over the leading dims
            y = w.node("MatMul", [ins[0], w.node("Transpose", [ins[1]], out + "_wt", perm=[1, 0])], out + "_mm")
            if len(ins) == 3:
                y = w.node("Add", [y, ins[2]], out + "_bias")
        elif t is OpType.LINEAR:
            y = w.node("Gemm", ins, out + "_mm", transB=1)
        else:
            pads = list(a["padding"]) * 2
            y = w.node("Conv", ins, out + "_conv", strides=list(a["stride"]), pads=pads,
                       dilations=list(a["dilation"]), group=a["groups"])
        return w.qdq(y, out, *_stage(a))
    if t in (OpType.CONV_TRANSPOSE1D, OpType.CONV_TRANSPOSE2D):
        ins = [xs[0], w.weight(op.inputs[1], axis=1)] + ([w.bias(op.inputs[2])] if len(op.inputs) == 3 else [])
        y = w.node("ConvTranspose", ins, out + "_convt", strides=list(a["stride"]), pads=list(a["padding"]) * 2,
                   dilations=list(a["dilation"]), group=a["groups"], output_padding=list(a["output_padding"]))
        return w.qdq(y, out, *_stage(a))
    if t is OpType.ADD:
        return w.qdq(w.node("Add", xs, out + "_add"), out, *_stage(a))
    if t is OpType.MUL:  # ONNX Mul broadcasts as numpy does, as MUL does
        return w.qdq(w.node("Mul", xs, out + "_mul"), out, *_stage(a))
    if t is OpType.CONCAT:
        return w.qdq(w.node("Concat", xs, out + "_cat", axis=a["axis"]), out, *_stage(a))
    if t is OpType.REQUANTIZE:
        return w.qdq(xs[0], out, *_stage(a))
    if t is OpType.CLAMP:
        scale, zp = w.grid(out)
        if isinstance(scale, F8Scale):  # ReLU of FP8 values stays on their grid; other clamps: placeholder codes
            if (a["out_min"], a["out_max"]) != (0, F8_PLACEHOLDER):
                raise ExportError(op.name, "a clamp other than ReLU of an FP8 activation has no ONNX form in qdsl",
                                  "use an int8 quantizer there, or plain ReLU")
            return w.node("Relu", [xs[0]], out)
        return w.node("Clip", [xs[0], w.const("lo", np.float32((a["out_min"] - zp) * scale)),
                               w.const("hi", np.float32((a["out_max"] - zp) * scale))], out)
    if t in (OpType.MAXPOOL1D, OpType.MAXPOOL2D):
        return w.node("MaxPool", xs, out, kernel_shape=list(a["kernel"]), strides=list(a["stride"]),
                      pads=list(a["padding"]) * 2, dilations=list(a["dilation"]))
    if t in (OpType.AVGPOOL1D, OpType.AVGPOOL2D):
        y = w.node("AveragePool", xs, out + "_pool", kernel_shape=list(a["kernel"]), strides=list(a["stride"]),
                   pads=list(a["padding"]) * 2, count_include_pad=1)
        return w.qdq(y, out, *_stage(a))
    if t is OpType.GLOBAL_AVGPOOL:
        return w.qdq(w.node("GlobalAveragePool", xs, out + "_pool"), out, *_stage(a))
    if t is OpType.RESIZE:
        return w.qdq(_resize(w, xs[0], op), out, *_stage(a))
    if t is OpType.EMBEDDING:  # the dequantized table (per-row grid: axis 0), gathered by the int32 ids
        return w.qdq(w.node("Gather", [w.weight(op.inputs[1]), xs[0]], out + "_gather", axis=0), out, *_stage(a))
    if t is OpType.RESHAPE:
        shape = w.const("shape", np.array([0, *a["shape"]], dtype=np.int64))
        return w.node("Reshape", [xs[0], shape], out)
    if t is OpType.MATMUL:
        return _matmul(w, op, xs)
    if t in (OpType.SOFTMAX, OpType.SOFTMAX_MASKED):
        return _softmax(w, op, xs)
    if t is OpType.LAYERNORM:
        return _layernorm(w, op, xs)
    if t is OpType.QUANTIZE_DYNAMIC:
        return _quantize_dynamic(w, op, xs[0])
    if t is OpType.LINEAR_DYNAMIC:
        return _linear_dynamic(w, op, xs[0])
    raise ExportError(op.name, f"{t.name} has no ONNX lowering")  # an op added without an ONNX form: refused here


def _quantize_dynamic(w: _Writer, op: Op, x: str) -> str:
    """DynamicQuantizeLinear: uint8, per tensor, affine, half-even rounding.  It divides by
    the scale where the graph multiplies by f32(1/scale), so a code can differ by 1 where
    the quotient lies that close to a rounding boundary."""
    a = op.attrs
    if (a["qmin"], a["qmax"], a["symmetric"], a["per_row"], a["rounding"]) != (0, 255, 0, 0, int(Rounding.HALF_EVEN)):
        raise ExportError(op.name, "only a per-tensor asymmetric uint8 [0, 255] half-even dynamic quantizer has an "
                                   "ONNX form (DynamicQuantizeLinear)",
                          "use `int(bits=8, unsigned, asymmetric, per_tensor, dynamic)`, or run the .qgraph")
    codes = w.name(op.outputs[0])
    scale, zp = w.name(op.outputs[0] + "_scale"), w.name(op.outputs[0] + "_zp")
    w.nodes.append(w.h.make_node("DynamicQuantizeLinear", [x], [codes, scale, zp], name=codes))
    w.dyn[op.outputs[0]] = (scale, zp)
    return codes


def _linear_dynamic(w: _Writer, op: Op, codes: str) -> str:
    """MatMulInteger (uint8 codes x int8 weights, the codes' zero point) -> int32, then
    ``f32(acc) * (s_x * s_w[o]) + bias[o]`` (and Relu), the order LINEAR_DYNAMIC uses."""
    from qdsl.graph.ops.dynamic import bits_f32

    a, out = op.attrs, op.outputs[0]
    scale, zp = w.dyn[op.inputs[0]]
    wt = w.graph.tensor(op.inputs[2])
    # K×O weights as uint8 w + 128 with zero point 128: the same integers, but onnxruntime's
    # CPU u8×s8 kernel saturates int16 pair sums (vpmaddubsw) on machines without VNNI,
    # while its u8×u8 kernel is exact (measured: errors up to 22891 in a 32-deep sum vs 0)
    b = w.const(op.inputs[2], np.ascontiguousarray((wt.data.astype(np.int64) + 128).astype(np.uint8).T))
    acc = w.node("MatMulInteger", [codes, b, zp, w.const(out + "_wzp", np.array(128, np.uint8))], out + "_acc")
    m = w.node("Mul", [scale, w.const(out + "_wscale", bits_f32(a["w_scale"]))], out + "_m")
    y = w.node("Mul", [w.node("Cast", [acc], out + "_accf", to=w.TP.FLOAT), m], out + "_y")
    if a["bias"]:
        y = w.node("Add", [y, w.const(out + "_bias", bits_f32(a["bias"]))], out + "_bias")
    return w.node("Relu", [y], out) if a["relu"] else y


def _factor(kind: int, m: int, sh: int) -> float:
    """The real factor of one rescale: ``2^-shift`` (POT) or ``m · 2^(-31-shift)``."""
    return 2.0**-sh if kind == int(RescaleKind.POT) else m * 2.0 ** (-31 - sh)


def _real_factor(a: dict) -> float:
    """The real factor of an op's (per-tensor) output rescale."""
    return _factor(a["rq_kind"], a["rq_multiplier"][0], a["rq_shift"][0])


def _lut(w: _Writer, op: Op, x: str) -> str:
    """LUT as Gather: the input's codes (re-quantized from its dequantized value, exact) shifted
    to ``0..255`` index the table's real values ``(table - out_zp) · s_out``, so the result is
    the graph's codes exactly (no float function of ONNX has to match the table)."""
    a, out = op.attrs, op.outputs[0]
    xt = w.graph.tensor(op.inputs[0])
    s_in, zp_in = w.grid(op.inputs[0])
    s_out, zp_out = w.grid(out)
    q = w.node("QuantizeLinear", [x, w.const(out + "_s_in", np.float32(s_in)),
                                  w.const(out + "_zp_in", np.array(zp_in, dtype=xt.dtype.numpy))], out + "_codes")
    idx = w.node("Add", [w.node("Cast", [q], out + "_i32", to=w.TP.INT32),
                         w.const(out + "_off", np.int32(-xt.dtype.range[0]))], out + "_idx")
    table = ((np.asarray(a["table"], dtype=np.float64) - zp_out) * s_out).astype(np.float32)
    return w.node("Gather", [w.const(out + "_table", table), idx], out, axis=0)


def _layernorm(w: _Writer, op: Op, xs: list[str]) -> str:
    """LAYERNORM as float LayerNormalization (opset 17) of the real residual sum, between the
    inputs' DequantizeLinear and the output's QuantizeLinear (the fake-quant model's form; the
    graph's integer square root and quotient differ by rounding: a code can differ by 1 LSB,
    tests/export/test_onnx_layernorm.py measures how often).  The sum's terms are the inputs'
    real values (a constant input, the position embeddings, dequantized at its grid); the
    affine weight and bias are the graph's own ``gamma``/``beta`` at the accumulator unit ``u``
    (``u`` = the output rescale's factor times the output scale: an I32 wide output is the
    accumulator itself at ``u`` and stays float, as every wide intermediate does); ``ε`` is
    the graph's ``eps`` brought back from the sum's grid ``s_t`` (``eps = N³·ε / s_t²``)."""
    a, out = op.attrs, op.outputs[0]
    n = w.graph.tensor(op.inputs[0]).shape[-1]
    terms = []
    for i, (name, x) in enumerate(zip(op.inputs, xs)):
        t = w.graph.tensor(name)
        if t.is_constant:
            scale, zp = w.grid(name)
            x = w.const(name, ((t.data.astype(np.float64) - zp) * scale).astype(np.float32))
        terms.append(x)
    s_t = w.grid(op.inputs[0])[0] / _factor(a["in_kind"][0], a["in_multiplier"][0], a["in_shift"][0])
    total = terms[0] if len(terms) == 1 else w.node("Add", terms, out + "_sum")
    u = _real_factor(a) * w.grid(out)[0]
    gamma = np.asarray(a["gamma"], dtype=np.float64) * u * 2.0**16 / np.sqrt(n)
    beta = np.asarray(a["beta"], dtype=np.float64) * u
    eps = float(a["eps"]) * s_t * s_t / float(n) ** 3
    y = w.node("LayerNormalization", [total, w.const(out + "_gamma", gamma.astype(np.float32)),
                                      w.const(out + "_beta", beta.astype(np.float32))],
               out + "_ln", axis=-1, epsilon=eps)
    return w.qdq(y, out, *_stage(a))


def _matmul(w: _Writer, op: Op, xs: list[str]) -> str:
    """MATMUL as MatMulInteger: each operand's codes (re-quantized from its dequantized value,
    exact) as uint8 (an int8 operand shifted by 128 with its zero point: the same integers,
    and onnxruntime's u8·u8 kernel is exact where its u8·s8 one saturates without VNNI), the
    permutations as Transposes, then QuantizeLinear of the int32 product at scale
    ``1 / factor`` onto the output grid (half even, a float division: codes can differ from
    the graph's fixed-point rescale by 1 where the product lies that close to a rounding boundary)."""
    a, out = op.attrs, op.outputs[0]
    codes, zps = [], []
    for i, (name, x) in enumerate(zip(op.inputs, xs)):
        scale, _ = w.grid(name)
        zp = a["in_zp"][i] + (128 if w.graph.tensor(name).dtype is DType.I8 else 0)
        z = w.const(f"{out}_zp{i}", np.array(zp, dtype=np.uint8))
        q = w.node("QuantizeLinear", [x, w.const(f"{out}_s{i}", np.float32(scale)), z], f"{out}_u8_{i}")
        perm = list(a["a_perm" if i == 0 else "b_perm"])
        codes.append(q if perm == sorted(perm) else w.node("Transpose", [q], f"{out}_t{i}", perm=perm))
        zps.append(z)
    acc = w.node("MatMulInteger", [codes[0], codes[1], zps[0], zps[1]], out + "_acc")
    acc = w.node("Cast", [acc], out + "_accf", to=w.TP.FLOAT)
    if list(a["out_perm"]) != sorted(a["out_perm"]):
        acc = w.node("Transpose", [acc], out + "_tout", perm=list(a["out_perm"]))
    t = w.graph.tensor(out)
    scale, zp = w.grid(out)
    z = w.const(out + "_zp", np.array(a["out_zp"], dtype=t.dtype.numpy))
    q = w.node("QuantizeLinear", [acc, w.const(out + "_inv", np.float32(1.0 / _real_factor(a))), z], out + "_q")
    y = w.node("DequantizeLinear", [q, w.const(out + "_scale", np.float32(scale)), z], out + "_dq")
    lo, hi = t.dtype.range
    if a["out_min"] > lo or a["out_max"] < hi:  # a fused ReLU: clip the real value (exact on the grid)
        y = w.node("Clip", [y, w.const("lo", np.float32((a["out_min"] - zp) * scale)),
                            w.const("hi", np.float32((a["out_max"] - zp) * scale))], out)
    return y


def _softmax(w: _Writer, op: Op, xs: list[str]) -> str:
    """SOFTMAX(_MASKED) as float Softmax of the dequantized scores between DequantizeLinear and
    QuantizeLinear (the fake-quant model's form, not the graph's exp table: a code can differ
    by 1 LSB, see tests/export/test_onnx_attention.py).  A mask becomes an additive 0/-inf
    tensor reshaped onto the scores' axes; a fully masked row (Softmax: NaN) gets 0, as the
    graph gives it."""
    a, out = op.attrs, op.outputs[0]
    x = xs[0]
    xt = w.graph.tensor(op.inputs[0])
    rank = len(xt.shape)
    masked = None
    for j, (name, m) in enumerate(zip(op.inputs[1:], xs[1:])):
        mt = w.graph.tensor(name)
        dims = a["mask_dims"][j * rank:(j + 1) * rank]
        if mt.is_constant:
            m = w.const(name, mt.data.astype(np.int32))
        zero = np.array(0, dtype=np.float32 if mt.dtype is DType.F32 else np.int32)
        if mt.dtype not in (DType.F32, DType.I32):
            m = w.node("Cast", [m], f"{out}_m{j}", to=w.TP.INT32)
        keep = w.node("Equal", [m, w.const(f"{out}_zero{j}", zero)], f"{out}_eq{j}")  # zero attends
        if a["mask_attend"][j]:
            keep = w.node("Not", [keep], f"{out}_keep{j}")
        # the mask viewed on the scores' axes: its dims where they index one, 1 where it broadcasts
        view = [1] * rank
        for k in range(len(mt.shape)):
            axes = [ax for ax, d in enumerate(dims) if d == k]
            if mt.shape[k] != 1:
                for ax in axes:
                    view[ax] = xt.shape[ax]
        keep = w.node("Reshape", [keep, w.const(f"{out}_view{j}", np.array(view, dtype=np.int64))], f"{out}_v{j}")
        masked = keep if masked is None else w.node("And", [masked, keep], f"{out}_and{j}")
    if masked is not None:
        add = w.node("Where", [masked, w.const(out + "_0", np.float32(0.0)),
                               w.const(out + "_ninf", np.float32(-np.inf))], out + "_add")
        x = w.node("Add", [x, add], out + "_masked")
    y = w.node("Softmax", [x], out + "_softmax", axis=-1)
    if masked is not None:
        y = w.node("Where", [w.node("IsNaN", [y], out + "_nan"), w.const(out + "_z", np.float32(0.0)), y],
                   out + "_finite")
    return w.qdq(y, out, *_stage(a))


def _resize(w: _Writer, x: str, op: Op) -> str:
    """RESIZE's taps as Gather / Mul / Add on the real values (docs/qgraph.md §4.4): the graph's
    own indices and 2^-F weights, so no coordinate rule of ONNX Resize has to match torch's."""
    a = op.attrs
    in_shape = w.graph.tensor(op.inputs[0]).shape
    rank, one, start = len(in_shape) - 2, float(1 << a["frac_bits"]), 0
    for d, n_out in enumerate(a["size"]):
        axis, n_in = 2 + d, in_shape[2 + d]
        i0 = np.asarray(a["index"][start:start + n_out], dtype=np.int64)
        w1 = np.asarray(a["weight"][start:start + n_out], dtype=np.float64) / one
        start += n_out
        g0 = w.node("Gather", [x, w.const("i0", i0)], op.outputs[0] + "_g0", axis=axis)
        if not w1.any():  # nearest: the first tap only
            x = g0
            continue
        g1 = w.node("Gather", [x, w.const("i1", np.minimum(i0 + 1, n_in - 1))], op.outputs[0] + "_g1", axis=axis)
        bshape = (n_out,) + (1,) * (rank - 1 - d)  # broadcast over the later spatial axes
        w0c = w.const("w0", (1.0 - w1).astype(np.float32).reshape(bshape))
        w1c = w.const("w1", w1.astype(np.float32).reshape(bshape))
        x = w.node("Add", [w.node("Mul", [g0, w0c], op.outputs[0] + "_m0"),
                           w.node("Mul", [g1, w1c], op.outputs[0] + "_m1")], op.outputs[0] + "_lerp")
    return x


def graph_to_onnx(graph: IntegerGraph, info: dict) -> Any:
    """An ``onnx.ModelProto`` for ``graph`` given the grids ``info`` from ``export(..., with_info=True)``."""
    w = _Writer(graph, info)
    env: dict[str, str] = {}
    for op in graph.ops:
        env[op.outputs[0]] = _op(w, op, env)
    h, tp = w.h, w.TP

    def vi(name: str, onnx_name: str):
        t = graph.tensor(name)
        dims = ["N"] + list(t.shape[1:]) if t.shape[0] == -1 else list(t.shape)
        return h.make_tensor_value_info(onnx_name, tp.INT32 if t.dtype is DType.I32 else tp.FLOAT, dims)

    outputs = []
    for name in graph.outputs:  # named as in the integer graph: output, output1, ... or a returned dict's keys
        final = name
        w.nodes.append(h.make_node("Identity", [env[name]], [final], name=final))
        outputs.append(vi(name, final))
    g = h.make_graph(w.nodes, graph.name, [vi(n, n) for n in graph.inputs], outputs, w.inits)
    # LayerNormalization needs opset 17; graphs without it keep the QDQ baseline opset 13
    opset = LN_OPSET if any(op.type is OpType.LAYERNORM for op in graph.ops) else OPSET
    if w.float8:  # DequantizeLinear takes float8 types from opset 19, block_size from 21
        opset = max(opset, w.float8)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", opset)], producer_name="qdsl")
    # readable by onnxruntime releases of the last years (opset 21 needs IR version 10)
    model.ir_version = min(model.ir_version, 10 if opset >= BLOCK_OPSET else 9)
    w.onnx.checker.check_model(model)
    return model


def export_onnx(model: Any, example_input: Any, path: str | os.PathLike | None = None) -> Any:
    """Export the frozen patched ``model`` as a QDQ ONNX model (saved to ``path`` if given).

    Same preconditions and errors as :func:`qdsl.export.export`; binary layers and
    activations wider than 8 bits are rejected. Returns the ``onnx.ModelProto``.
    """
    from qdsl.export.lower import export

    graph, info = export(model, example_input, with_info=True, onnx_float8=True)
    proto = graph_to_onnx(graph, info)
    if path is not None:
        w = _onnx()[0]
        w.save(proto, os.fspath(path))
    return proto

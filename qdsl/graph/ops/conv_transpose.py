"""CONV_TRANSPOSE1D, CONV_TRANSPOSE2D: integer transposed convolution (PyTorch's
``ConvTranspose1d/2d``).  Input, constant weight ``Cin×Cout/g×k..`` (PyTorch's layout),
optional int32 bias -> an accumulator of ``acc_bits`` (wrapping or saturating), then the
same output stage as CONV* (per output channel), or for a BIN output its sign.

Every input position scatters into the output: input position ``i`` and tap ``k`` add
``(x[ic, i] - in_zp) · (w[ic, oc mod og, k] - w_zp[oc])`` to output position
``o = i·stride - padding + k·dilation`` (dropped when ``o`` falls outside ``[0, L_out)``),
with ``L_out = (L - 1)·stride - 2·padding + dilation·(k - 1) + output_padding + 1``.
Only real input positions contribute: there is no padding value, so no zero point is
read outside the input.  A BIN input (±1, ``in_zp`` 0) is a binary transposed conv: with ±1
weights the sums are exact XNOR sums (there is no popcount form; the exporter stores the
±1 weight codes as I8).
"""

from __future__ import annotations

import numpy as np

from qdsl.graph.checks import check_acc, check_out
from qdsl.graph.ops import OpDef
from qdsl.graph.ops.weighted import _finish_acc, _output
from qdsl.graph.schema import INT8_DTYPES, WEIGHT_DTYPES, AttrType, DType, OpSchema

__all__ = ["OPS", "conv_transpose", "transposed_len"]

_ATTRS = {
    "stride": AttrType.INTS, "padding": AttrType.INTS, "output_padding": AttrType.INTS,
    "dilation": AttrType.INTS, "groups": AttrType.INT, "in_zp": AttrType.INT, "w_zp": AttrType.INTS,
    "acc_bits": AttrType.INT, "overflow": AttrType.INT,
}


def transposed_len(n: int, k: int, stride: int, pad: int, out_pad: int, dilation: int) -> int:
    """PyTorch's ConvTranspose output length."""
    return (n - 1) * stride - 2 * pad + dilation * (k - 1) + out_pad + 1


# ---------------------------------------------------------------- reference semantics
def _acc(x: np.ndarray, w: np.ndarray, w_zp: np.ndarray, a) -> np.ndarray:
    """Exact int64 ``Σ (x - in_zp)(w - w_zp)`` per output (scatter form, one tap at a time)."""
    rank = w.ndim - 2
    g = a["groups"]
    n, cin = x.shape[:2]
    cg, og = cin // g, w.shape[1]
    cout = og * g
    stride, pad, opad, dil = a["stride"], a["padding"], a["output_padding"], a["dilation"]
    ins = x.shape[2:]
    kern = w.shape[2:]
    outs = tuple(transposed_len(ins[i], kern[i], stride[i], pad[i], opad[i], dil[i]) for i in range(rank))
    # the full (uncropped) result: input position i, tap k land at i·s + k·d; the output is
    # positions [pad, pad + L_out) of it (output_padding may reach past its end: zeros there)
    full = tuple(max((ins[i] - 1) * stride[i] + dil[i] * (kern[i] - 1) + 1, pad[i] + outs[i]) for i in range(rank))
    acc = np.zeros((n, cout) + full, dtype=np.int64)
    xz = x.astype(np.int64) - int(a["in_zp"])
    zp = np.broadcast_to(np.asarray(w_zp, dtype=np.int64), (cout,))
    for gi in range(g):
        xg = xz[:, gi * cg:(gi + 1) * cg]  # n, cg, L..
        # w - w_zp[oc] for this group's output channels: cg, og, k..
        wg = w[gi * cg:(gi + 1) * cg].astype(np.int64) - zp[gi * og:(gi + 1) * og].reshape((1, og) + (1,) * rank)
        for tap in np.ndindex(*kern):
            contrib = np.einsum("nc...,co->no...", xg, wg[(slice(None), slice(None)) + tap])  # n, og, L..
            sl = tuple(slice(tap[i] * dil[i], tap[i] * dil[i] + (ins[i] - 1) * stride[i] + 1, stride[i])
                       for i in range(rank))
            acc[(slice(None), slice(gi * og, (gi + 1) * og)) + sl] += contrib
    crop = tuple(slice(pad[i], pad[i] + outs[i]) for i in range(rank))
    return acc[(slice(None), slice(None)) + crop]


def conv_transpose(x: np.ndarray, w, bias, a, out, counts, name) -> np.ndarray:
    acc = _acc(x, w.data, np.asarray(a["w_zp"], dtype=np.int64), a)
    return _output(_finish_acc(acc, bias, a, counts, name), a, out)


def _run(op, args, graph, counts):
    bias = args[2].data.astype(np.int64) if len(args) == 3 else None
    return conv_transpose(args[0], args[1], bias, op.attrs, graph.tensor(op.outputs[0]), counts, op.name)


# ---------------------------------------------------------------- validation
def _inferrer(rank: int):
    def infer(c, op, ins, out):
        x, w = ins[0], ins[1]
        c.dt(x, INT8_DTYPES + (DType.BIN,), "input")
        c.const(w, "weight")
        c.dt(w, WEIGHT_DTYPES, "weight")
        c.need(w.dtype is not DType.BIN, f"weight {w.name!r}: BIN weights are not supported (hold ±1 codes as I8)")
        c.need(len(x.shape) == rank + 2, f"input {x.name!r} must have rank {rank + 2}, has shape {x.shape}")
        c.need(len(w.shape) == rank + 2, f"weight {w.name!r} must have rank {rank + 2}, has shape {w.shape}")
        g = c.int("groups", 1, 1 << 20)
        cin = x.shape[1]
        c.need(w.shape[0] == cin, f"weight {w.name!r} has {w.shape[0]} input channels (dim 0), input has {cin}")
        c.need(cin % g == 0, f"groups={g} must divide input channels {cin}")
        cout = w.shape[1] * g
        if len(ins) == 3:
            c.const(ins[2], "bias")
            c.dt(ins[2], (DType.I32,), "bias")
            c.need(ins[2].shape == (cout,), f"bias {ins[2].name!r} must have shape ({cout},), has {ins[2].shape}")
        check_acc(c)
        c.int("in_zp", *((0, 0) if x.dtype is DType.BIN else x.dtype.range))  # ±1 values at zero point 0
        c.ints("w_zp", (1, cout), *w.dtype.range)
        stride = c.ints("stride", rank, 1, 1 << 20)
        pad = c.ints("padding", rank, 0, 1 << 20)
        dil = c.ints("dilation", rank, 1, 1 << 20)
        opad = c.ints("output_padding", rank, 0, 1 << 20)
        shape = [x.shape[0] if x.shape else 1, cout]
        for i in range(rank):
            # PyTorch's rule: output_padding < max(stride, dilation)
            c.need(opad[i] < max(stride[i], dil[i]),
                   f"output_padding {opad[i]} must be smaller than stride {stride[i]} or dilation {dil[i]}")
            n = transposed_len(x.shape[2 + i], w.shape[2 + i], stride[i], pad[i], opad[i], dil[i])
            c.need(n >= 1, f"spatial dim {i}: padding {pad[i]} leaves no output (length {n})")
            shape.append(n)
        if out.dtype is not DType.BIN:  # BIN: the sign of the accumulator, as CONV*
            c.dt(out, INT8_DTYPES + (DType.I32,), "output")
            check_out(c, out.dtype, cout)
        return (DType.I8, DType.U8, DType.I32, DType.BIN), tuple(shape)

    return infer


OPS = (
    OpDef("CONV_TRANSPOSE1D", 22, OpSchema(2, 3, _ATTRS, needs_output_stage=True), _inferrer(1), _run,
          "Integer transposed conv over ``N×C×L`` (weight ``C×O/g×k``; input I8/U8/BIN); output stage as CONV1D."),
    OpDef("CONV_TRANSPOSE2D", 23, OpSchema(2, 3, _ATTRS, needs_output_stage=True), _inferrer(2), _run,
          "Integer transposed conv over ``N×C×H×W`` (weight ``C×O/g×kh×kw``; input I8/U8/BIN); output stage as CONV2D."),
)

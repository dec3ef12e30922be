"""The pools: MAXPOOL1D/2D, AVGPOOL1D/2D, GLOBAL_AVGPOOL."""

from __future__ import annotations

import numpy as np

from qdsl.graph.checks import check_out, spatial
from qdsl.graph.ops import OpDef
from qdsl.graph.ops.weighted import windows
from qdsl.graph.requant import apply_rescale
from qdsl.graph.schema import INT8_DTYPES, OUT_ATTRS, RQ_ATTRS, AttrType, DType, OpSchema, OutputStage

__all__ = ["OPS", "maxpool", "avgpool", "global_avgpool"]

_POOL = {"kernel": AttrType.INTS, "stride": AttrType.INTS, "padding": AttrType.INTS}
_STAGE = {"in_zp": AttrType.INT, **RQ_ATTRS, **OUT_ATTRS}


def maxpool(x: np.ndarray, a) -> np.ndarray:
    rank = x.ndim - 2
    # padding ≤ kernel/2 guarantees every window holds a real element, so a pad value
    # below every dtype minimum never wins.
    win = windows(x, a["kernel"], a["stride"], a["padding"], a["dilation"], -(1 << 40))
    return win.max(axis=tuple(range(2 + rank, 2 + 2 * rank)))


def avgpool(x: np.ndarray, a) -> np.ndarray:
    rank = x.ndim - 2
    # padded taps hold the zero point (contribute 0) and count in the divisor, which is
    # folded into the rescale factor: s_in / (s_out * prod(kernel)).
    win = windows(x - a["in_zp"], a["kernel"], a["stride"], a["padding"], (1,) * rank, 0)
    total = win.sum(axis=tuple(range(2 + rank, 2 + 2 * rank)))
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(total, st.rescale) + st.zero_point, st.qmin, st.qmax)


def global_avgpool(x: np.ndarray, a) -> np.ndarray:
    total = (x - a["in_zp"]).sum(axis=tuple(range(2, x.ndim)), keepdims=True)
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(total, st.rescale) + st.zero_point, st.qmin, st.qmax)


def _inferrer(rank: int, average: bool):
    def infer(c, op, ins, out):
        x = ins[0]
        # a max of ±1 values is a BIN value again (+1 iff any tap is +1); an average of them
        # (held one ±1 per element, zero point 0) is rescaled to an 8-bit output like any other
        extra = (DType.I32, DType.BIN) if average else (DType.BIN,)
        c.dt(x, INT8_DTYPES + extra, "input")
        c.need(len(x.shape) == rank + 2, f"input {x.name!r} must have rank {rank + 2}, has shape {x.shape}")
        kernel = c.ints("kernel", rank, 1, 1 << 20)
        shape = x.shape[:2] + spatial(c, x, rank, kernel, True)
        if average:
            c.int("in_zp", *x.dtype.range)
            c.dt(out, INT8_DTYPES, "output")
            check_out(c, out.dtype, x.shape[1])
            return INT8_DTYPES, shape
        return (x.dtype,), shape

    return infer


def _infer_global(c, op, ins, out):
    x = ins[0]
    c.dt(x, INT8_DTYPES + (DType.I32, DType.BIN), "input")
    c.need(len(x.shape) >= 3, f"input {x.name!r} must have spatial dims, has shape {x.shape}")
    c.int("in_zp", *x.dtype.range)
    c.dt(out, INT8_DTYPES, "output")
    check_out(c, out.dtype, x.shape[1])
    return INT8_DTYPES, x.shape[:2] + (1,) * (len(x.shape) - 2)


def _run(fn):
    return lambda op, args, graph, counts: fn(args[0], op.attrs)


_MAX = OpSchema(1, 1, {**_POOL, "dilation": AttrType.INTS})
_AVG = OpSchema(1, 1, {**_POOL, **_STAGE})
OPS = (
    OpDef("MAXPOOL1D", 13, _MAX, _inferrer(1, False), _run(maxpool), "Max over windows; padding never wins."),
    OpDef("MAXPOOL2D", 14, _MAX, _inferrer(2, False), _run(maxpool), "Max over 2-D windows."),
    OpDef("AVGPOOL1D", 15, _AVG, _inferrer(1, True), _run(avgpool),
          "Sum of ``x - in_zp`` over the window, rescaled (divisor folded into the rescale)."),
    OpDef("AVGPOOL2D", 16, _AVG, _inferrer(2, True), _run(avgpool), "2-D average pool, same rule."),
    OpDef("GLOBAL_AVGPOOL", 17, OpSchema(1, 1, _STAGE), _infer_global, _run(global_avgpool),
          "Sum of ``x - in_zp`` over all spatial positions, rescaled; keeps size-1 spatial dims."),
)

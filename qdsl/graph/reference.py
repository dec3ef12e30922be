"""The reference executor: the executable definition of integer-graph semantics.

One function per op, numpy int64 arithmetic throughout (QUANTIZE and DEQUANTIZE are the
only float steps, at the graph boundary, in IEEE binary32 as documented). Short and
obviously correct rather than fast; the C++ runtime must equal it bit for bit.

Shared rules (docs/qgraph.md gives the formulas op by op):

* accumulators are computed exactly (int64), the bias is added, and the exact sum is then
  wrapped (two's complement) or saturated to ``acc_bits``; an element whose exact sum does
  not fit ``acc_bits`` counts as one overflow for that op (``ExecResult.overflow``); an
  accumulator wider than 32 bits is rescaled without saturating it to int32 first
  (``requant.apply_rescale_wide``);
* padding of conv and average pool uses the input zero point (it contributes 0), max pool
  padding never wins, binary conv padding contributes 0 (taps outside are skipped);
* output stage: ``clamp(rescale(acc) + out_zp, out_min, out_max)`` (requant.py);
  a BIN output instead takes ``-1 if acc < 0 else +1``;
* BIN activations are represented here as int8 arrays of ±1.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Rescale, Rounding, Tensor
from qdsl.graph.requant import apply_rescale, apply_rescale_wide, sat, wrap
from qdsl.spec.diagnostics import NonFiniteError, QdslError

__all__ = ["GraphInputError", "ExecResult", "execute", "run_reference", "require_finite", "as_array"]


class GraphInputError(QdslError):
    """The array given to a graph does not match its declared input (dtype, shape, range)."""


@attrs.frozen
class ExecResult:
    """Graph outputs (in ``graph.outputs`` order), overflow counts per op name, and all values."""

    outputs: tuple[np.ndarray, ...]
    overflow: dict[str, int]
    values: dict[str, np.ndarray] = attrs.field(repr=False)


# ---------------------------------------------------------------- boundary (float) ops
def _round_f(v: np.ndarray, mode: int) -> np.ndarray:
    """Round float64 values (holding exact f32 quotients) to integers, per :class:`Rounding`."""
    if mode == Rounding.HALF_EVEN:
        return np.rint(v)
    if mode == Rounding.HALF_AWAY:
        return np.sign(v) * np.floor(np.abs(v) + 0.5)
    if mode == Rounding.HALF_UP:
        return np.floor(v + 0.5)
    return np.floor(v)


def quantize(x: np.ndarray, a, out: Tensor) -> np.ndarray:
    # v = x * (1/scale), both steps in binary32 (torch's fake-quant kernels multiply by the
    # f32 reciprocal; qdsl.quantizers.functional does the same), widened exactly to f64
    inv = np.float32(1.0) / np.float32(a["scale"])
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to ±inf then clamps: the documented policy
        v = (x.astype(np.float32) * inv).astype(np.float64)
    r = _round_f(v, a["rounding"]) + a["zero_point"]
    r = np.where(np.isnan(r), a["zero_point"], r)  # NaN maps to the zero point
    return np.clip(r, a["qmin"], a["qmax"]).astype(np.int64)


def dequantize(q: np.ndarray, a) -> np.ndarray:
    return (q - a["zero_point"]).astype(np.float32) * np.float32(a["scale"])


def binarize(x: np.ndarray, a) -> np.ndarray:
    return np.where(x < a["zero_point"], -1, 1).astype(np.int64)


# ---------------------------------------------------------------- accumulating ops
def _windows(x: np.ndarray, kernel, stride, padding, dilation, pad_value) -> np.ndarray:
    """``N×C×L_1..×K_1..``: every window of ``x`` (rank-2 spatial or rank-1)."""
    pads = [(0, 0), (0, 0)] + [(p, p) for p in padding]
    xp = np.pad(x, pads, constant_values=pad_value)
    rank = len(kernel)
    win = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    v = np.lib.stride_tricks.sliding_window_view(xp, win, axis=tuple(range(2, 2 + rank)))
    sl = (slice(None), slice(None)) + tuple(slice(None, None, s) for s in stride)
    sl += tuple(slice(None, None, d) for d in dilation)
    return v[sl]


def _conv_acc(x: np.ndarray, w: np.ndarray, groups: int, a, pad_value: int) -> np.ndarray:
    """Exact ``sum x·w`` per output (x, w already zero-point-subtracted, int64)."""
    rank = w.ndim - 2
    win = _windows(x, w.shape[2:], a["stride"], a["padding"], a["dilation"], pad_value)
    n, cin = x.shape[:2]
    cout = w.shape[0]
    cg, og = cin // groups, cout // groups
    out_sp = win.shape[2:2 + rank]
    outs = []
    for g in range(groups):
        xg = win[:, g * cg:(g + 1) * cg]  # N, cg, L.., K..
        xg = np.moveaxis(xg, 1, 1 + rank)  # N, L.., cg, K..
        cols = xg.reshape(n * int(np.prod(out_sp)), -1)
        wg = w[g * og:(g + 1) * og].reshape(og, -1)
        outs.append((cols @ wg.T).reshape((n,) + tuple(out_sp) + (og,)))
    acc = np.concatenate(outs, axis=-1)
    return np.moveaxis(acc, -1, 1)


def _finish_acc(acc: np.ndarray, bias: np.ndarray | None, a, counts: dict, name: str) -> np.ndarray:
    if bias is not None:
        acc = acc + bias.reshape((1, -1) + (1,) * (acc.ndim - 2))
    bits = a["acc_bits"]
    if bits < 64:  # a 64-bit accumulator holds the exact (int64) sum
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        counts[name] = counts.get(name, 0) + int(((acc < lo) | (acc > hi)).sum())
    return sat(acc, bits) if a["overflow"] == 1 else wrap(acc, bits)


def _output(acc: np.ndarray, a, out: Tensor) -> np.ndarray:
    if out.dtype is DType.BIN:
        return np.where(acc < 0, -1, 1).astype(np.int64)
    stage = OutputStage.from_attrs(a)
    rescale = apply_rescale_wide if a.get("acc_bits", 32) > 32 else apply_rescale
    y = rescale(acc, stage.rescale, axis=1) + stage.zero_point
    return np.clip(y, stage.qmin, stage.qmax)


def _wzp(w: Tensor, a) -> np.ndarray:
    zp = np.asarray(a["w_zp"], dtype=np.int64)
    return w.data.astype(np.int64) - zp.reshape((-1,) + (1,) * (w.data.ndim - 1))


def conv(x: np.ndarray, w: Tensor, bias, a, out: Tensor, counts, name) -> np.ndarray:
    acc = _conv_acc(x - a["in_zp"], _wzp(w, a), a["groups"], a, pad_value=0)
    return _output(_finish_acc(acc, bias, a, counts, name), a, out)


def linear(x: np.ndarray, w: Tensor, bias, a, out: Tensor, counts, name) -> np.ndarray:
    acc = (x - a["in_zp"]) @ _wzp(w, a).T
    return _output(_finish_acc(acc, bias, a, counts, name), a, out)


def bconv(x: np.ndarray, w: Tensor, bias, a, out: Tensor, counts, name) -> np.ndarray:
    # XNOR-popcount: bit 1 means -1. For each output, over the taps that fall inside the
    # input (padding taps are skipped): acc = K_valid - 2 * popcount(a_bits XOR w_bits).
    abits = (x == -1).astype(np.int64)
    wbits = (w.data == -1).astype(np.int64)
    valid = np.ones_like(abits)
    groups = a.get("groups", 1)
    if w.data.ndim == 2:  # BLINEAR: no padding, every tap valid
        mism = abits @ (1 - wbits).T + (1 - abits) @ wbits.T
        k_valid = np.full(mism.shape, wbits.shape[1], dtype=np.int64)
    else:
        # popcount(a XOR w) over valid taps = sum valid*a*(1-w) + valid*(1-a)*w
        mism = _conv_acc(abits, 1 - wbits, groups, a, 0) + _conv_acc(valid - abits, wbits, groups, a, 0)
        k_valid = _conv_acc(valid, np.ones_like(wbits), groups, a, 0)
    acc = k_valid - 2 * mism
    return _output(_finish_acc(acc, bias, a, counts, name), a, out)


# ---------------------------------------------------------------- elementwise / pooling
def requantize(x: np.ndarray, a) -> np.ndarray:
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(x - a["in_zp"], st.rescale, axis=1) + st.zero_point, st.qmin, st.qmax)


def _in_rescale(a, i: int) -> Rescale:
    return Rescale(a["in_kind"][i], (a["in_multiplier"][i],), (a["in_shift"][i],), a["in_rounding"][i])


def add(xs: Sequence[np.ndarray], a) -> np.ndarray:
    terms = [apply_rescale((x - a["in_zp"][i]) << a["pre_shift"], _in_rescale(a, i)) for i, x in enumerate(xs)]
    total = sat(terms[0] + terms[1])
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(total, st.rescale) + st.zero_point, st.qmin, st.qmax)


def concat(xs: Sequence[np.ndarray], a) -> np.ndarray:
    parts = [
        np.clip(apply_rescale(x - a["in_zp"][i], _in_rescale(a, i)) + a["out_zp"], a["out_min"], a["out_max"])
        for i, x in enumerate(xs)
    ]
    return np.concatenate(parts, axis=a["axis"])


def clamp(x: np.ndarray, a) -> np.ndarray:
    return np.clip(x, a["out_min"], a["out_max"])


def lut(x: np.ndarray, a, x_dtype: DType) -> np.ndarray:
    # the table has one entry per code of the 8-bit input, lowest code first (int64 values,
    # like every other op's, so consumers never compute in a narrow container)
    table = np.asarray(a["table"], dtype=np.int64)
    return table[x.astype(np.int64) - x_dtype.range[0]]


def maxpool(x: np.ndarray, a) -> np.ndarray:
    rank = x.ndim - 2
    # padding ≤ kernel/2 guarantees every window holds a real element, so a pad value
    # below every dtype minimum never wins.
    win = _windows(x, a["kernel"], a["stride"], a["padding"], a["dilation"], -(1 << 40))
    return win.max(axis=tuple(range(2 + rank, 2 + 2 * rank)))


def avgpool(x: np.ndarray, a) -> np.ndarray:
    rank = x.ndim - 2
    # padded taps hold the zero point (contribute 0) and count in the divisor, which is
    # folded into the rescale factor: s_in / (s_out * prod(kernel)).
    win = _windows(x - a["in_zp"], a["kernel"], a["stride"], a["padding"], (1,) * rank, 0)
    total = win.sum(axis=tuple(range(2 + rank, 2 + 2 * rank)))
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(total, st.rescale) + st.zero_point, st.qmin, st.qmax)


def global_avgpool(x: np.ndarray, a) -> np.ndarray:
    total = (x - a["in_zp"]).sum(axis=tuple(range(2, x.ndim)), keepdims=True)
    st = OutputStage.from_attrs(a)
    return np.clip(apply_rescale(total, st.rescale) + st.zero_point, st.qmin, st.qmax)


# ---------------------------------------------------------------- the interpreter
def _check_input(t: Tensor, x: np.ndarray, check_finite: bool = False) -> np.ndarray:
    x = as_array(x)
    want = t.shape[1:]
    if x.ndim != len(t.shape) or tuple(x.shape[1:]) != want or (t.shape[0] != -1 and x.shape[0] != t.shape[0]):
        raise GraphInputError(f"input {t.name!r} expects shape {t.shape} (-1 = any batch), got {tuple(x.shape)}")
    if t.dtype is DType.F32:
        if not np.issubdtype(x.dtype, np.floating):
            raise GraphInputError(f"input {t.name!r} expects float32 values, got {x.dtype}")
        x = x.astype(np.float32)
        if check_finite:
            require_finite(x, t.name)
        return x
    if not np.issubdtype(x.dtype, np.integer):
        raise GraphInputError(f"input {t.name!r} expects {t.dtype.name} integers, got {x.dtype}")
    lo, hi = t.dtype.range
    if x.size and (x.min() < lo or x.max() > hi):
        raise GraphInputError(f"input {t.name!r} values must be in [{lo}, {hi}] ({t.dtype.name})")
    return x.astype(np.int64)


def _run_op(op: Op, graph: IntegerGraph, env: dict, counts: dict) -> np.ndarray:
    t, a = op.type, op.attrs
    out = graph.tensor(op.outputs[0])
    args = [env[n] if n in env else graph.tensor(n) for n in op.inputs]
    x = args[0]
    if t is OpType.QUANTIZE:
        return quantize(x, a, out)
    if t is OpType.DEQUANTIZE:
        return dequantize(x, a)
    if t is OpType.BINARIZE:
        return binarize(x, a)
    if t is OpType.REQUANTIZE:
        return requantize(x, a)
    if t in (OpType.CONV1D, OpType.CONV2D, OpType.LINEAR, OpType.BCONV1D, OpType.BCONV2D, OpType.BLINEAR):
        bias = args[2].data.astype(np.int64) if len(args) == 3 else None
        fn = {OpType.LINEAR: linear, OpType.CONV1D: conv, OpType.CONV2D: conv}.get(t, bconv)
        return fn(x, args[1], bias, a, out, counts, op.name)
    if t is OpType.ADD:
        return add(args, a)
    if t is OpType.CONCAT:
        return concat(args, a)
    if t is OpType.CLAMP:
        return clamp(x, a)
    if t is OpType.LUT:
        return lut(x, a, graph.tensor(op.inputs[0]).dtype)
    if t in (OpType.MAXPOOL1D, OpType.MAXPOOL2D):
        return maxpool(x, a)
    if t in (OpType.AVGPOOL1D, OpType.AVGPOOL2D):
        return avgpool(x, a)
    if t is OpType.GLOBAL_AVGPOOL:
        return global_avgpool(x, a)
    if t is OpType.RESHAPE:
        return x.reshape((x.shape[0],) + tuple(a["shape"]))
    raise AssertionError(f"unhandled op {t!r}")  # OpType is closed and validated


def as_array(x) -> np.ndarray:
    """A graph input as a numpy array: torch tensors are detached and moved to the CPU,
    float16/bfloat16 ones upcast to float32 first (exact; numpy has no bfloat16)."""
    if hasattr(x, "detach"):  # a torch tensor (duck-typed: this module never imports torch)
        x = x.detach()
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        x = x.cpu().numpy()
    return np.asarray(x)


def require_finite(x: np.ndarray, name: str) -> None:
    """Raise :class:`NonFiniteError` if the float input ``x`` holds a NaN or an infinity
    (``check_finite=True``; without it the QUANTIZE policy above applies)."""
    bad = ~np.isfinite(x)
    if bad.any():
        raise NonFiniteError(f"input {name!r}: {int(bad.sum())} non-finite value(s) (NaN or inf) "
                             f"in an array of shape {tuple(x.shape)}")


def execute(graph: IntegerGraph, inputs: Sequence[np.ndarray] | np.ndarray, keep_values: bool = False,
            check_finite: bool = False) -> ExecResult:
    """Run ``graph`` on ``inputs`` (one array per graph input) with integer semantics.

    Integer outputs come back as their container dtype (int8/uint8; BIN as int8 ±1),
    float outputs as float32.  A batch of 0 gives empty outputs of the declared shapes.
    ``check_finite``: a NaN or infinity in a float input raises :class:`NonFiniteError`
    instead of being quantized by the policy (NaN -> zero point, ±inf -> qmax/qmin).
    """
    if isinstance(inputs, np.ndarray) or not isinstance(inputs, (list, tuple)):
        inputs = [inputs]
    if len(inputs) != len(graph.inputs):
        raise GraphInputError(f"graph takes {len(graph.inputs)} input(s), got {len(inputs)}")
    env: dict[str, np.ndarray] = {}
    for name, x in zip(graph.inputs, inputs):
        env[name] = _check_input(graph.tensor(name), x, check_finite)
    if len({x.shape[0] for x in env.values()}) > 1:
        raise GraphInputError("all graph inputs must have the same batch size")
    counts: dict[str, int] = {}
    empty = next(iter(env.values())).shape[0] == 0 if env else False
    for op in graph.ops:
        if op.type in (OpType.CONV1D, OpType.CONV2D, OpType.LINEAR, OpType.BCONV1D, OpType.BCONV2D, OpType.BLINEAR):
            counts.setdefault(op.name, 0)
        if empty:  # every value is an empty batch of its declared shape; nothing overflows
            t = graph.tensor(op.outputs[0])
            env[op.outputs[0]] = np.empty((0,) + tuple(t.shape[1:]), dtype=np.int64)
            continue
        env[op.outputs[0]] = _run_op(op, graph, env, counts)
    outs = tuple(env[n].astype(graph.tensor(n).dtype.numpy) for n in graph.outputs)
    return ExecResult(outs, counts, env if keep_values else {})


def run_reference(graph: IntegerGraph, x, check_finite: bool = False) -> np.ndarray | tuple[np.ndarray, ...]:
    """Outputs only: one array for a single-output graph, else a tuple."""
    res = execute(graph, x, check_finite=check_finite)
    return res.outputs[0] if len(res.outputs) == 1 else res.outputs

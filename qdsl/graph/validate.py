"""Structural validation of an :class:`IntegerGraph` (run on construction by export and on load).

Guarantees, when :func:`validate_graph` returns: tensor names are unique; constants have
data of the declared shape whose values fit their dtype; every op has a known type, the
right arity, exactly the attributes its schema lists with the right types and in-range
values; every input of an op is a constant, a graph input or the output of an *earlier*
op (topological order); every activation is produced exactly once; and every declared
output shape equals the shape inferred from the op's inputs and attributes. Every
failure is a :class:`GraphFormatError` naming the op (index and name) or tensor.
"""

from __future__ import annotations

import math
import numpy as np

from qdsl.graph.ir import (
    ACTIVATION_DTYPES,
    INT8_DTYPES,
    OP_SCHEMAS,
    OUT_ATTRS,
    RQ_ATTRS,
    WEIGHT_DTYPES,
    AttrType,
    DType,
    GraphFormatError,
    IntegerGraph,
    Op,
    OpType,
    OverflowMode,
    RescaleKind,
    Rounding,
    Tensor,
)

__all__ = ["validate_graph", "infer_output", "conv_out_len"]

_I32 = (-(2**31), 2**31 - 1)
# the per-input rescale lists (``in_kind``, ...) carry the same fields as one ``rq_`` rescale
_RESCALE_KEYS = tuple(name[len("rq_"):] for name in RQ_ATTRS)


def conv_out_len(n: int, k: int, stride: int, pad: int, dilation: int = 1) -> int:
    """PyTorch's output length (floor mode): ``(n + 2p - d(k-1) - 1) // s + 1``."""
    return (n + 2 * pad - dilation * (k - 1) - 1) // stride + 1


class _Check:
    """Error helper bound to one op."""

    def __init__(self, index: int, op: Op):
        self.where = f"op {index} ({op.type.name} {op.name!r})"
        self.op = op

    def fail(self, msg: str, hint: str | None = None) -> None:
        raise GraphFormatError(msg, self.where, hint)

    def need(self, cond: bool, msg: str) -> None:
        if not cond:
            self.fail(msg)

    def ints(self, name: str, n: int | tuple[int, ...] | None = None, lo: int | None = None, hi: int | None = None):
        v = self.op.attrs[name]
        if n is not None:
            ns = (n,) if isinstance(n, int) else n
            self.need(len(v) in ns, f"attribute {name!r} must have length {' or '.join(map(str, ns))}, got {len(v)}")
        for x in v:
            self.need((lo is None or x >= lo) and (hi is None or x <= hi), f"attribute {name!r} value {x} out of range [{lo}, {hi}]")
        return v

    def int(self, name: str, lo: int | None = None, hi: int | None = None) -> int:
        x = self.op.attrs[name]
        self.need((lo is None or x >= lo) and (hi is None or x <= hi), f"attribute {name!r} = {x} out of range [{lo}, {hi}]")
        return x


def _check_attr_types(c: _Check, op: Op, out_dtype: DType) -> None:
    schema = OP_SCHEMAS[op.type]
    wanted = dict(schema.attrs)
    if schema.needs_output_stage and out_dtype is not DType.BIN:
        wanted.update(RQ_ATTRS)
        wanted.update(OUT_ATTRS)
    got = set(op.attrs)
    missing = sorted(set(wanted) - got)
    extra = sorted(got - set(wanted))
    if missing:
        c.fail(f"missing attribute(s) {', '.join(missing)}")
    if extra:
        c.fail(f"unexpected attribute(s) {', '.join(extra)}", f"{op.type.name} takes: {', '.join(sorted(wanted))}")
    for name, kind in wanted.items():
        v = op.attrs[name]
        ok = {
            AttrType.INT: isinstance(v, int) and not isinstance(v, bool),
            AttrType.FLOAT: isinstance(v, float),
            AttrType.INTS: isinstance(v, tuple) and all(isinstance(x, int) for x in v),
        }[kind]
        c.need(ok, f"attribute {name!r} must be {kind.name}, got {type(v).__name__}")


def _check_rescale(c: _Check, prefix: str, channels: int, per_input: bool = False) -> None:
    """One rescale (``rq_*``) or, with ``per_input``, one per input (``in_*`` lists)."""
    a = c.op.attrs
    if per_input:
        kinds, rounds = a[f"{prefix}kind"], a[f"{prefix}rounding"]
        n = channels
        for key in _RESCALE_KEYS:
            c.ints(f"{prefix}{key}", n)
        triples = zip(kinds, a[f"{prefix}multiplier"], a[f"{prefix}shift"], rounds)
    else:
        kind = c.int(f"{prefix}kind", min(RescaleKind), max(RescaleKind))
        mult = c.ints(f"{prefix}multiplier", (1, channels) if channels > 1 else 1)
        c.ints(f"{prefix}shift", len(mult))
        triples = ((kind, m, s, a[f"{prefix}rounding"]) for m, s in zip(mult, a[f"{prefix}shift"]))
    for kind, m, s, r in triples:
        c.need(kind in tuple(RescaleKind), f"{prefix}kind must be 0 (FIXED), 1 (POT) or 2 (FIXED_SINGLE), got {kind}")
        if kind in (RescaleKind.FIXED, RescaleKind.FIXED_SINGLE):
            c.need(0 <= m <= _I32[1], f"{prefix}multiplier {m} outside [0, 2^31-1]")
            c.need(-31 <= s <= 31, f"{prefix}shift {s} outside [-31, 31] for FIXED")
            if kind == RescaleKind.FIXED:
                c.need(r == Rounding.HALF_AWAY, f"{prefix}rounding must be 0 (HALF_AWAY) for FIXED, got {r}")
            else:
                c.need(r in tuple(Rounding), f"{prefix}rounding {r} is not a known rounding (0..3)")
        else:
            c.need(m == 1, f"{prefix}multiplier must be 1 for POT, got {m}")
            c.need(-31 <= s <= 62, f"{prefix}shift {s} outside [-31, 62] for POT")
            c.need(r in tuple(Rounding), f"{prefix}rounding {r} is not a known rounding (0..3)")


def _check_out(c: _Check, dtype: DType, channels: int) -> None:
    lo, hi = dtype.range
    _check_rescale(c, "rq_", channels)
    c.int("out_zp", lo, hi)
    mn, mx = c.int("out_min", lo, hi), c.int("out_max", lo, hi)
    c.need(mn <= mx, f"out_min {mn} > out_max {mx}")


def _spatial(c: _Check, x: Tensor, rank: int, kernel: tuple[int, ...], pads_limit: bool) -> tuple[int, ...]:
    a = c.op.attrs
    stride = c.ints("stride", rank, 1, 1 << 20)
    pad = c.ints("padding", rank, 0, 1 << 20)
    dil = c.ints("dilation", rank, 1, 1 << 20) if "dilation" in a else (1,) * rank
    out = []
    for i in range(rank):
        if pads_limit:
            c.need(pad[i] <= kernel[i] // 2, f"padding {pad[i]} exceeds half the kernel {kernel[i]}")
        n = conv_out_len(x.shape[2 + i], kernel[i], stride[i], pad[i], dil[i])
        c.need(n >= 1, f"spatial dim {i} of input {x.shape} is too small for kernel {kernel[i]} (output length {n})")
        out.append(n)
    return tuple(out)


def _acc(c: _Check) -> None:
    c.int("acc_bits", 2, 64)
    c.int("overflow", 0, len(OverflowMode) - 1)


def infer_output(index: int, op: Op, ins: list[Tensor], out: Tensor) -> tuple[DType | tuple[DType, ...], tuple[int, ...]]:
    """Check one op against its (already type-checked) inputs; return (allowed dtypes, shape)."""
    c = _Check(index, op)
    t = op.type
    x = ins[0]
    n = x.shape[0] if x.shape else 1

    def dt(tensor: Tensor, allowed, what: str) -> None:
        c.need(tensor.dtype in allowed, f"{what} {tensor.name!r} has dtype {tensor.dtype.name}, expected {'/'.join(d.name for d in allowed)}")

    def const(tensor: Tensor, what: str) -> None:
        c.need(tensor.is_constant, f"{what} {tensor.name!r} must be a constant")

    def act(tensor: Tensor, what: str) -> None:
        c.need(not tensor.is_constant, f"{what} {tensor.name!r} must be an activation, not a constant")

    for i, tensor in enumerate(ins):
        if i == 0 or t in (OpType.ADD, OpType.CONCAT):
            act(tensor, "input")
    schema = OP_SCHEMAS[t]
    if schema.needs_output_stage:  # the weighted ops: input, weight[, bias] -> accumulator
        binary = "in_zp" not in schema.attrs  # XNOR-popcount ops have no zero points
        rank = {OpType.CONV1D: 1, OpType.BCONV1D: 1, OpType.CONV2D: 2, OpType.BCONV2D: 2}.get(t, 0)
        w = ins[1]
        dt(x, (DType.BIN,) if binary else INT8_DTYPES, "input")
        const(w, "weight")
        dt(w, (DType.BIN,) if binary else WEIGHT_DTYPES, "weight")
        c.need(len(x.shape) == rank + 2, f"input {x.name!r} must have rank {rank + 2}, has shape {x.shape}")
        c.need(len(w.shape) == rank + 2, f"weight {w.name!r} must have rank {rank + 2}, has shape {w.shape}")
        cout = w.shape[0]
        if len(ins) == schema.max_inputs:
            const(ins[2], "bias")
            dt(ins[2], (DType.I32,), "bias")
            c.need(ins[2].shape == (cout,), f"bias {ins[2].name!r} must have shape ({cout},), has {ins[2].shape}")
        _acc(c)
        if not binary:
            c.int("in_zp", *x.dtype.range)
            c.ints("w_zp", (1, cout), *w.dtype.range)
        if rank == 0:
            c.need(w.shape[1] == x.shape[1], f"weight {w.name!r} expects {w.shape[1]} input features, input has {x.shape[1]}")
            shape = (n, cout)
        else:
            g = c.int("groups", 1, 1 << 20)
            cin = x.shape[1]
            c.need(cin % g == 0 and cout % g == 0, f"groups={g} must divide input channels {cin} and output channels {cout}")
            c.need(w.shape[1] == cin // g, f"weight {w.name!r} has {w.shape[1]} input channels per group, expected {cin // g}")
            shape = (n, cout) + _spatial(c, x, rank, w.shape[2:], False)
        if out.dtype is not DType.BIN:
            dt(out, INT8_DTYPES + (DType.I32,), "output")
            _check_out(c, out.dtype, cout)
        return (DType.I8, DType.U8, DType.I32, DType.BIN), shape
    if t is OpType.QUANTIZE:
        dt(x, (DType.F32,), "input")
        s = op.attrs["scale"]
        c.need(math.isfinite(s) and s > 0, f"scale must be finite and > 0, got {s}")
        dt(out, INT8_DTYPES, "output")
        lo, hi = out.dtype.range
        c.int("zero_point", *_I32)
        mn, mx = c.int("qmin", lo, hi), c.int("qmax", lo, hi)
        c.need(mn <= mx, f"qmin {mn} > qmax {mx}")
        c.int("rounding", 0, len(Rounding) - 1)
        return INT8_DTYPES, x.shape
    if t is OpType.DEQUANTIZE:
        dt(x, ACTIVATION_DTYPES + (DType.I32,), "input")
        s = op.attrs["scale"]
        c.need(math.isfinite(s) and s > 0, f"scale must be finite and > 0, got {s}")
        c.int("zero_point", *((0, 0) if x.dtype in (DType.BIN, DType.I32) else x.dtype.range))
        return (DType.F32,), x.shape
    if t is OpType.BINARIZE:
        dt(x, (DType.F32,) + INT8_DTYPES, "input")
        c.int("zero_point", *((0, 0) if x.dtype is DType.F32 else x.dtype.range))
        return (DType.BIN,), x.shape
    if t is OpType.REQUANTIZE:
        dt(x, INT8_DTYPES, "input")
        c.int("in_zp", *x.dtype.range)
        dt(out, INT8_DTYPES, "output")
        _check_out(c, out.dtype, x.shape[1] if len(x.shape) > 1 else 1)
        return INT8_DTYPES, x.shape
    if t in (OpType.ADD, OpType.CONCAT):
        for i, tensor in enumerate(ins):
            # ADD also takes I32 activations (a conv/linear's wide output, for residuals)
            dt(tensor, INT8_DTYPES + ((DType.I32,) if t is OpType.ADD else ()), f"input {i}")
            c.need(len(tensor.shape) == len(x.shape), f"input {i} {tensor.name!r} has rank {len(tensor.shape)}, input 0 has {len(x.shape)}")
        zps = c.ints("in_zp", len(ins))
        for tensor, zp in zip(ins, zps):
            c.need(tensor.dtype.range[0] <= zp <= tensor.dtype.range[1], f"in_zp {zp} outside the range of {tensor.name!r}")
        _check_rescale(c, "in_", len(ins), per_input=True)
        dt(out, INT8_DTYPES, "output")
        if t is OpType.ADD:
            c.need(ins[1].shape == x.shape, f"add operands have different shapes {x.shape} and {ins[1].shape}")
            c.int("pre_shift", 0, 31)
            _check_out(c, out.dtype, 1)
            return INT8_DTYPES, x.shape
        axis = c.int("axis", 1, len(x.shape) - 1)
        lo, hi = out.dtype.range
        c.int("out_zp", lo, hi)
        c.need(c.int("out_min", lo, hi) <= c.int("out_max", lo, hi), "out_min > out_max")
        for i, tensor in enumerate(ins):
            same = all(a == b for j, (a, b) in enumerate(zip(tensor.shape, x.shape)) if j != axis)
            c.need(same, f"input {i} {tensor.name!r} shape {tensor.shape} differs from {x.shape} off axis {axis}")
        shape = list(x.shape)
        shape[axis] = sum(tensor.shape[axis] for tensor in ins)
        return INT8_DTYPES, tuple(shape)
    if t is OpType.CLAMP:
        dt(x, INT8_DTYPES, "input")
        lo, hi = x.dtype.range
        c.need(c.int("out_min", lo, hi) <= c.int("out_max", lo, hi), "out_min > out_max")
        return (x.dtype,), x.shape
    if t is OpType.LUT:
        dt(x, INT8_DTYPES, "input")
        dt(out, INT8_DTYPES, "output")
        # one entry per input code, each a value of the output dtype (docs/qgraph.md §4.4)
        c.ints("table", 256, *out.dtype.range)
        return INT8_DTYPES, x.shape
    if t in (OpType.MAXPOOL1D, OpType.MAXPOOL2D, OpType.AVGPOOL1D, OpType.AVGPOOL2D):
        rank = 1 if t in (OpType.MAXPOOL1D, OpType.AVGPOOL1D) else 2
        # a max of ±1 values is a BIN value again (+1 iff any tap is +1); an average is not
        extra = (DType.I32,) if t in (OpType.AVGPOOL1D, OpType.AVGPOOL2D) else (DType.BIN,)
        dt(x, INT8_DTYPES + extra, "input")
        c.need(len(x.shape) == rank + 2, f"input {x.name!r} must have rank {rank + 2}, has shape {x.shape}")
        kernel = c.ints("kernel", rank, 1, 1 << 20)
        shape = x.shape[:2] + _spatial(c, x, rank, kernel, True)
        if t in (OpType.AVGPOOL1D, OpType.AVGPOOL2D):
            c.int("in_zp", *x.dtype.range)
            dt(out, INT8_DTYPES, "output")
            _check_out(c, out.dtype, x.shape[1])
            return INT8_DTYPES, shape
        return (x.dtype,), shape
    if t is OpType.GLOBAL_AVGPOOL:
        dt(x, INT8_DTYPES + (DType.I32,), "input")
        c.need(len(x.shape) >= 3, f"input {x.name!r} must have spatial dims, has shape {x.shape}")
        c.int("in_zp", *x.dtype.range)
        dt(out, INT8_DTYPES, "output")
        _check_out(c, out.dtype, x.shape[1])
        return INT8_DTYPES, x.shape[:2] + (1,) * (len(x.shape) - 2)
    if t is OpType.RESHAPE:
        dt(x, ACTIVATION_DTYPES, "input")
        shape = c.ints("shape", None, 1, 1 << 31)
        c.need(len(shape) >= 1, "attribute 'shape' must not be empty")
        c.need(math.prod(shape) == math.prod(x.shape[1:]), f"cannot reshape {x.shape} to (N, {', '.join(map(str, shape))})")
        return (x.dtype,), (n,) + tuple(shape)
    c.fail(f"unknown op type {t!r}")  # pragma: no cover - OpType is closed
    raise AssertionError


def _check_tensor(t: Tensor) -> None:
    where = f"tensor {t.name!r}"
    if not t.name:
        raise GraphFormatError("empty tensor name", where)
    for i, d in enumerate(t.shape):
        if d < 1 and not (i == 0 and d == -1 and not t.is_constant):
            raise GraphFormatError(f"invalid dimension {d} in shape {t.shape}", where, "only an activation's batch dim may be -1")
    if t.is_constant:
        if t.dtype is DType.F32:
            raise GraphFormatError("float constants are not part of the integer IR", where)
        if tuple(t.data.shape) != t.shape:
            raise GraphFormatError(f"data shape {tuple(t.data.shape)} differs from declared shape {t.shape}", where)
        if not np.issubdtype(t.data.dtype, np.integer):
            raise GraphFormatError(f"constant data must be integers, got {t.data.dtype}", where)
        if t.data.size:
            lo, hi = t.dtype.range
            if t.dtype is DType.BIN:
                bad = ~np.isin(t.data, (-1, 1))
            else:
                bad = (t.data < lo) | (t.data > hi)
            if bad.any():
                v = t.data[bad].flat[0]
                raise GraphFormatError(f"value {v} does not fit dtype {t.dtype.name}", where)


def validate_graph(graph: IntegerGraph) -> None:
    """Raise :class:`GraphFormatError` on the first structural problem (see module doc)."""
    seen: dict[str, Tensor] = {}
    for t in graph.tensors:
        if t.name in seen:
            raise GraphFormatError("duplicate tensor name", f"tensor {t.name!r}")
        _check_tensor(t)
        seen[t.name] = t
    if not graph.inputs:
        raise GraphFormatError("the graph has no inputs")
    if not graph.outputs:
        raise GraphFormatError("the graph has no outputs")
    available: set[str] = {t.name for t in graph.tensors if t.is_constant}
    for name in graph.inputs:
        t = seen.get(name)
        if t is None:
            raise GraphFormatError("graph input names no tensor", f"input {name!r}")
        if t.is_constant or t.dtype not in (DType.F32, DType.I8, DType.U8) or name in available:
            raise GraphFormatError("graph input must be a distinct F32/I8/U8 activation", f"input {name!r}")
        available.add(name)
    for i, op in enumerate(graph.ops):
        where = f"op {i} ({op.type.name} {op.name!r})"
        schema = OP_SCHEMAS[op.type]
        if len(op.inputs) < schema.min_inputs or (schema.max_inputs is not None and len(op.inputs) > schema.max_inputs):
            arity = f"{schema.min_inputs}" + ("+" if schema.max_inputs is None else f"..{schema.max_inputs}")
            raise GraphFormatError(f"takes {arity} inputs, got {len(op.inputs)}", where)
        if len(op.outputs) != 1:
            raise GraphFormatError(f"must have exactly 1 output, got {len(op.outputs)}", where)
        ins = []
        for name in op.inputs:
            if name not in seen:
                raise GraphFormatError(f"input {name!r} names no tensor (dangling reference)", where)
            if name not in available:
                raise GraphFormatError(f"input {name!r} is used before the op that produces it (ops must be in topological order)", where)
            ins.append(seen[name])
        out_name = op.outputs[0]
        out = seen.get(out_name)
        if out is None:
            raise GraphFormatError(f"output {out_name!r} names no tensor (dangling reference)", where)
        if out_name in available:
            raise GraphFormatError(f"output {out_name!r} is a constant, a graph input or already produced", where)
        _check_attr_types(_Check(i, op), op, out.dtype)
        dtypes, shape = infer_output(i, op, ins, out)
        dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
        if out.dtype not in dtypes:
            raise GraphFormatError(f"output {out_name!r} has dtype {out.dtype.name}, expected {'/'.join(d.name for d in dtypes)}", where)
        if tuple(out.shape) != tuple(shape):
            raise GraphFormatError(f"output {out_name!r} declared with shape {out.shape}, inferred {tuple(shape)}", where)
        available.add(out_name)
    for name in graph.outputs:
        if name not in seen:
            raise GraphFormatError("graph output names no tensor", f"output {name!r}")
        if name not in available or seen[name].is_constant:
            raise GraphFormatError("graph output is never produced by an op", f"output {name!r}")
    for t in graph.tensors:
        if t.name not in available:
            raise GraphFormatError("activation is never produced by any op", f"tensor {t.name!r}")


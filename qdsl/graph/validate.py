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

import numpy as np

from qdsl.graph.checks import Check, conv_out_len
from qdsl.graph.ir import OP_SCHEMAS, OUT_ATTRS, RQ_ATTRS, AttrType, DType, GraphFormatError, IntegerGraph, Op, Tensor
from qdsl.graph.ops import op_def

__all__ = ["validate_graph", "infer_output", "conv_out_len"]

_Check = Check  # the old private name


def _check_attr_types(c: Check, op: Op, out_dtype: DType) -> None:
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


def infer_output(index: int, op: Op, ins: list[Tensor], out: Tensor) -> tuple[DType | tuple[DType, ...], tuple[int, ...]]:
    """Check one op against its (already type-checked) inputs; return (allowed dtypes, shape).

    The op's own rule is its registered ``infer`` (:mod:`qdsl.graph.ops`); this adds what
    every op shares: the first input (every input, for ``all_activations`` ops) is an activation.
    """
    c = Check(index, op)
    d = op_def(op.type)
    for i, tensor in enumerate(ins):
        if i == 0 or d.all_activations:
            c.act(tensor, "input")
    return d.infer(c, op, ins, out)


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
        if t.is_constant or t.dtype not in (DType.F32, DType.I8, DType.U8, DType.I32) or name in available:
            raise GraphFormatError("graph input must be a distinct F32/I8/U8/I32 activation", f"input {name!r}")
        available.add(name)
    # I32 graph inputs are token ids or masks: only an op that reads ids (EMBEDDING, as its
    # first input) or masks (SOFTMAX_MASKED, after its first) may read one (other ops take
    # I32 activations as accumulators)
    id_inputs = {n for n in graph.inputs if seen[n].dtype is DType.I32}
    for i, op in enumerate(graph.ops):
        where = f"op {i} ({op.type.name} {op.name!r})"
        schema = OP_SCHEMAS[op.type]
        if len(op.inputs) < schema.min_inputs or (schema.max_inputs is not None and len(op.inputs) > schema.max_inputs):
            arity = f"{schema.min_inputs}" + ("+" if schema.max_inputs is None else f"..{schema.max_inputs}")
            raise GraphFormatError(f"takes {arity} inputs, got {len(op.inputs)}", where)
        if len(op.outputs) != schema.n_outputs:
            raise GraphFormatError(f"must have exactly {schema.n_outputs} output(s), got {len(op.outputs)}", where)
        ins = []
        for name in op.inputs:
            if name not in seen:
                raise GraphFormatError(f"input {name!r} names no tensor (dangling reference)", where)
            if name not in available:
                raise GraphFormatError(f"input {name!r} is used before the op that produces it (ops must be in topological order)", where)
            ins.append(seen[name])
        for k, name in enumerate(op.inputs):
            d = op_def(op.type)
            if name in id_inputs and not ((k == 0 and d.reads_ids) or (k > 0 and d.reads_masks)):
                raise GraphFormatError(f"input {name!r} is an I32 graph input (token ids), which only EMBEDDING "
                                       "reads (as its first input), or a mask, which only SOFTMAX_MASKED reads "
                                       "(after its first input)", where)
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
        extras = op_def(op.type).extra_outputs(op, ins) if len(op.outputs) > 1 else ()
        for extra, (dtype, shape) in zip(op.outputs[1:], extras):  # QUANTIZE_DYNAMIC's qparams
            t = seen.get(extra)
            if t is None:
                raise GraphFormatError(f"output {extra!r} names no tensor (dangling reference)", where)
            if extra in available:
                raise GraphFormatError(f"output {extra!r} is a constant, a graph input or already produced", where)
            allowed = dtype if isinstance(dtype, tuple) else (dtype,)  # a dtype, or the ones allowed
            if t.dtype not in allowed or tuple(t.shape) != tuple(shape):
                raise GraphFormatError(f"output {extra!r} declared as {t.dtype.name} {t.shape}, expected "
                                       f"{'/'.join(d.name for d in allowed)} {tuple(shape)}", where)
            available.add(extra)
    for name in graph.outputs:
        if name not in seen:
            raise GraphFormatError("graph output names no tensor", f"output {name!r}")
        if name not in available or seen[name].is_constant:
            raise GraphFormatError("graph output is never produced by an op", f"output {name!r}")
    for t in graph.tensors:
        if t.name not in available:
            raise GraphFormatError("activation is never produced by any op", f"tensor {t.name!r}")


"""The reference executor: the executable definition of integer-graph semantics.

Each op's semantics is its ``run`` in its module under :mod:`qdsl.graph.ops`; this module
is the interpreter that calls them in order. Numpy int64 arithmetic throughout (QUANTIZE and DEQUANTIZE are the
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

from qdsl.graph.ir import OP_SCHEMAS, DType, IntegerGraph, Op, Tensor
from qdsl.graph.ops import op_def
# each op's semantics lives in its module under qdsl/graph/ops/; the old names stay importable here
from qdsl.graph.ops.add import add  # noqa: F401
from qdsl.graph.ops.boundary import binarize, dequantize, quantize  # noqa: F401
from qdsl.graph.ops.clamp import clamp  # noqa: F401
from qdsl.graph.ops.concat import concat  # noqa: F401
from qdsl.graph.ops.lut import lut  # noqa: F401
from qdsl.graph.ops.pool import avgpool, global_avgpool, maxpool  # noqa: F401
from qdsl.graph.ops.requantize import requantize  # noqa: F401
from qdsl.graph.ops.weighted import bconv, conv, linear  # noqa: F401
from qdsl.spec.diagnostics import NonFiniteError, QdslError, did_you_mean

__all__ = ["GraphInputError", "ExecResult", "execute", "run_reference", "require_finite", "as_array", "bind_inputs",
           "shape_outputs"]


class GraphInputError(QdslError):
    """The array given to a graph does not match its declared input (dtype, shape, range)."""


@attrs.frozen
class ExecResult:
    """Graph outputs (in ``graph.outputs`` order), overflow counts per op name, and all values."""

    outputs: tuple[np.ndarray, ...]
    overflow: dict[str, int]
    values: dict[str, np.ndarray] = attrs.field(repr=False)


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
    if x.dtype == np.bool_:  # a bool mask: 0/1
        x = x.astype(np.int64)
    if not np.issubdtype(x.dtype, np.integer):
        raise GraphInputError(f"input {t.name!r} expects {t.dtype.name} integers, got {x.dtype}")
    lo, hi = t.dtype.range
    if x.size and (x.min() < lo or x.max() > hi):
        raise GraphInputError(f"input {t.name!r} values must be in [{lo}, {hi}] ({t.dtype.name})")
    return x.astype(np.int64)


def _run_op(op: Op, graph: IntegerGraph, env: dict, counts: dict) -> np.ndarray:
    args = [env[n] if n in env else graph.tensor(n) for n in op.inputs]
    return op_def(op.type).run(op, args, graph, counts)


def as_array(x) -> np.ndarray:
    """A graph input as a numpy array: torch tensors are detached and moved to the CPU,
    float16/bfloat16 ones upcast to float32 first (exact; numpy has no bfloat16)."""
    if hasattr(x, "detach"):  # a torch tensor (duck-typed: this module never imports torch)
        x = x.detach()
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        x = x.cpu().numpy()
    return np.asarray(x)


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def bind_inputs(names: Sequence[str], inputs) -> tuple[list, bool]:
    """``(one value per graph input in order, keyed)`` for ``inputs``: a dict keyed by the
    graph's input names (``keyed`` True), a tuple, or a list of arrays/tensors (positional,
    in ``graph.inputs`` order), or anything else as the one input.  Missing, unknown or
    surplus inputs raise :class:`GraphInputError` naming them."""
    if isinstance(inputs, dict):
        unknown = [k for k in inputs if k not in names]
        missing = [n for n in names if n not in inputs]
        if unknown or missing:
            parts = []
            if unknown:
                parts.append("unknown input(s) " + ", ".join(repr(k) for k in unknown)
                             + f" ({did_you_mean(str(unknown[0]), list(names), 'inputs')})")
            if missing:
                parts.append("missing " + ", ".join(repr(n) for n in missing))
            raise GraphInputError(f"graph inputs are {', '.join(repr(n) for n in names)}: {'; '.join(parts)}")
        return [inputs[n] for n in names], True
    if isinstance(inputs, tuple) or (isinstance(inputs, list) and inputs and all(_is_array(v) for v in inputs)):
        values = list(inputs)
    else:
        values = [inputs]
    if len(values) != len(names):
        raise GraphInputError(f"graph takes {len(names)} input(s) ({', '.join(repr(n) for n in names)}), "
                              f"got {len(values)}")
    return values, False


def shape_outputs(names: Sequence[str], outputs: Sequence[np.ndarray], keyed: bool):
    """A dict by output name when the inputs came keyed, else one array for a
    single-output graph, else a tuple in ``graph.outputs`` order."""
    if keyed:
        return dict(zip(names, outputs))
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def require_finite(x: np.ndarray, name: str) -> None:
    """Raise :class:`NonFiniteError` if the float input ``x`` holds a NaN or an infinity
    (``check_finite=True``; without it the QUANTIZE policy above applies)."""
    bad = ~np.isfinite(x)
    if bad.any():
        raise NonFiniteError(f"input {name!r}: {int(bad.sum())} non-finite value(s) (NaN or inf) "
                             f"in an array of shape {tuple(x.shape)}")


def execute(graph: IntegerGraph, inputs: Sequence[np.ndarray] | np.ndarray, keep_values: bool = False,
            check_finite: bool = False) -> ExecResult:
    """Run ``graph`` on ``inputs`` (one array per graph input: one array, a tuple/list in
    ``graph.inputs`` order, or a dict by input name; :func:`bind_inputs`) with integer semantics.

    Integer outputs come back as their container dtype (int8/uint8; BIN as int8 ±1),
    float outputs as float32.  A batch of 0 gives empty outputs of the declared shapes.
    ``check_finite``: a NaN or infinity in a float input raises :class:`NonFiniteError`
    instead of being quantized by the policy (NaN -> zero point, ±inf -> qmax/qmin).
    """
    inputs, _ = bind_inputs(graph.inputs, inputs)
    env: dict[str, np.ndarray] = {}
    for name, x in zip(graph.inputs, inputs):
        env[name] = _check_input(graph.tensor(name), x, check_finite)
    # an input declared with a static first dim (an attention mask (L, S)) is not batched
    batched = [env[n].shape[0] for n in graph.inputs if graph.tensor(n).shape[0] == -1]
    if len(set(batched)) > 1:
        raise GraphInputError("all graph inputs must have the same batch size")
    counts: dict[str, int] = {}
    empty = (batched[0] if batched else next(iter(env.values())).shape[0]) == 0 if env else False
    for op in graph.ops:
        if "acc_bits" in OP_SCHEMAS[op.type].attrs:  # the ops with an accumulator report a count, 0 or more
            counts.setdefault(op.name, 0)
        if empty:  # every value is an empty batch of its declared shape; nothing overflows
            for name in op.outputs:
                t = graph.tensor(name)
                env[name] = np.empty((0,) + tuple(t.shape[1:]), dtype=t.dtype.numpy if t.dtype is DType.F32 else np.int64)
            continue
        result = _run_op(op, graph, env, counts)
        if len(op.outputs) == 1:
            env[op.outputs[0]] = result
        else:  # an op with several outputs (QUANTIZE_DYNAMIC) returns one array per output
            env.update(zip(op.outputs, result))
    outs = tuple(env[n].astype(graph.tensor(n).dtype.numpy) for n in graph.outputs)
    return ExecResult(outs, counts, env if keep_values else {})


def run_reference(graph: IntegerGraph, x, check_finite: bool = False):
    """Outputs only: one array for a single-output graph, else a tuple; a dict by output
    name when ``x`` is a dict by input name."""
    _, keyed = bind_inputs(graph.inputs, x)
    res = execute(graph, x, check_finite=check_finite)
    return shape_outputs(graph.outputs, res.outputs, keyed)

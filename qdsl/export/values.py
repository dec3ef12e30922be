"""What the exporter knows about each traced value, and the graph builder.

While lowering a traced model (lower.py) every fx node maps to one of:

* :class:`IdsVal` - integer token ids (an I32 graph input; only an embedding reads them);
* :class:`FloatVal` - a float tensor: the graph input (which a quantizer may turn into
  QUANTIZE/BINARIZE) or a value nothing quantized (an error if it reaches an integer op);
* :class:`QVal` - an integer tensor of the graph with its grid: real = (q - zp) · scale;
* :class:`Pending` - a layer/add/pool result still in the accumulator domain whose
  output stage waits for the next quantizer (the consumer's input quantizer or an output
  quantizer): that quantizer's scale, zero point, rounding and range become the op's
  requantization, with any ReLU/clamp in between folded into the clamp (exact, since
  rounding is monotone), and monotone ops (max pool, reshape) in between applied after.

:class:`Target` is a frozen quantizer as the exporter needs it. The builder hands out
unique tensor names derived from module paths.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import numpy as np

from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, Rounding, Tensor
from qdsl.spec.diagnostics import QdslError

__all__ = ["ExportError", "Target", "QVal", "FloatVal", "IdsVal", "ConstVal", "OffsetVal", "Pending", "WidePending",
           "wide_scale", "Builder", "ROUNDINGS", "INT32_TARGET_BITS"]

ROUNDINGS = {"half_even": Rounding.HALF_EVEN, "half_away": Rounding.HALF_AWAY, "floor": Rounding.FLOOR}
INT32_TARGET_BITS = 16
"""Fraction bits below the output scale of a FIXED residual add's common scale when an operand's
worst case is unknown (else qdsl.export.add_grid picks the most that fit int32)."""


class ExportError(QdslError):
    """The model cannot be lowered to an integer graph; the message names the module and the fix."""

    def __init__(self, where: str, message: str, hint: str | None = None):
        text = f"error[E402]: cannot export '{where or '<model>'}': {message}"
        if hint:
            text += f"\n  hint: {hint}"
        self.where = where
        super().__init__(text)


@attrs.frozen
class Target:
    """A frozen per-tensor quantizer: where a value must land."""

    scale: float
    zp: int
    qmin: int
    qmax: int
    dtype: DType
    rounding: Rounding
    where: str = attrs.field(eq=False)
    raw: bool = False
    """I32 only: keep a layer's accumulator as it is (per-channel scales, factor 1)."""
    thresholds: tuple[float, ...] | None = None
    """BIN only: a learned per-channel binarisation threshold (+1 where x >= t[c]; axis 1),
    lowered by qdsl/export/lower_threshold.py."""

    def code(self, v: float) -> int:
        """The code the fake quantizer gives the real value ``v`` (binary32, multiply by 1/scale)."""
        inv = np.float32(1.0) / np.float32(self.scale)
        r = float(np.float32(v) * inv)
        if self.rounding is Rounding.HALF_EVEN:
            r = float(np.rint(r))
        elif self.rounding is Rounding.HALF_AWAY:
            r = math.copysign(math.floor(abs(r) + 0.5), r)
        else:
            r = math.floor(r)
        return int(min(max(r + self.zp, self.qmin), self.qmax))

    def clamp_codes(self, lo: float, hi: float) -> tuple[int, int]:
        """``[out_min, out_max]`` for real values clamped to ``[lo, hi]`` (ReLU: lo = 0)."""
        out_min = self.qmin if lo == -math.inf else max(self.qmin, self.code(lo))
        out_max = self.qmax if hi == math.inf else min(self.qmax, self.code(hi))
        return out_min, out_max


@attrs.frozen
class QVal:
    """An integer tensor ``name`` whose real value is ``(q - zp) · scale``."""

    name: str
    scale: float
    zp: int
    qmin: int
    qmax: int
    dtype: DType
    shape: tuple[int, ...]

    def matches(self, t: Target) -> bool:
        return (self.scale, self.zp, self.qmin, self.qmax, self.dtype) == (t.scale, t.zp, t.qmin, t.qmax, t.dtype)


@attrs.frozen
class FloatVal:
    """A float tensor: the graph input (``name`` set) or an unquantized value from ``origin``."""

    origin: str
    shape: tuple[int, ...]
    name: str | None = None
    reshape: tuple[int, ...] | None = None


@attrs.frozen
class IdsVal:
    """Integer token ids: an I32 graph input ``name``, read only by an embedding lookup."""

    origin: str
    shape: tuple[int, ...]
    name: str


@attrs.frozen(eq=False)
class ConstVal:
    """A constant the traced code computed from buffers and fixed sizes (float, fake-quant
    values where a quantizer acted): BERT's position and token-type embeddings at the
    exported sequence length (qdsl.patch.example_trace)."""

    origin: str
    value: Any
    """A ``torch.Tensor``."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)


@attrs.frozen(eq=False)
class OffsetVal:
    """``base + const``: a quantized activation plus a constant broadcast over the batch
    (``word_embeddings(ids) + token_type + position``); a LAYERNORM reads it as two inputs."""

    base: "QVal"
    const: Any
    """A float ``torch.Tensor`` of shape ``(1, ...)``."""
    origin: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape


@attrs.define(eq=False)
class Pending:
    """A result waiting for its output stage (see module doc).

    ``emit(builder, target, lo, hi) -> (tensor name, shape)`` writes the op(s) producing
    the value at ``target``; ``post`` are monotone ops applied after it.
    """

    kind: str
    """"acc" (conv/linear), "add", "pool", "concat"."""
    origin: str
    shape: tuple[int, ...]
    emit: Callable[["Builder", Target, float, float], tuple[str, tuple[int, ...]]]
    scales: np.ndarray | None = None
    """Per-channel accumulator scales (kind "acc"): real = acc · scales[c]."""
    bound: float | None = None
    """The largest ``|real value|`` the result can take, for any input codes (a layer's
    worst case over its weight and bias codes); None when not known.  A wide sum's grid
    (lower_attn.wide_sum_grid) is sized by it."""
    lo: float = -math.inf
    hi: float = math.inf
    post: tuple[tuple[OpType, dict, tuple[int, ...]], ...] = ()
    binary_ok: bool = False
    """Can produce a BIN output directly (sign of the accumulator)."""
    binarize: Callable[..., QVal] | None = None
    """Writes the value's signs for a BIN target another way (a concat: sign of each part);
    ``binarize(builder, target, lo=-inf, hi=inf)``, the clamp only for learned thresholds."""
    cache: dict = attrs.field(factory=dict)

    def clamped(self, lo: float, hi: float) -> "Pending":
        return attrs.evolve(self, lo=max(self.lo, lo), hi=min(self.hi, hi), cache={})

    def then(self, op: OpType, attrs_: dict, shape: tuple[int, ...]) -> "Pending":
        return attrs.evolve(self, post=self.post + ((op, attrs_, shape),), shape=shape, cache={})

    def materialize(self, b: "Builder", t: Target) -> QVal:
        key = (t, self.lo, self.hi)
        if key not in self.cache and t.dtype is DType.BIN and t.thresholds is not None:
            self.cache[key] = self._thresholded(b, t)
        if key not in self.cache:
            if t.dtype is DType.BIN and self.lo >= 0:
                # sign(ReLU(y)) is +1 everywhere (sign(0) = +1): any int8 grid keeps the clamped
                # codes >= 0, so BINARIZE at zero point 0 is exact (the fake-quant model is
                # degenerate here, and the graph reproduces it)
                mid = self.materialize(b, Target(t.scale, 0, -128, 127, DType.I8, Rounding.HALF_EVEN, t.where))
                name = b.op(OpType.BINARIZE, t.where, [mid.name], DType.BIN, self.shape, {"zero_point": 0})
                self.cache[key] = b.q(name, t.scale, 0, -1, 1, DType.BIN, self.shape)
                return self.cache[key]
            if t.dtype is DType.BIN and self.binarize is not None and not self.post and self.hi >= 0 >= self.lo:
                self.cache[key] = self.binarize(b, t)  # a clamp around 0 keeps every sign
                return self.cache[key]
            if t.dtype is DType.BIN and not self.binary_ok:
                raise ExportError(self.origin, f"a binary quantizer ({t.where}) reads the result of a {self.kind}",
                                  "quantize that result to int8 first (an output quantizer)")
            name, shape = self.emit(b, t, self.lo, self.hi)
            for op, a, out_shape in self.post:
                b.q(name, t.scale, t.zp, t.qmin, t.qmax, t.dtype, shape)
                name = b.op(op, self.origin, [name], t.dtype, out_shape, a)
                shape = out_shape
            self.cache[key] = b.q(name, t.scale, t.zp, t.qmin, t.qmax, t.dtype, self.shape)
        return self.cache[key]

    def _thresholded(self, b: "Builder", t: Target) -> QVal:
        """A BIN target with learned thresholds: the layer compares its accumulator
        (qdsl/export/lower_threshold.py); pools after it see the signs, reshapes must keep
        the channel axis."""
        if self.binarize is not None and not self.post:
            return self.binarize(b, t, self.lo, self.hi)  # a concat: each part at its channels' thresholds
        if not (self.kind == "acc" and self.binary_ok):
            raise ExportError(self.origin, f"a binary quantizer with a learned threshold ({t.where}) reads the result "
                                           f"of a {self.kind}", "quantize that result to int8 first (an output quantizer)")
        shapes = [self.shape] + [s for _, _, s in self.post]
        if any(len(s) < 2 or s[1] != len(t.thresholds) for s in shapes):
            raise ExportError(t.where, f"a learned threshold has {len(t.thresholds)} channels but reads the result of "
                                       f"'{self.origin}' reshaped across its channel axis ({' -> '.join(map(str, shapes))})",
                              "binarise before the reshape, or quantize the result to int8 first (an output quantizer)")
        name, shape = self.emit(b, t, self.lo, self.hi)
        for op, a, out_shape in self.post:
            b.q(name, t.scale, 0, -1, 1, DType.BIN, shape)
            name = b.op(op, self.origin, [name], DType.BIN, out_shape, a)
            shape = out_shape
        return b.q(name, t.scale, 0, -1, 1, DType.BIN, self.shape)


@attrs.define(eq=False)
class WidePending(Pending):
    """A result (a LayerNorm's) that, with ``wide_out``, is also read unquantized - by a
    residual add, the next LayerNorm or the model output: it is written once as I32 at its
    accumulator unit ``unit`` (:meth:`wide`; LAYERNORM's wide output), and an 8-bit quantizer
    reads it through a REQUANTIZE by ``unit / s_out``, the very rescale the 8-bit op applies,
    so those codes are the narrow op's."""

    unit: float = 1.0
    wide_out: bool = False

    def wide(self, bld: "Builder") -> QVal:
        if self.post or self.lo != -math.inf or self.hi != math.inf:
            raise ExportError(self.origin, f"a clamped or reshaped {self.kind} result has no wide (I32) form",
                              f"quantize it: add `output = a8` (an activation quantizer) for '{self.origin}'")
        return self.materialize(bld, Target(self.unit, 0, -(2**31), 2**31 - 1, DType.I32, Rounding.HALF_AWAY,
                                            self.origin, raw=True))


def wide_scale(v: Any) -> float | None:
    """The grid of a :class:`WidePending`'s wide output, else ``None``."""
    return v.unit if isinstance(v, WidePending) and v.wide_out else None


class Builder:
    """Collects tensors and ops with unique names."""

    def __init__(self, single_rounding: bool = False) -> None:
        self.single_rounding = single_rounding
        """Use FIXED_SINGLE (one rounding, the quantizer's mode) instead of gemmlowp FIXED."""
        self.tensors: list[Tensor] = []
        self.ops: list[Op] = []
        self._names: set[str] = set()
        self.reserved: set[str] = set()
        """Graph output names: other tensors avoid them, the output that asks gets it exactly."""
        self.info: dict[str, tuple[Any, Any]] = {}
        """Real-value grid per tensor name: ``(scale, zero point)`` (scalars or per channel)."""
        self.onnx_float8 = False
        """The ONNX writer's mode (qdsl/export/float8.py): FP8 weights as float8 bit patterns,
        FP8 activations as targets with an :class:`~qdsl.export.float8.F8Scale`."""

    def q(self, name: str, scale: float, zp: int, qmin: int, qmax: int, dtype: DType, shape) -> QVal:
        """A :class:`QVal`, with its grid recorded in :attr:`info`."""
        self.info[name] = (scale, zp)
        return QVal(name, scale, zp, qmin, qmax, dtype, tuple(shape))

    def unique(self, base: str, exact: bool = False) -> str:
        base = base or "t"
        if exact and base in self.reserved and base not in self._names:
            self._names.add(base)
            return base
        name, i = base, 1
        while name in self._names or name in self.reserved:
            i += 1
            name = f"{base}:{i}"
        self._names.add(name)
        return name

    def tensor(self, base: str, dtype: DType, shape, data: Any = None, exact: bool = False) -> str:
        name = self.unique(base, exact)
        self.tensors.append(Tensor(name, dtype, shape, data))
        return name

    def redeclare(self, name: str, shape) -> None:
        """Declare tensor ``name`` (a graph input) with ``shape``: an attention mask whose
        first dim is not the batch gets its static shape."""
        self.tensors = [attrs.evolve(t, shape=tuple(shape)) if t.name == name else t for t in self.tensors]

    def op(self, type_: OpType, where: str, inputs: list[str], dtype: DType, shape, attrs_: dict,
           out: str | None = None, exact: bool = False) -> str:
        name = self.tensor(out or f"{where or 'model'}:{type_.name.lower()}", dtype, shape, exact=exact)
        self.ops.append(Op(type_, where or "<model>", inputs, [name], attrs_))
        return name

    def graph(self, inputs: list[str], outputs: list[str], name: str) -> IntegerGraph:
        used = {n for op in self.ops for n in op.inputs} | set(inputs) | {n for op in self.ops for n in op.outputs}
        tensors = [t for t in self.tensors if t.name in used]
        return IntegerGraph(tensors, inputs, outputs, self.ops, name=name)

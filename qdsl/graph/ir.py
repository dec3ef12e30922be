"""The integer graph IR: frozen records that ``.qgraph`` files serialize one to one.

An :class:`IntegerGraph` is a list of named :class:`Tensor` records (graph inputs,
activations and constants) and a topologically ordered list of :class:`Op` records that
refer to tensors by name.  Every op is one of :class:`OpType`; its attributes are a flat
mapping of name -> ``int`` | ``float`` | ``tuple[int, ...]`` whose names, types and
meaning are fixed by :data:`OP_SCHEMAS` and documented, formula by formula, in
``docs/qgraph.md``.  ``qdsl/graph/reference.py`` is the executable definition of the
semantics; the C++ runtime must equal it bit for bit.

Guarantees:

* records are immutable; constants hold *logical* values (int4 weights as small ints,
  binary weights as ±1), packing is a property of the file format only;
* :meth:`IntegerGraph.validate` (also run by the ``.qgraph`` loader) checks op arity,
  attribute names and types, dtypes, shapes (by shape inference), dangling names and
  topological order, and raises :class:`GraphFormatError` naming the op or tensor.

The numeric codes of :class:`DType`, :class:`OpType`, :class:`RescaleKind`,
:class:`Rounding` and :class:`AttrType` are part of the file format: never renumber.
"""

from __future__ import annotations

import enum
from typing import Any, Mapping

import attrs
import numpy as np

from qdsl.spec.diagnostics import QdslError
from qdsl.spec.model import attrs_frozendict

__all__ = [
    "GraphFormatError",
    "DType",
    "OpType",
    "AttrType",
    "RescaleKind",
    "Rounding",
    "OverflowMode",
    "Tensor",
    "Op",
    "IntegerGraph",
    "GraphCache",
    "OpSchema",
    "OP_SCHEMAS",
    "RQ_ATTRS",
    "OUT_ATTRS",
    "Rescale",
    "OutputStage",
    "GRAPH_VERSION",
]

GRAPH_VERSION = 1
"""IR/format version; bumped whenever any semantics or layout changes."""


class GraphFormatError(QdslError):
    """A graph (in memory or a ``.qgraph`` file) is malformed; the message says what and where.

    ``where`` is a short location such as ``byte 132``, ``op 4 'layer1.0.conv1'`` or
    ``tensor 'fc.weight'``.
    """

    def __init__(self, message: str, where: str | None = None, hint: str | None = None):
        self.where = where
        self.hint = hint
        text = f"invalid integer graph: {message}"
        if where:
            text = f"invalid integer graph at {where}: {message}"
        text = f"error[E401]: {text}"
        if hint:
            text += f"\n  hint: {hint}"
        super().__init__(text)


class DType(enum.IntEnum):
    """Element types. Activations are F32 (graph boundary), I8, U8, BIN, or I32 (wide
    conv/linear output feeding an ADD); constants any int type."""

    F32 = 1
    """IEEE-754 binary32."""
    I8 = 2
    """Signed 8-bit two's complement."""
    U8 = 3
    """Unsigned 8-bit."""
    I32 = 4
    """Signed 32-bit (bias; wide conv/linear outputs read by ADD)."""
    I4 = 5
    """Signed 4-bit, packed two per byte (constants only)."""
    U4 = 6
    """Unsigned 4-bit, packed two per byte (constants only)."""
    I2 = 7
    """Signed 2-bit, packed four per byte (constants only)."""
    U2 = 8
    """Unsigned 2-bit, packed four per byte (constants only)."""
    BIN = 9
    """Binary {+1, -1}: bit 0 is +1, bit 1 is -1; packed eight per byte in files."""

    @property
    def bits(self) -> int:
        return _BITS[self]

    @property
    def packed(self) -> bool:
        """Stored several elements per byte (see docs/qgraph.md, 'Packing')."""
        return self.bits < 8

    @property
    def is_int(self) -> bool:
        return self is not DType.F32

    @property
    def range(self) -> tuple[int, int]:
        """Smallest and largest logical value."""
        if self is DType.BIN:
            return (-1, 1)
        if self is DType.F32:
            raise ValueError("F32 has no integer range")
        b = self.bits
        if self in (DType.U8, DType.U4, DType.U2):
            return (0, 2**b - 1)
        return (-(2 ** (b - 1)), 2 ** (b - 1) - 1)

    @property
    def numpy(self) -> np.dtype:
        """Container numpy dtype for logical values of this type."""
        return np.dtype({DType.F32: np.float32, DType.U8: np.uint8, DType.I32: np.int32}.get(self, np.int8))


_BITS = {
    DType.F32: 32, DType.I8: 8, DType.U8: 8, DType.I32: 32, DType.I4: 4,
    DType.U4: 4, DType.I2: 2, DType.U2: 2, DType.BIN: 1,
}
ACTIVATION_DTYPES = (DType.I8, DType.U8, DType.BIN)
INT8_DTYPES = (DType.I8, DType.U8)
WEIGHT_DTYPES = (DType.I8, DType.U8, DType.I4, DType.U4, DType.I2, DType.U2, DType.BIN)


class OpType(enum.IntEnum):
    """Operations; the exact integer semantics of each is in docs/qgraph.md."""

    QUANTIZE = 1
    """F32 -> I8/U8: ``clamp(round(x * f32(1/scale)) + zp, qmin, qmax)`` in binary32."""
    DEQUANTIZE = 2
    """I8/U8/BIN -> F32: ``(q - zp) * scale``."""
    REQUANTIZE = 3
    """I8/U8 -> I8/U8: ``clamp(rescale(x - in_zp) + out_zp, out_min, out_max)``."""
    CONV1D = 4
    """Integer conv over ``N×C×L``; output stage or sign (BIN output)."""
    CONV2D = 5
    """Integer conv over ``N×C×H×W``; groups incl. depthwise."""
    LINEAR = 6
    """Integer matrix product ``N×K · (O×K)^T``."""
    BCONV1D = 7
    """Binary conv: XNOR-popcount of BIN input and BIN weights."""
    BCONV2D = 8
    """Binary 2-D conv: XNOR-popcount."""
    BLINEAR = 9
    """Binary linear: ``acc = K - 2 * popcount(a XOR w)``."""
    ADD = 10
    """Elementwise add of two quantized tensors with per-input rescale."""
    CONCAT = 11
    """Concatenation along ``axis`` with per-input rescale."""
    CLAMP = 12
    """``clamp(x, out_min, out_max)`` (ReLU / ReLU6 in the quantized domain)."""
    MAXPOOL1D = 13
    """Max over windows; padding never wins."""
    MAXPOOL2D = 14
    """Max over 2-D windows."""
    AVGPOOL1D = 15
    """Sum of ``x - in_zp`` over the window, rescaled (divisor folded into the rescale)."""
    AVGPOOL2D = 16
    """2-D average pool, same rule."""
    GLOBAL_AVGPOOL = 17
    """Sum of ``x - in_zp`` over all spatial positions, rescaled; keeps size-1 spatial dims."""
    RESHAPE = 18
    """Reshape the non-batch dims (flatten)."""
    BINARIZE = 19
    """I8/U8/F32 -> BIN: ``-1 if x < zero_point else +1``."""
    LUT = 20
    """I8/U8 -> I8/U8 elementwise lookup: ``table[x - min(in dtype)]`` (256 entries)."""


class AttrType(enum.IntEnum):
    """Attribute value types in the file."""

    INT = 1
    """i64."""
    FLOAT = 2
    """f32."""
    INTS = 3
    """u32 count, then that many i64."""


class RescaleKind(enum.IntEnum):
    """How an integer is multiplied by a real factor."""

    FIXED = 0
    """gemmlowp: saturating rounding doubling high multiply by an int32, then rounding right shift."""
    POT = 1
    """Exact arithmetic shift (power-of-two factor) with the stated rounding."""
    FIXED_SINGLE = 2
    """int32 multiplier, then ONE rounding of ``x·m / 2^(31+s)`` (exact int64) with the stated rounding."""


class Rounding(enum.IntEnum):
    """Rounding of a right shift in POT rescales (and of QUANTIZE)."""

    HALF_AWAY = 0
    """Ties away from zero."""
    HALF_EVEN = 1
    """Ties to even (IEEE default, ``torch.round``)."""
    FLOOR = 2
    """Toward minus infinity."""
    HALF_UP = 3
    """Ties toward plus infinity: ``(v + 2^(s-1)) >> s``."""


class OverflowMode(enum.IntEnum):
    """What an accumulator narrower than the exact sum does."""

    WRAP = 0
    """Two's complement wrap to ``acc_bits``."""
    SATURATE = 1
    """Clamp the exact sum to the ``acc_bits`` range."""


def _eq_data(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    # logical values compare, not containers (a loaded I4 tensor is int8, a built one int64)
    return a.shape == b.shape and bool(np.array_equal(a, b))


def _to_data(value: Any) -> np.ndarray | None:
    if value is None:
        return None
    arr = np.array(value, copy=True)
    arr.setflags(write=False)
    return arr


@attrs.frozen
class Tensor:
    """A named tensor. ``data`` is set for constants only and holds logical values.

    Activation shapes start with the batch dimension, ``-1`` when it is dynamic.
    """

    name: str
    dtype: DType = attrs.field(converter=DType)
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(d) for d in s))
    data: np.ndarray | None = attrs.field(
        default=None, converter=_to_data, eq=attrs.cmp_using(eq=_eq_data), hash=False, repr=False
    )

    @property
    def is_constant(self) -> bool:
        return self.data is not None


def _freeze_attrs(value: Mapping[str, Any]) -> attrs_frozendict:
    out = {}
    for k, v in dict(value).items():
        if isinstance(v, (list, tuple, np.ndarray)):
            v = tuple(int(x) for x in v)
        elif isinstance(v, (bool, np.bool_)):
            v = int(v)
        elif isinstance(v, (int, np.integer)):
            v = int(v)
        elif isinstance(v, (float, np.floating)):
            v = float(np.float32(v))  # FLOAT attributes are f32 in the file
        out[str(k)] = v
    return attrs_frozendict(out)


@attrs.frozen
class Op:
    """One operation. ``name`` is the module path it came from (for errors and overflow counts)."""

    type: OpType = attrs.field(converter=OpType)
    name: str
    inputs: tuple[str, ...] = attrs.field(converter=tuple)
    outputs: tuple[str, ...] = attrs.field(converter=tuple)
    attrs: Mapping[str, Any] = attrs.field(factory=dict, converter=_freeze_attrs)


@attrs.frozen
class OpSchema:
    """Arity, allowed dtypes and attributes of one op type."""

    min_inputs: int
    max_inputs: int | None
    attrs: Mapping[str, AttrType]
    needs_output_stage: bool = False
    """Requires :data:`RQ_ATTRS` + :data:`OUT_ATTRS` unless the output dtype is BIN."""


RQ_ATTRS = {
    "rq_kind": AttrType.INT,
    "rq_multiplier": AttrType.INTS,
    "rq_shift": AttrType.INTS,
    "rq_rounding": AttrType.INT,
}
"""The rescale of an output stage (per tensor: length 1, per channel: length C along axis 1)."""
OUT_ATTRS = {"out_zp": AttrType.INT, "out_min": AttrType.INT, "out_max": AttrType.INT}
"""Zero point added after the rescale, then the clamp (fused ReLU/ReLU6/clamp and dtype range)."""

_ACC = {"acc_bits": AttrType.INT, "overflow": AttrType.INT}
_SPATIAL = {"stride": AttrType.INTS, "padding": AttrType.INTS, "dilation": AttrType.INTS}
_POOL = {"kernel": AttrType.INTS, "stride": AttrType.INTS, "padding": AttrType.INTS}
_IN_RQ = {
    "in_zp": AttrType.INTS, "in_kind": AttrType.INTS, "in_multiplier": AttrType.INTS,
    "in_shift": AttrType.INTS, "in_rounding": AttrType.INTS,
}
_CONV = {**_SPATIAL, "groups": AttrType.INT, "in_zp": AttrType.INT, "w_zp": AttrType.INTS, **_ACC}
_BCONV = {**_SPATIAL, "groups": AttrType.INT, **_ACC}

OP_SCHEMAS: dict[OpType, OpSchema] = {
    OpType.QUANTIZE: OpSchema(1, 1, {"scale": AttrType.FLOAT, "zero_point": AttrType.INT,
                                     "qmin": AttrType.INT, "qmax": AttrType.INT, "rounding": AttrType.INT}),
    OpType.DEQUANTIZE: OpSchema(1, 1, {"scale": AttrType.FLOAT, "zero_point": AttrType.INT}),
    OpType.REQUANTIZE: OpSchema(1, 1, {"in_zp": AttrType.INT, **RQ_ATTRS, **OUT_ATTRS}),
    OpType.CONV1D: OpSchema(2, 3, _CONV, needs_output_stage=True),
    OpType.CONV2D: OpSchema(2, 3, _CONV, needs_output_stage=True),
    OpType.LINEAR: OpSchema(2, 3, {"in_zp": AttrType.INT, "w_zp": AttrType.INTS, **_ACC}, needs_output_stage=True),
    OpType.BCONV1D: OpSchema(2, 3, _BCONV, needs_output_stage=True),
    OpType.BCONV2D: OpSchema(2, 3, _BCONV, needs_output_stage=True),
    OpType.BLINEAR: OpSchema(2, 3, dict(_ACC), needs_output_stage=True),
    OpType.ADD: OpSchema(2, 2, {**_IN_RQ, "pre_shift": AttrType.INT, **RQ_ATTRS, **OUT_ATTRS}),
    OpType.CONCAT: OpSchema(1, None, {**_IN_RQ, "axis": AttrType.INT, **OUT_ATTRS}),
    OpType.CLAMP: OpSchema(1, 1, {"out_min": AttrType.INT, "out_max": AttrType.INT}),
    OpType.MAXPOOL1D: OpSchema(1, 1, {**_POOL, "dilation": AttrType.INTS}),
    OpType.MAXPOOL2D: OpSchema(1, 1, {**_POOL, "dilation": AttrType.INTS}),
    OpType.AVGPOOL1D: OpSchema(1, 1, {**_POOL, "in_zp": AttrType.INT, **RQ_ATTRS, **OUT_ATTRS}),
    OpType.AVGPOOL2D: OpSchema(1, 1, {**_POOL, "in_zp": AttrType.INT, **RQ_ATTRS, **OUT_ATTRS}),
    OpType.GLOBAL_AVGPOOL: OpSchema(1, 1, {"in_zp": AttrType.INT, **RQ_ATTRS, **OUT_ATTRS}),
    OpType.RESHAPE: OpSchema(1, 1, {"shape": AttrType.INTS}),
    OpType.BINARIZE: OpSchema(1, 1, {"zero_point": AttrType.INT}),
    OpType.LUT: OpSchema(1, 1, {"table": AttrType.INTS}),
}


@attrs.frozen
class Rescale:
    """A real factor applied to an int32 (per tensor or per channel); see requant.py.

    FIXED / FIXED_SINGLE: ``multiplier`` in [0, 2^31 - 1], ``shift`` in [-31, 31] (negative =
    left shift); FIXED always rounds half away (twice), FIXED_SINGLE once with ``rounding``.
    POT: ``multiplier`` all 1, ``shift`` in [-31, 62], ``rounding`` applies to right shifts.
    """

    kind: RescaleKind = attrs.field(converter=RescaleKind)
    multiplier: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(x) for x in v))
    shift: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(x) for x in v))
    rounding: Rounding = attrs.field(default=Rounding.HALF_AWAY, converter=Rounding)

    @classmethod
    def identity(cls) -> "Rescale":
        return cls(RescaleKind.POT, (1,), (0,))

    def attrs(self, prefix: str = "rq_") -> dict[str, Any]:
        return {
            f"{prefix}kind": int(self.kind),
            f"{prefix}multiplier": self.multiplier,
            f"{prefix}shift": self.shift,
            f"{prefix}rounding": int(self.rounding),
        }

    @classmethod
    def from_attrs(cls, a: Mapping[str, Any], prefix: str = "rq_") -> "Rescale":
        return cls(a[f"{prefix}kind"], a[f"{prefix}multiplier"], a[f"{prefix}shift"], a[f"{prefix}rounding"])


@attrs.frozen
class OutputStage:
    """``clamp(rescale(acc) + zero_point, qmin, qmax)``: the requantization of an op's output."""

    rescale: Rescale
    zero_point: int
    qmin: int
    qmax: int

    def attrs(self) -> dict[str, Any]:
        return {**self.rescale.attrs(), "out_zp": self.zero_point, "out_min": self.qmin, "out_max": self.qmax}

    @classmethod
    def from_attrs(cls, a: Mapping[str, Any]) -> "OutputStage":
        return cls(Rescale.from_attrs(a), a["out_zp"], a["out_min"], a["out_max"])


class GraphCache(dict):
    """Scratch space an executor keeps on one :class:`IntegerGraph` object
    (:func:`qdsl.runtime.run.run_graph` keeps the compiled form here).  Not part of the graph:
    never compared, and a pickled or deep-copied graph starts with an empty one."""

    def __reduce__(self):
        return GraphCache, ()

    def __deepcopy__(self, memo) -> "GraphCache":
        return GraphCache()


@attrs.frozen
class IntegerGraph:
    """Tensors, graph inputs/outputs (names) and the topologically ordered op list."""

    tensors: tuple[Tensor, ...] = attrs.field(converter=tuple)
    inputs: tuple[str, ...] = attrs.field(converter=tuple)
    outputs: tuple[str, ...] = attrs.field(converter=tuple)
    ops: tuple[Op, ...] = attrs.field(converter=tuple)
    name: str = "graph"
    _by_name: Mapping[str, Tensor] = attrs.field(init=False, eq=False, repr=False, hash=False)
    _cache: GraphCache = attrs.field(init=False, factory=GraphCache, eq=False, repr=False, hash=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})

    def tensor(self, name: str) -> Tensor:
        try:
            return self._by_name[name]
        except KeyError:
            raise GraphFormatError(f"no tensor named {name!r}", f"tensor {name!r}") from None

    def has_tensor(self, name: str) -> bool:
        return name in self._by_name

    @property
    def constants(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.is_constant)

    def validate(self) -> "IntegerGraph":
        """Check everything a file loader checks; return ``self`` (raises GraphFormatError)."""
        from qdsl.graph.validate import validate_graph

        validate_graph(self)
        return self

    def summary(self) -> str:
        """One line per op: index, type, name, inputs -> outputs."""
        lines = [f"graph {self.name!r}: inputs {list(self.inputs)} outputs {list(self.outputs)}"]
        for i, op in enumerate(self.ops):
            lines.append(f"  {i:3d} {op.type.name:<15} {op.name:<28} {', '.join(op.inputs)} -> {', '.join(op.outputs)}")
        return "\n".join(lines)


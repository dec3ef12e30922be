"""The integer graph's vocabulary: element types, attribute types, rescales, op schemas.

Split from :mod:`qdsl.graph.ir` so the op modules (:mod:`qdsl.graph.ops`), which
:mod:`qdsl.graph.ir` reads to build ``OpType`` and ``OP_SCHEMAS``, can import these
without a cycle.  :mod:`qdsl.graph.ir` re-exports every name; import them from there.

The numeric codes of :class:`DType`, :class:`RescaleKind`, :class:`Rounding`,
:class:`AttrType` and :class:`OverflowMode` are part of the file format: never renumber.
"""

from __future__ import annotations

import enum
from typing import Any, Mapping

import attrs
import numpy as np

from qdsl.spec.diagnostics import QdslError

__all__ = [
    "GraphFormatError",
    "DType",
    "AttrType",
    "RescaleKind",
    "Rounding",
    "OverflowMode",
    "OpSchema",
    "RQ_ATTRS",
    "OUT_ATTRS",
    "IN_RQ_ATTRS",
    "Rescale",
    "OutputStage",
    "ACTIVATION_DTYPES",
    "INT8_DTYPES",
    "WEIGHT_DTYPES",
]


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


@attrs.frozen
class OpSchema:
    """Arity, allowed dtypes and attributes of one op type."""

    min_inputs: int
    max_inputs: int | None
    attrs: Mapping[str, AttrType]
    needs_output_stage: bool = False
    """Requires :data:`RQ_ATTRS` + :data:`OUT_ATTRS` unless the output dtype is BIN."""
    n_outputs: int = 1
    """How many output tensors the op writes (QUANTIZE_DYNAMIC: codes and their run-time
    qparams); every other op has exactly one.  The op's ``infer`` checks the extra ones."""


RQ_ATTRS = {
    "rq_kind": AttrType.INT,
    "rq_multiplier": AttrType.INTS,
    "rq_shift": AttrType.INTS,
    "rq_rounding": AttrType.INT,
}
"""The rescale of an output stage (per tensor: length 1, per channel: length C along axis 1)."""
OUT_ATTRS = {"out_zp": AttrType.INT, "out_min": AttrType.INT, "out_max": AttrType.INT}
"""Zero point added after the rescale, then the clamp (fused ReLU/ReLU6/clamp and dtype range)."""
IN_RQ_ATTRS = {
    "in_zp": AttrType.INTS, "in_kind": AttrType.INTS, "in_multiplier": AttrType.INTS,
    "in_shift": AttrType.INTS, "in_rounding": AttrType.INTS,
}
"""One zero point and rescale per input (ADD, CONCAT): the ``rq_`` fields as lists."""

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

"""Number formats: what each quantizer ``kind`` means, as a part (torch-free facts).

A *number format* answers every question the rest of qdsl asks about a kind, so that
nothing outside the formats branches on it (DESIGN.md §9, docs/architecture.md):

* ``code_range(bits, signed, narrow)`` - the integer codes it allows (derived here once);
* ``default_bits`` / ``bits_requirement`` - the bit budget it takes;
* ``default_observer`` and ``zero_point`` (whether an asymmetric zero point exists);
* ``operand_ranges(...)`` - the zero-point-corrected range of one accumulator operand
  (lint's worst-case accumulator bound);
* ``activation_lowering`` - whether (and how) a quantized *activation* of this format
  exists in the integer graph.

The torch side (quantize, dequantize, scale from an observed range, export lowering of
weights) lives in ``qdsl.quantizers.formats``, bound to the registry entry by
``qdsl.quantizers.default_registries()`` (resolve and lint never import torch).

Formats are registered like every part: ``registries.formats`` holds a
:class:`~qdsl.spec.registry.PartInfo` per name whose factory is the torch ops and whose
``extra["format"]`` is the facts object below (:func:`register_format`).  The resolver
stores the facts on each :class:`~qdsl.resolve.plan.QuantizerRecipe` (``recipe.format``),
so export, lint and QAT read them from the plan without a registry at hand.
"""

from __future__ import annotations

from typing import Any

from qdsl.spec.model import Kind
from qdsl.spec.registry import PartInfo, Registries

__all__ = [
    "NumberFormat",
    "IntFormat",
    "BinaryFormat",
    "TernaryFormat",
    "PotFormat",
    "FloatFormat",
    "BUILTIN_FORMATS",
    "kind_name",
    "is_float",
    "builtin_format",
    "format_of",
    "register_format",
    "int_code_range",
    "pot_levels",
]


def kind_name(kind: Any) -> str:
    """``"int"`` for ``Kind.INT`` and for a user format's plain name ``"int"``."""
    return str(getattr(kind, "value", kind))


def int_code_range(bits: int, signed: bool, narrow: bool = False) -> tuple[int, int]:
    """Affine integer codes for ``bits``; ``narrow`` drops the most negative (signed) or
    the largest (unsigned) code.  The one derivation every layer imports.

    >>> int_code_range(8, True), int_code_range(8, True, True), int_code_range(4, False), int_code_range(2, False, True)
    ((-128, 127), (-127, 127), (0, 15), (0, 2))
    """
    if signed:
        return -(1 << (bits - 1)) + (1 if narrow else 0), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1 - (1 if narrow else 0)


def pot_levels(bits: int) -> int:
    """Magnitudes ``n = 2^(bits-1) - 1`` of a ``bits``-bit power-of-two value (one bit is
    the sign; code 0 is zero).

    >>> [pot_levels(b) for b in (2, 3, 4, 8)]
    [1, 3, 7, 127]
    """
    if bits < 2:
        raise ValueError(f"power-of-two weights need >= 2 bits (sign + magnitude), got {bits}")
    return (1 << (bits - 1)) - 1


class NumberFormat:
    """Base of a number format's torch-free facts.  Subclasses override what differs."""

    name: str = ""
    quantized: bool = True
    """False only for ``float`` (the tensor stays in floating point)."""
    zero_point: bool = False
    """An asymmetric zero point exists (``symmetric = false`` is allowed)."""
    default_bits: int = 8
    default_observer: str = "auto"
    affine: bool = False
    """Codes are a contiguous integer grid with value ``(q - z)·s``: raw codes multiply in
    integer kernels, a narrower ``bits`` is a narrower grid (int)."""
    fixed_codes: bool = False
    """Fixed integer codes may replace rounding (learned rounding, GPTQ, lean QAT form)."""
    fixed_width: bool = False
    """``bits`` is fixed by the format (binary 1, ternary 2): a profile's bit list does not apply."""
    signedness: bool = True
    """``signed`` changes the codes (ternary: always {-1, 0, +1})."""
    narrow: bool = False
    """``narrow_range`` changes the codes (int)."""
    accumulator_input: bool = False
    accumulator_weight: bool = False
    """An integer accumulator takes this format as its input / weight operand, at scale
    ``input_scale × weight_scale`` (so a folded BN's bias gets an int32 proxy there)."""
    unit_codes: bool = False
    """Its codes are -1, 0 or +1 (no zero point): a dequantized value is exactly ``±scale`` or 0
    in binary32, so a layer whose input and weight both have such codes sums integer
    multiples of ``s_x·s_w``, which binary64 holds exactly (the frozen layer computes there,
    qdsl.patch.layer, so a sum that is exactly 0 is 0, as in the integer graph)."""
    sign_reader: bool = False
    """Its codes are a comparison of ``x`` with one threshold (binary), so a float bias
    read only by it lowers exactly as a sign threshold (qdsl.patch.consumers)."""

    max_export_weight_bits: int | None = None
    """The widest weight of this format the integer graph can hold (None: no limit of the
    format's own); wider weights still fake-quantize, so lint warns instead of resolve failing."""

    def activation_lowering(self, signed: bool) -> str | None:
        """How a frozen activation of this format enters the integer graph: ``"int"``
        (affine int8/uint8), ``"bin"`` (bit-packed ±1), or None (no lowering)."""
        return None

    def code_range(self, bits: int, signed: bool, narrow: bool) -> tuple[int, int]:
        raise NotImplementedError

    def bits_requirement(self) -> str | None:
        """``"== 1"``-style text when only some widths are valid, else None."""
        return None

    def bits_ok(self, bits: int) -> bool:
        return True

    def operand_ranges(self, bits: int, signed: bool, narrow: bool, symmetric: bool) -> tuple[tuple[int, int], ...]:
        """Zero-point-corrected code ranges of an accumulator operand (one per extreme
        zero point).  Default: the code range itself (formats without a zero point)."""
        lo, hi = self.code_range(bits, signed, narrow)
        return ((lo, hi),)

    def grid_step(self, bits: int) -> float:
        """The value of one step of :meth:`operand_codes`' grid, in units of the scale."""
        return 1.0

    def operand_codes(self, codes: Any) -> Any:
        """Integer codes (a numpy array) as the integers an accumulator multiplies: the
        codes themselves unless the format maps them onto a grid (pot)."""
        return codes

    def describe(self, bits: int, signed: bool, symmetric: bool) -> str:
        """How lint names a quantizer's codes (``"8-bit signed"``, ``"pot 4-bit"``)."""
        return self.name

    def __repr__(self) -> str:
        return f"<number format {self.name}>"


class IntFormat(NumberFormat):
    """Affine integers: ``q = clamp(round(x/s) + z, qmin, qmax)``."""

    name = "int"
    zero_point = True
    affine = True
    fixed_codes = True
    narrow = True
    accumulator_input = accumulator_weight = True

    def activation_lowering(self, signed):
        return "int"

    def code_range(self, bits, signed, narrow):
        return int_code_range(bits, signed, narrow)

    def operand_ranges(self, bits, signed, narrow, symmetric):
        qmin, qmax = int_code_range(bits, signed, narrow)
        if symmetric:
            return ((qmin, qmax),)
        return ((0, qmax - qmin), (qmin - qmax, 0))

    def describe(self, bits, signed, symmetric):
        return f"{bits}-bit {'signed' if signed else 'unsigned'}{'' if symmetric else ' asymmetric'}"


class BinaryFormat(NumberFormat):
    """{-1, +1} times a scale (XNOR-Net); with ``signed = false``, {0, 1}."""

    name = "binary"
    default_bits = 1
    default_observer = "mean_abs"
    fixed_width = True
    accumulator_input = accumulator_weight = True
    sign_reader = True
    unit_codes = True

    def activation_lowering(self, signed):
        return "bin" if signed else None  # sign(x) as bit-packed ±1; {0, 1} has no lowering

    def code_range(self, bits, signed, narrow):
        return (-1, 1) if signed else (0, 1)

    def bits_requirement(self):
        return "== 1"

    def bits_ok(self, bits):
        return bits == 1


class TernaryFormat(NumberFormat):
    """{-1, 0, +1} times a scale."""

    name = "ternary"
    default_bits = 2
    default_observer = "mean_abs"
    fixed_width = True
    signedness = False
    accumulator_weight = True
    unit_codes = True

    def code_range(self, bits, signed, narrow):
        return -1, 1

    def bits_requirement(self):
        return "== 2"

    def bits_ok(self, bits):
        return bits == 2


class PotFormat(NumberFormat):
    """Each value is ±2^k or 0, with the exponents within the bit budget."""

    name = "pot"
    accumulator_weight = True
    # operand_codes of b bits reach ±2^(n-1), n = 2^(b-1) - 1: b = 4 gives ±64 (int8), b = 5 ±16384
    max_export_weight_bits = 4

    def code_range(self, bits, signed, narrow):
        n = pot_levels(bits)
        return (-n, n) if signed else (0, n)

    def bits_requirement(self):
        return ">= 2"

    def bits_ok(self, bits):
        return bits >= 2

    def grid_step(self, bits):
        return 2.0 ** (1 - pot_levels(bits))

    def operand_codes(self, codes):
        # value = sign(c)·s·2^(|c|-n) = (sign(c)·2^(|c|-1)) · s·2^(1-n): an integer grid.
        # numpy is imported here, not at the top: only callers holding integer codes (export,
        # calibrated lint) get here, and spec checks stay free of array libraries.
        import numpy as np

        return np.where(codes == 0, 0, np.sign(codes) * np.left_shift(1, np.maximum(np.abs(codes) - 1, 0)))

    def operand_ranges(self, bits, signed, narrow, symmetric):
        # the integer grid of operand_codes: code c -> sign(c)·2^(|c|-1)
        top = 1 << ((1 << (bits - 1)) - 2 if signed else (1 << bits) - 2)
        return ((-top, top),) if signed else ((0, top),)

    def describe(self, bits, signed, symmetric):
        return f"pot {bits}-bit"


class FloatFormat(NumberFormat):
    """Not quantized: the tensor stays in floating point."""

    name = "float"
    quantized = False

    def code_range(self, bits, signed, narrow):
        raise ValueError("a float tensor has no integer codes")

    def operand_ranges(self, bits, signed, narrow, symmetric):
        return ()


BUILTIN_FORMATS: dict[str, NumberFormat] = {
    f.name: f for f in (IntFormat(), BinaryFormat(), TernaryFormat(), PotFormat(), FloatFormat())
}
"""The built-in formats' facts (immutable; the registry bundle is the extension point)."""


def is_float(kind: Any) -> bool:
    """``kind`` is ``float`` (the tensor is not quantized), whether a Kind or a name."""
    return kind_name(kind) == FloatFormat.name


def builtin_format(kind: Any) -> NumberFormat:
    """The facts of a built-in kind (``Kind.POT`` or ``"pot"``)."""
    return BUILTIN_FORMATS[kind_name(kind)]


def format_of(kind: Any, registries: Registries | None = None, default: NumberFormat | None = None) -> NumberFormat:
    """The facts of ``kind``: from ``registries.formats`` when given, else the built-ins;
    an unknown name gives ``default`` (resolve reports it as E204) or raises KeyError."""
    name = kind_name(kind)
    if registries is not None and name in registries.formats:
        fmt = registries.formats.get(name).extra.get("format")
        if fmt is not None:
            return fmt
    if name not in BUILTIN_FORMATS and default is not None:
        return default
    return BUILTIN_FORMATS[name]


def register_format(registries: Registries, fmt: NumberFormat, ops: Any = None, *, override: bool = False) -> None:
    """Register ``fmt`` on ``registries.formats`` with its torch ops (a
    ``qdsl.quantizers.formats.FormatOps`` class, instance or ``"module:attr"``; None
    declares the format torch-free, as ``qdsl.spec.builtins`` does for the built-ins)."""
    registries.formats.add(PartInfo(fmt.name, ops, extra={"format": fmt}), override=override)


# Kind's members and the built-in formats must name the same set (a new built-in kind
# adds both); checked at import so a mismatch fails every test at once.
assert set(BUILTIN_FORMATS) == {k.value for k in Kind}, "Kind and BUILTIN_FORMATS disagree"

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

import re
from typing import Any

from qdsl.spec.model import Kind
from qdsl.spec.registry import PartInfo, Registries

__all__ = [
    "threshold_misuse",
    "NumberFormat",
    "IntFormat",
    "BinaryFormat",
    "TernaryFormat",
    "PotFormat",
    "FloatFormat",
    "MinifloatFormat",
    "BUILTIN_FORMATS",
    "MINIFLOAT_PRESETS",
    "minifloat_format",
    "minifloat_problem",
    "looks_like_minifloat",
    "is_format_name",
    "kind_name",
    "is_float",
    "builtin_format",
    "format_of",
    "lookup_format",
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
    family: str = ""
    """The name the torch ops are registered under when it differs from ``name``: every
    minifloat (``fp8_e4m3``, ``fp6_e3m2_b2``...) shares the ops registered as ``minifloat``."""
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
    learned_threshold: bool = False
    """A signed activation of this format may binarise at a learned per-channel threshold
    (``threshold = learned``: +1 where ``x >= t[c]``; qdsl.quantizers.formats.binary)."""

    ragged_groups: bool = False
    """``group(k)`` need not divide a weight row: the last block of a row is shorter (OCP MX
    pads it); otherwise the resolver requires k to divide the row (E217)."""

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

    def label(self, bits: int) -> str:
        """A short name for reprs: ``int8``, ``pot4``; a name that holds its width, as is."""
        return f"{self.name}{bits}"

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
    learned_threshold = True

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


class MinifloatFormat(NumberFormat):
    """A sign bit, ``exponent`` exponent bits and ``mantissa`` mantissa bits (OCP FP8/FP6/FP4).

    Value of the bit pattern ``s|e|m`` (exponent field ``e``, mantissa field ``m``):
    ``(-1)^s · 2^(1-bias) · m/2^M`` when ``e = 0`` (subnormals, and ±0), else
    ``(-1)^s · 2^(e-bias) · (1 + m/2^M)``.  ``special`` says which patterns are not numbers:

    * ``ieee`` - the all-ones exponent holds ±inf (``m = 0``) and NaNs (fp8_e5m2);
    * ``fn``   - no infinities; only ``S.1..1.1..1`` is NaN (fp8_e4m3, torch's ``float8_e4m3fn``);
    * ``finite`` - every pattern is a number (the OCP FP6 and FP4 element formats).

    Quantized values never reach inf/NaN: rounding saturates to ``±max_normal``.  Every value
    is an integer multiple of ``2^(emin - M)`` (the smallest subnormal), so the format's
    integer grid (``code_range``, ``operand_codes``, ``grid_step``) is that multiple, which
    is what an integer accumulator would multiply (fp4_e2m1: ±12 steps of 0.5).

    >>> f = MINIFLOAT_PRESETS["fp8_e4m3"]
    >>> f.max_normal, f.min_normal, f.min_subnormal, f.emax, f.bits
    (448.0, 0.015625, 0.001953125, 8, 8)
    >>> MINIFLOAT_PRESETS["fp4_e2m1"].values()
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    """

    family = "minifloat"
    default_observer = "minmax"
    ragged_groups = True
    fixed_width = True
    signedness = False

    def __init__(self, name: str, exponent: int, mantissa: int, bias: int | None = None, special: str = "finite"):
        self.name = name
        self.exponent, self.mantissa = exponent, mantissa
        self.bias = (1 << (exponent - 1)) - 1 if bias is None else bias
        self.special = special
        self.bits = self.default_bits = 1 + exponent + mantissa
        top = (1 << exponent) - 1  # the all-ones exponent field
        top_mant = (1 << mantissa) - 1
        if special == "ieee":
            top, top_mant = top - 1, top_mant
        elif special == "fn":
            top_mant -= 1  # S.1..1.1..1 is NaN
        self.emax = top - self.bias
        """Unbiased exponent of the largest normal value (OCP MX's ``emax_elem``)."""
        self.emin = 1 - self.bias
        self.max_normal = 2.0 ** self.emax * (1 + top_mant / (1 << mantissa))
        self.min_normal = 2.0 ** self.emin
        self.min_subnormal = 2.0 ** (self.emin - mantissa)
        self.has_inf = special == "ieee"
        self.has_nan = special != "finite"
        self._max_steps = int(self.max_normal / self.min_subnormal)

    def values(self) -> list[float]:
        """Every finite non-negative value, ascending (``-0`` and negatives mirror them)."""
        out = {0.0}
        step = 2.0 ** -self.mantissa
        for m in range(1, 1 << self.mantissa):
            out.add(2.0 ** self.emin * m * step)
        for e in range(self.emin, self.emax + 1):
            for m in range(1 << self.mantissa):
                v = 2.0 ** e * (1 + m * step)
                if v <= self.max_normal:
                    out.add(v)
        return sorted(out)

    def code_range(self, bits, signed, narrow):
        # the integer grid (multiples of the smallest subnormal), not the bit patterns
        return -self._max_steps, self._max_steps

    def bits_requirement(self):
        return f"== {self.bits}"

    def bits_ok(self, bits):
        return bits == self.bits

    def grid_step(self, bits):
        return self.min_subnormal

    def operand_codes(self, codes):
        # bit patterns (uint8, sign|exponent|mantissa) -> integer multiples of min_subnormal:
        # subnormal m, normal 2^(e-1)·(2^M + m); numpy imported here as in PotFormat
        import numpy as np

        c = np.asarray(codes).astype(np.int64)
        m_bits = self.mantissa
        sign = np.where((c >> (self.bits - 1)) & 1, -1, 1)
        e = (c >> m_bits) & ((1 << self.exponent) - 1)
        m = c & ((1 << m_bits) - 1)
        mag = np.where(e == 0, m, np.left_shift(np.int64(1) << m_bits | m, np.maximum(e - 1, 0)))
        return sign * mag

    def describe(self, bits, signed, symmetric):
        return f"{self.name} (e{self.exponent}m{self.mantissa})"

    def label(self, bits):
        return self.name

    def __eq__(self, other):
        return isinstance(other, MinifloatFormat) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def _key(self):
        return self.name, self.exponent, self.mantissa, self.bias, self.special


_SPECIALS = ("ieee", "fn", "finite")
MINIFLOAT_PRESETS: dict[str, MinifloatFormat] = {
    f.name: f for f in (
        MinifloatFormat("fp8_e4m3", 4, 3, special="fn"),
        MinifloatFormat("fp8_e5m2", 5, 2, special="ieee"),
        MinifloatFormat("fp6_e3m2", 3, 2),
        MinifloatFormat("fp6_e2m3", 2, 3),
        MinifloatFormat("fp4_e2m1", 2, 1),
    )
}
"""The OCP formats by name (OCP 8-bit FP v1.0, OCP MX v1.0 element formats)."""

# generic minifloats: fp{bits}_e{E}m{M}, then optionally _b{bias} and _ieee / _fn / _finite
_MF_NAME = re.compile(r"fp(\d+)_e(\d+)m(\d+)(?:_b(\d+))?(?:_(ieee|fn|finite))?")
_MF_LOOSE = re.compile(r"fp\d*_?e\d+m\d+\w*")
_MF_FORM = "fp{bits}_e{E}m{M}[_b{bias}][_ieee|_fn|_finite]"
_MF_CACHE: dict[str, MinifloatFormat] = {}


def looks_like_minifloat(name: str) -> bool:
    """``name`` is meant as a minifloat format (the DSL reads such a head as a kind)."""
    return name in MINIFLOAT_PRESETS or name == "minifloat" or _MF_LOOSE.fullmatch(name) is not None


def is_format_name(name: str) -> bool:
    """The DSL reads ``name`` / ``name(...)`` as a kind: a built-in kind or a minifloat."""
    return name in BUILTIN_FORMATS or looks_like_minifloat(name)


def minifloat_problem(name: str) -> tuple[str, str] | None:
    """``(message, hint)`` when ``name`` looks like a minifloat but names none, else None."""
    if name in MINIFLOAT_PRESETS:
        return None
    m = _MF_NAME.fullmatch(name)
    presets = ", ".join(MINIFLOAT_PRESETS)
    if name == "minifloat":
        return "'minifloat' is a family of formats: name one", f"e.g. {presets}, or {_MF_FORM}"
    if m is None:
        return (f"'{name}' is not a minifloat format name",
                f"write one of {presets}, or {_MF_FORM}")
    bits, e, mant = int(m[1]), int(m[2]), int(m[3])
    bias, special = m[4], m[5] or "finite"
    if e < 1 or 1 + e + mant > 8:
        return (f"'{name}': a minifloat needs 1 to 7 exponent bits and at most 8 bits in all "
                f"(sign + exponent + mantissa), got 1 + {e} + {mant}", f"presets: {presets}")
    if bits != 1 + e + mant:
        return (f"'{name}': sign + exponent + mantissa is 1 + {e} + {mant} = {1 + e + mant} bits, not {bits}",
                f"write fp{1 + e + mant}_e{e}m{mant}{name[m.end(3):]}")
    if bias is not None and int(bias) >= (1 << e):
        return (f"'{name}': exponent bias {bias} is out of range for {e} exponent bits",
                f"use a bias in 0..{(1 << e) - 1} (default {(1 << (e - 1)) - 1})")
    if special == "ieee" and e < 2:
        return f"'{name}': an IEEE-like format needs >= 2 exponent bits (one exponent is inf/NaN)", \
            f"drop '_ieee' (fp{bits}_e{e}m{mant} has no inf/NaN)"
    if special == "fn" and mant < 1:
        return f"'{name}': '_fn' (only S.1..1.1..1 is NaN) needs >= 1 mantissa bit", \
            "use _ieee or _finite"
    return None


def minifloat_format(name: str) -> MinifloatFormat | None:
    """The minifloat ``name`` names (a preset or the generic form), or None."""
    fmt = MINIFLOAT_PRESETS.get(name) or _MF_CACHE.get(name)
    if fmt is not None or minifloat_problem(name) is not None or not looks_like_minifloat(name):
        return fmt
    m = _MF_NAME.fullmatch(name)
    bias = None if m[4] is None else int(m[4])
    fmt = _MF_CACHE[name] = MinifloatFormat(name, int(m[2]), int(m[3]), bias, m[5] or "finite")
    return fmt


BUILTIN_FORMATS: dict[str, NumberFormat] = {
    f.name: f for f in (IntFormat(), BinaryFormat(), TernaryFormat(), PotFormat(), FloatFormat())
}
"""The built-in formats' facts (immutable; the registry bundle is the extension point)."""


def is_float(kind: Any) -> bool:
    """``kind`` is ``float`` (the tensor is not quantized), whether a Kind or a name."""
    return kind_name(kind) == FloatFormat.name


def builtin_format(kind: Any) -> NumberFormat:
    """The facts of a built-in kind (``Kind.POT`` or ``"pot"``, or a minifloat's name)."""
    name = kind_name(kind)
    return BUILTIN_FORMATS.get(name) or minifloat_format(name) or BUILTIN_FORMATS[name]


def format_of(kind: Any, registries: Registries | None = None, default: NumberFormat | None = None) -> NumberFormat:
    """The facts of ``kind``: from ``registries.formats`` when given, else the built-ins;
    an unknown name gives ``default`` (resolve reports it as E204) or raises KeyError."""
    name = kind_name(kind)
    if registries is not None and name in registries.formats:
        fmt = registries.formats.get(name).extra.get("format")
        if fmt is not None:
            return fmt
    if name not in BUILTIN_FORMATS:
        mini = minifloat_format(name)  # the generic minifloat names form an open family
        if mini is not None:
            return mini
        if default is not None:
            return default
    return BUILTIN_FORMATS[name]


def lookup_format(kind: Any, registries: Registries | None = None) -> NumberFormat | None:
    """The facts of ``kind`` or None: a registered format, a built-in one, or a minifloat
    name (a family entry such as ``minifloat`` names ops, not a format)."""
    name = kind_name(kind)
    if registries is not None and name in registries.formats:
        fmt = registries.formats.get(name).extra.get("format")
        if fmt is not None:
            return fmt
    return BUILTIN_FORMATS.get(name) or minifloat_format(name)


def register_format(registries: Registries, fmt: NumberFormat, ops: Any = None, *, override: bool = False) -> None:
    """Register ``fmt`` on ``registries.formats`` with its torch ops (a
    ``qdsl.quantizers.formats.FormatOps`` class, instance or ``"module:attr"``; None
    declares the format torch-free, as ``qdsl.spec.builtins`` does for the built-ins)."""
    registries.formats.add(PartInfo(fmt.name, ops, extra={"format": fmt}), override=override)


# Kind's members and the built-in formats must name the same set (a new built-in kind
# adds both); checked at import so a mismatch fails every test at once.
assert set(BUILTIN_FORMATS) == {k.value for k in Kind}, "Kind and BUILTIN_FORMATS disagree"


def threshold_misuse(fmt: NumberFormat | None, signed: bool | None, role: Any) -> tuple[str, str, str] | None:
    """Why ``threshold = learned`` cannot apply here, as ``(field to point at, message,
    hint)``, or None.  ``fmt`` is the kind's number format, ``role`` a
    :class:`~qdsl.spec.model.Role`; None arguments are not known yet (a partial quantizer).
    The schema asks for what one node writes, the resolver again for the cascaded result
    (both raise E220)."""
    if role is not None and role.is_param:
        return ("threshold", f"a learned threshold applies to binary activations, not the {role.value}",
                "binary weights are sign(w) (their threshold is 0); set the threshold on the layer's input: "
                "input = binary(signed, threshold=learned)")
    if fmt is not None and not fmt.learned_threshold:
        return ("kind", f"threshold = learned needs kind binary, not {fmt.name}",
                "a learned threshold is for signed binary activations: use binary(signed, threshold=learned), "
                "or drop the threshold")
    if signed is False:
        return ("signed", "threshold = learned needs signed binary codes {-1, +1}, not unsigned {0, 1}",
                "unsigned binary already thresholds at half its scale; use binary(signed, threshold=learned)")
    return None

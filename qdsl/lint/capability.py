"""Check one tensor quantizer against a :class:`TensorCaps`: every mismatch, with its fix.

The input is a mapping ``field -> value`` of what is *known* about the quantizer (a
resolved recipe knows every field; a spec-only node only what it writes), so one
function serves both lint modes.  Each :class:`Violation` names the spec field to change,
the requested and allowed values, and the nearest allowed value, which
:meth:`Violation.hint` phrases as the assignment to write in the syntax of the file the
finding points into (``qdsl/lint/fixes.py``).  Codes are listed in ``qdsl/lint/codes.py``.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from qdsl.lint.fixes import bias_fix, use
from qdsl.spec.diagnostics import Span
from qdsl.spec.formats import BUILTIN_FORMATS, format_of, kind_name, minifloat_format
from qdsl.spec.model import Granularity, GranularityKind, Kind, Role
from qdsl.spec.profile import NarrowRange, TensorCaps, export_scale_class, scale_allowed

__all__ = ["Violation", "check_quantizer", "nearest"]


@attrs.frozen
class Violation:
    """One field of one quantizer that the target does not accept."""

    code: str
    field: str
    """The spec field to change (``bits``, ``scale``, ``symmetric``...)."""
    requested: str
    allowed: str
    fix_value: Any
    """The nearest allowed value of ``field`` (the hint writes it in the spec's syntax)."""
    caps_field: str
    """The profile field that forbids it (for pointing at the profile line)."""
    reason: str = ""
    fix_special: str | None = None
    """``"quantize"`` (give a float role a quantizer), ``"bias"`` (an int32 bias at scale
    input*weight) or ``"own_scale"`` (a bias quantizer with a scale of its own)."""

    def hint(self, role: Role, span: Span) -> str:
        """The fix, phrased for the file ``span`` points into."""
        if self.fix_special == "bias":
            return bias_fix(span)
        if self.fix_special == "quantize":
            return f"quantize the {role.value}: " + use("kind", Kind.INT, span, role)
        text = use(self.field, self.fix_value, span, role)
        if self.fix_special == "own_scale":
            text += " (a bias quantizer of its own)"
        return text


def nearest(value: int, allowed: tuple[int, ...]) -> int:
    """The allowed number closest to ``value``; ties go to the larger (safer) one."""
    return min(allowed, key=lambda a: (abs(a - value), -a))


def _fmt_list(values) -> str:
    return ", ".join(str(v.value if hasattr(v, "value") else v) for v in values)


def _kind(value: Any) -> Any:
    """A built-in kind as its :class:`Kind` member; a registered format's name stays a str."""
    return Kind(value) if kind_name(value) in {k.value for k in Kind} else value


def _same_kind(a: Any, b: Any) -> bool:
    """``a`` is the kind ``b`` allows: the same name, or the same minifloat under another
    spelling (``fp8_e4m3`` and ``fp8_e4m3_b7_fn`` have equal exponent, mantissa, bias and
    special values)."""
    if kind_name(a) == kind_name(b):
        return True
    fa, fb = minifloat_format(kind_name(a)), minifloat_format(kind_name(b))
    return fa is not None and fb is not None and _facts(fa) == _facts(fb)


def _facts(fmt) -> tuple:
    return fmt.exponent, fmt.mantissa, fmt.bias, fmt.special


def _bool(v: bool) -> str:
    return "true" if v else "false"


def check_quantizer(
    known: Mapping[str, Any],
    caps: TensorCaps,
    role: Role,
    *,
    integer_only: bool = False,
    pot_scales: frozenset[str] = frozenset(),
    fmt: Any = None,
) -> list[Violation]:
    """Every way the quantizer described by ``known`` breaks ``caps``.

    ``known`` may lack any field; checks that need a missing field are skipped, so a
    partial spec node is checked only on what it says.  ``bits`` applies to int and pot
    kinds only (binary and ternary have fixed widths), and the int-only fields
    (signedness, zero point, narrow range) are skipped for float tensors: the kind's
    number format says which fields apply (``fmt``, a resolved recipe's own format; by
    default the built-in one of ``known["kind"]``).
    """
    out: list[Violation] = []
    kind = known.get("kind")
    kind = _kind(kind) if kind is not None else None
    # what the number format says about the other fields (None: kind not known here)
    if fmt is None and kind is not None:
        fmt = format_of(kind, default=BUILTIN_FORMATS["int"])
    if kind is not None:
        if not fmt.quantized and integer_only:
            out.append(Violation("E312", "kind", "float", "an integer kind", Kind.INT, "integer_only",
                                 "the target is integer-only: no tensor may stay float", _float_fix(role)))
        elif caps.kinds is not None and not any(_same_kind(kind, k) for k in caps.kinds):
            choice = next((k for k in caps.kinds if format_of(k, default=BUILTIN_FORMATS["int"]).affine), caps.kinds[0])
            special = _float_fix(role) if not fmt.quantized else None
            out.append(Violation("E301", "kind", kind_name(kind), _fmt_list(caps.kinds), choice, "kinds",
                                 fix_special=special))
            return _bias_rule(out, role)  # the other fields are about a kind the target lacks
    if fmt is not None and not fmt.quantized:
        return _bias_rule(out, role)
    bits = known.get("bits")
    if bits is not None and caps.bits is not None and (fmt is None or not fmt.fixed_width) and bits not in caps.bits:
        out.append(Violation("E302", "bits", str(bits), _fmt_list(caps.bits), nearest(bits, caps.bits), "bits"))
    signed = known.get("signed")
    if signed is not None and caps.signedness is not None and (fmt is None or fmt.signedness):
        word = "signed" if signed else "unsigned"
        if word not in caps.signedness:
            out.append(Violation("E303", "signed", _bool(signed), _fmt_list(caps.signedness), not signed,
                                 "signedness"))
    scale = known.get("scale")
    if scale is not None and caps.scales is not None:
        cls = export_scale_class(scale, pot_scales)
        if not scale_allowed(cls, caps.scales):
            value, special = _scale_fix(scale, cls, caps.scales)
            out.append(Violation("E304", "scale", scale, _fmt_list(caps.scales), value, "scales",
                                 f"'{scale}' exports as a {cls} scale" if cls != scale else "", special))
    gran = known.get("granularity")
    if isinstance(gran, Granularity):
        out += _check_granularity(gran, caps)
    symmetric = known.get("symmetric")
    if symmetric is False and caps.zero_point is False and (fmt is None or fmt.zero_point):
        out.append(Violation("E306", "symmetric", "false", "symmetric only, no zero point", True, "zero_point"))
    narrow = known.get("narrow_range")
    if narrow is not None and caps.narrow_range is not None and (fmt is None or fmt.narrow) and signed is not False:
        if caps.narrow_range is NarrowRange.REQUIRED and not narrow:
            out.append(Violation("E307", "narrow_range", "false", "true", True, "narrow_range"))
        elif caps.narrow_range is NarrowRange.FORBIDDEN and narrow:
            out.append(Violation("E307", "narrow_range", "true", "false", False, "narrow_range"))
    dynamic = known.get("dynamic")
    if dynamic:
        if integer_only:
            out.append(Violation("E308", "dynamic", "true", "false", False, "integer_only",
                                 "dynamic scales are computed in float at run time; the target is integer-only"))
        elif caps.dynamic is False:
            out.append(Violation("E308", "dynamic", "true", "false", False, "dynamic"))
    if known.get("threshold") == "learned" and caps.thresholds is False and (fmt is None or fmt.learned_threshold):
        out.append(Violation("E309", "threshold", "learned", "none (binarise at 0)", "none", "thresholds"))
    return _bias_rule(out, role)


def _bias_rule(out: list[Violation], role: Role) -> list[Violation]:
    """The bias's scale (derived input*weight or its own) and float-ness are the target's
    *bias rule*: reported as E316 rather than as a generic scale or kind mismatch."""
    if role is not Role.BIAS:
        return out
    return [attrs.evolve(v, code="E316") if v.code == "E304" or (v.code == "E301" and v.requested == "float")
            else v for v in out]


def _float_fix(role: Role) -> str:
    return "bias" if role is Role.BIAS else "quantize"


def _scale_fix(scale: str, cls: str, allowed: tuple[str, ...]) -> tuple[str, str | None]:
    """(the nearest allowed scale, a special fix kind or None)."""
    if "input*weight" in allowed and cls != "input*weight" and not ({"float", "pot"} & set(allowed)):
        return "input*weight", None
    if cls == "input*weight":
        return ("float" if "float" in allowed else "pot"), "own_scale"
    if cls == "float" and "pot" in allowed:
        return ("learned_pot" if scale == "learned" else "pot"), None
    return allowed[0], None


def _check_granularity(gran: Granularity, caps: TensorCaps) -> list[Violation]:
    out = []
    text = str(gran)
    if caps.granularities is not None and gran.kind not in caps.granularities:
        pick = GranularityKind.CHANNEL if GranularityKind.CHANNEL in caps.granularities else caps.granularities[0]
        size = None
        if pick is GranularityKind.GROUP:  # a size the target takes, else keep the spec's
            size = caps.group_sizes[0] if caps.group_sizes else (gran.group_size or 32)
        fix = Granularity(pick, group_size=size)
        return [Violation("E305", "granularity", text, _fmt_list(caps.granularities), fix, "granularities")]
    if gran.kind is GranularityKind.CHANNEL and caps.channel_axes is not None:
        axis = 0 if gran.axis is None else gran.axis
        if axis not in caps.channel_axes:
            want = caps.channel_axes[0]
            out.append(Violation("E305", "granularity", text, f"channel axis {_fmt_list(caps.channel_axes)}",
                                 Granularity(GranularityKind.CHANNEL, want), "channel_axes"))
    if gran.kind is GranularityKind.GROUP and caps.group_sizes is not None and gran.group_size not in caps.group_sizes:
        size = nearest(gran.group_size or 0, caps.group_sizes)
        out.append(Violation("E305", "granularity", text, "group(" + _fmt_list(caps.group_sizes) + ")",
                             Granularity(GranularityKind.GROUP, group_size=size), "group_sizes"))
    return out

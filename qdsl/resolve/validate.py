"""Built-in defaults and the validity rules of a tensor quantizer (torch-free).

:func:`builtin_value` fills a field no source set; :func:`validate_fields` checks the
fields that *are* present against each other, against the role, and against the part
registries - so the same function checks a partial quantizer written in a spec
(``check_spec``, no model) and a fully resolved :class:`QuantizerRecipe`
(:func:`validate_recipe`).  :func:`check_shapes` adds the checks that need the layer's
parameter shapes.  Every diagnostic points at the span of the field that is wrong
(``spans[field]``), falling back to another involved field when that one came from a
built-in default.

Built-in defaults (provenance "built-in default"): kind int; bits 8 (binary 1, ternary
2; a bias whose scale is ``input*weight`` gets 32); signed true; narrow_range false;
symmetric true; scale float; granularity tensor; observer auto (min/max at >= 8 bits,
bit-aware range search below; binary and ternary: mean_abs); rounding half_even; dynamic false;
threshold none (``threshold = learned`` is for signed binary activations only: E220).
The kind-dependent ones (bits, observer) and the kind's bit rules (E210 degenerate code
range, E211) come from the kind's number format (``qdsl.spec.formats``).  ``channel`` without an axis means axis
0 for weight and bias (output channels) and axis 1 for input and output (the channel
dimension of NC... activations).

Group granularity: one scale per ``group_size`` consecutive elements of each flattened
weight row, i.e. along the reduction dimension ``prod(weight.shape[1:])`` (Linear:
``in_features``; Conv: ``in_channels/groups * prod(kernel_size)``, kernel-position
fastest, matching ``weight.reshape(out, -1)``).  The group size must divide it, unless the
format has ``ragged_groups`` (minifloats: the last block of a row is shorter, as OCP MX pads it).
Activation shapes are not in the model index, so axis checks cover weight and bias only.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from qdsl.resolve.plan import OUT_CHANNEL_AXIS, RECURRENT_TYPES, ModuleEntry, QuantizerRecipe, param_shape
from qdsl.spec.builtins import builtin_registries
from qdsl.spec.diagnostics import Diagnostic, Span, UNKNOWN_SPAN
from qdsl.spec.formats import (
    BUILTIN_FORMATS,
    MINIFLOAT_PRESETS,
    format_of,
    kind_name,
    looks_like_minifloat,
    lookup_format,
    minifloat_problem,
    threshold_misuse,
)
from qdsl.spec.model import (
    DERIVED_BIAS_SCALE,
    Granularity,
    GranularityKind,
    Kind,
    ObserverSpec,
    Role,
    TENSOR_QUANT_FIELDS,
)
from qdsl.spec.registry import Registries, validate_params

__all__ = [
    "builtin_value",
    "fill_channel_axis",
    "validate_fields",
    "validate_recipe",
    "validate_observer",
    "check_shapes",
    "derived_bias_problem",
    "MAX_BITS",
    "MAX_BIAS_BITS",
]

MAX_BITS = 16
MAX_BIAS_BITS = 32


def builtin_value(field: str, role: Role, kind: Kind, scale: str | None,
                  registries: Registries | None = None) -> Any:
    """The built-in default of ``field`` given the role and the already resolved kind/scale
    (bits and observer defaults are the number format's, looked up in ``registries``)."""
    derived_bias = role is Role.BIAS and scale == DERIVED_BIAS_SCALE
    if field == "kind":
        return Kind.INT
    if field == "bits":
        if derived_bias:
            return 32
        return format_of(kind, registries, BUILTIN_FORMATS["int"]).default_bits
    if field in ("signed", "symmetric"):
        return True
    if field in ("narrow_range", "dynamic"):
        return False
    if field == "scale":
        return "float"
    if field == "granularity":
        return Granularity(GranularityKind.TENSOR)
    if field == "observer":
        # "auto" is min/max at >= 8 bits and the bit-aware range search below (per-channel
        # MSE for weights, histogram search for activations): the right default for
        # low-bit PTQ, identical to min/max where min/max is already good.
        return ObserverSpec(format_of(kind, registries, BUILTIN_FORMATS["int"]).default_observer)
    if field == "rounding":
        return "half_even"
    if field == "threshold":
        return "none"
    raise KeyError(field)


def fill_channel_axis(gran: Granularity, role: Role, type_name: str | None = None) -> Granularity:
    """``channel`` without an axis: the output channels of the weight (0, or
    ``OUT_CHANNEL_AXIS[type_name]``: 1 for a transposed conv's ``in × out/g × k``
    weight), 0 for a bias, 1 (channels of N,C,...) for activations (-1, the features, for
    a recurrent layer's)."""
    if gran.kind is GranularityKind.CHANNEL and gran.axis is None:
        axis = 1 if not role.is_param else OUT_CHANNEL_AXIS.get(type_name, 0) if role is Role.WEIGHT else 0
        if type_name in RECURRENT_TYPES and not role.is_param:
            axis = -1  # sequences are (T, N, F) or (N, T, F), states (N, F): features last
        return Granularity(GranularityKind.CHANNEL, axis, None, gran.span)
    return gran


def _spot(spans: Mapping[str, Span], *fields: str) -> Span:
    """The first of ``fields`` whose value is written somewhere (built-ins have no span)."""
    for f in fields:
        s = spans.get(f)
        if s is not None and (s.known or s.path):
            return s
    return spans.get(fields[0], UNKNOWN_SPAN)


def validate_fields(
    fields: Mapping[str, Any],
    role: Role | None,
    spans: Mapping[str, Span],
    registries: Registries,
) -> list[Diagnostic]:
    """Check the fields present in ``fields`` (absent ones are not assumed).

    ``role`` None means "not known yet" (a preset): role-specific rules are skipped.
    """
    d: list[Diagnostic] = []
    kind = fields.get("kind")
    bits = fields.get("bits")
    scale = fields.get("scale")
    gran = fields.get("granularity")
    observer = fields.get("observer")
    where = f" on the {role.value}" if role is not None else ""

    # registry-backed names first: they are the most common typo
    if scale is not None and scale != DERIVED_BIAS_SCALE:
        found = registries.scales.lookup(scale, _spot(spans, "scale"))
        if isinstance(found, Diagnostic):
            d.append(found)
    if fields.get("rounding") is not None:
        found = registries.roundings.lookup(fields["rounding"], _spot(spans, "rounding"))
        if isinstance(found, Diagnostic):
            d.append(found)
    obs_info = None
    if observer is not None:
        obs_info, _, obs_diags = validate_observer(observer, spans.get("observer", observer.span), registries)
        d += obs_diags
    fmt = None
    if kind is not None:
        name = kind_name(kind)
        problem = minifloat_problem(name) if looks_like_minifloat(name) else None
        fmt = None if problem else lookup_format(name, registries)
        if problem is not None:
            d.append(Diagnostic.error("E224", problem[0], _spot(spans, "kind"), problem[1]))
        elif fmt is None and name in registries.formats:  # a family entry (minifloat) names no format
            d.append(Diagnostic.error(
                "E224", f"'{name}' is a family of formats: name one", _spot(spans, "kind"),
                f"e.g. {', '.join(MINIFLOAT_PRESETS)}, or fp{{bits}}_e{{E}}m{{M}}[_b{{bias}}][_ieee|_fn|_finite]"))
        elif fmt is None:
            d.append(registries.formats.lookup(name, _spot(spans, "kind")))
    if fmt is not None and not fmt.quantized:
        return d  # a float tensor ignores every other field

    if bits is not None:
        top = MAX_BIAS_BITS if role in (Role.BIAS, None) else MAX_BITS
        if not 1 <= bits <= top:
            d.append(Diagnostic.error(
                "E210", f"bits = {bits}{where} is out of range 1..{top}", _spot(spans, "bits"),
                "biases may use up to 32 bits; every other tensor up to 16" if role is not Role.BIAS else
                "an int32 bias is bits = 32",
            ))
    if fmt is not None and bits is not None and bits >= 1 and fmt.bits_ok(bits) and _degenerate(fmt, bits, fields):
        # int: qrange(1, signed) is {-1, 0} (no positive code) and a narrow 1-bit grid has
        # one code: neither can represent a tensor.  An absent ``signed`` is the built-in true.
        grid = "-1..0" if fields.get("signed") is not False else "0..0"
        d.append(Diagnostic.error(
            "E210", f"a 1-bit {'signed' if grid == '-1..0' else 'narrow'} {fmt.name} quantizer has the code "
            f"range {grid}, which cannot represent a tensor", _spot(spans, "bits", "signed", "narrow_range"),
            "use kind = binary for {-1, +1}, 'unsigned' (without 'narrow') for {0, 1}, or bits >= 2",
        ))
    if fields.get("dynamic") is True and role is not None and role.is_param:
        d.append(Diagnostic.error(
            "E219", f"dynamic applies to activations (input, output), not the {role.value}",
            _spot(spans, "dynamic"),
            f"a {role.value}'s scale already follows its own values until freeze; drop 'dynamic' here",
        ))
    if fmt is not None:
        need = fmt.bits_requirement()
        if need is not None and bits is not None and not fmt.bits_ok(bits):
            d.append(Diagnostic.error(
                "E211", f"{fmt.name} quantizers need bits {need} (got {bits})", _spot(spans, "bits", "kind"),
                f"drop 'bits' (the built-in default fits {fmt.name}) or use kind = int",
            ))
        if not fmt.zero_point and fields.get("symmetric") is False:
            d.append(Diagnostic.error(
                "E211", f"{fmt.name} quantizers are symmetric (they have no zero point)",
                _spot(spans, "symmetric", "kind"), "remove 'symmetric = false' or use kind = int",
            ))
    if isinstance(gran, Granularity) and gran.kind is GranularityKind.GATE and role is not None \
            and not role.is_weight:
        # ``weight`` may reach a recurrent layer's weights: the resolver checks the layer type
        d.append(Diagnostic.error(
            "E212", f"gate granularity is only for a recurrent layer's weights (weight_ih, weight_hh), "
            f"not the {role.value}", _spot(spans, "granularity"),
            "set it in a rule for the recurrent layers (rule type:LSTM { weight = w8(granularity=gate) })",
        ))
    # (checked once the role's fields are resolved: a preset may get `dynamic` from `extends`)
    if isinstance(gran, Granularity) and gran.kind is GranularityKind.TOKEN and role is not None and (
            fields.get("dynamic") is not True or role.is_param):
        d.append(Diagnostic.error(
            "E212", "token granularity is for dynamic activations only (one run-time scale per row of the last "
            "axis)", _spot(spans, "granularity"),
            "add `dynamic` to this quantizer, or use per_tensor / per_channel",
        ))
    if isinstance(gran, Granularity) and gran.kind is GranularityKind.GROUP:
        if role is not None and not role.is_weight:
            d.append(Diagnostic.error(
                "E212", f"group granularity is only for weights, not the {role.value}",
                _spot(spans, "granularity"), "use tensor or channel granularity for activations and bias",
            ))
        if gran.group_size is None or gran.group_size <= 0:
            d.append(Diagnostic.error(
                "E212", f"group size must be a positive integer (got {gran.group_size})",
                _spot(spans, "granularity"),
            ))
    if scale is not None and scale != DERIVED_BIAS_SCALE and fields.get("dynamic") is True:
        if scale in registries.scales and registries.scales.get(scale).extra.get("learned"):
            d.append(Diagnostic.error(
                "E213", f"a learned scale ('{scale}') cannot be dynamic: a dynamic scale is recomputed "
                "from every batch, so there is nothing to learn",
                _spot(spans, "dynamic", "scale"), "drop 'dynamic' or use scale = float or pot",
            ))
    d += _threshold_problems(fields, fmt, role, spans)
    if scale == DERIVED_BIAS_SCALE and role is not None and role is not Role.BIAS:
        d.append(Diagnostic.error(
            "E214", f"scale '{DERIVED_BIAS_SCALE}' is only for the bias, not the {role.value}",
            _spot(spans, "scale"), "use float, pot, learned or learned_pot",
        ))
    if obs_info is not None and kind is not None:
        kinds = obs_info.extra.get("kinds")
        if kinds is not None and kind_name(kind) not in kinds:
            d.append(Diagnostic.error(
                "E215", f"observer '{observer.name}' is only for {' and '.join(kinds)} quantizers, "
                f"not {kind_name(kind)}", _spot(spans, "observer", "kind"),
                "use minmax, ema, histogram, percentile or mse",
            ))
    return d


def _threshold_problems(fields: Mapping[str, Any], fmt: Any, role: Role | None,
                        spans: Mapping[str, Span]) -> list[Diagnostic]:
    """E220: a learned threshold on anything but a signed binary activation."""
    if fields.get("threshold") != "learned":
        return []
    bad = threshold_misuse(fmt, fields.get("signed"), role)
    if bad is None:
        return []
    field, message, hint = bad
    # point at the field that conflicts (a preset's threshold is fine until a cascade
    # makes it unsigned or ternary); a parameter role points at the threshold itself
    return [Diagnostic.error("E220", message, _spot(spans, field, "threshold"), hint)]


def _degenerate(fmt: Any, bits: int, fields: Mapping[str, Any]) -> bool:
    """The code range has no positive code or a single code (an absent ``signed`` is true)."""
    lo, hi = fmt.code_range(bits, fields.get("signed") is not False, bool(fields.get("narrow_range")))
    return hi <= 0 or lo == hi


def derived_bias_problem(input_recipe: QuantizerRecipe | None,
                         weight_recipe: QuantizerRecipe | None, type_name: str | None = None) -> str | None:
    """Why an ``input*weight`` bias scale cannot be formed from these recipes, or None.

    The bias scale is ``s_in · s_w`` per output channel, so the input needs one scale
    and the weight one scale per output channel (or per tensor), both fixed at freeze
    or, for a dynamic input, recomputed together per batch.  The output channels are the
    weight's axis 0, or ``OUT_CHANNEL_AXIS[type_name]`` (a transposed conv: axis 1).
    """
    iq, wq = input_recipe, weight_recipe
    if iq is None or wq is None or not iq.format.quantized or not wq.format.quantized:
        return "its input and its weight must both be quantized"
    if iq.granularity.kind is not GranularityKind.TENSOR:
        return "the input needs one scale (granularity tensor)"
    if wq.granularity.kind is GranularityKind.GROUP:
        return "the weight needs per-tensor or per-channel scales, not groups"
    out_axis = OUT_CHANNEL_AXIS.get(type_name, 0)
    if wq.granularity.kind is GranularityKind.CHANNEL and (wq.granularity.axis or 0) != out_axis:
        return f"per-channel weight scales must be along the output channels (axis {out_axis})"
    if wq.dynamic:
        return "the weight scale must be static (not dynamic)"
    return None


def validate_observer(
    observer: ObserverSpec, span: Span, registries: Registries
) -> tuple[Any, Any, list[Diagnostic]]:
    """The observer's registry entry and validated params object (None when invalid),
    and any E204/E205/E206 about it."""
    found = registries.observers.lookup(observer.name, span)
    if isinstance(found, Diagnostic):
        return None, None, [found]
    params, diags = validate_params(found, observer.param_dict(), span)
    return found, params, diags


def validate_recipe(
    recipe: QuantizerRecipe,
    role: Role | str,
    spans: Mapping[str, Span] | None = None,
    registries: Registries | None = None,
) -> list[Diagnostic]:
    """Validate a fully resolved recipe for ``role``; ``spans`` locate each field's value."""
    regs = registries if registries is not None else builtin_registries()
    fields = {f: getattr(recipe, f) for f in TENSOR_QUANT_FIELDS}
    return validate_fields(fields, Role(role), dict(spans or {}), regs)


def check_shapes(
    recipe: QuantizerRecipe, role: Role, entry: ModuleEntry, span: Span
) -> list[Diagnostic]:
    """Checks that need the parameter's shape: channel axis in range, group size divides rows."""
    gran = recipe.granularity
    if not role.is_param:
        # activation shapes are not indexed, but a convolution's input and output have the
        # rank of its weight (N, C, *spatial); other layers are checked at the first forward
        wshape = entry.param_shapes.get(Role.WEIGHT.value)
        if (gran.kind is GranularityKind.CHANNEL and gran.axis is not None and wshape is not None
                and len(wshape) >= 3 and entry.type_name.startswith("Conv")):
            nd = len(wshape)
            if not -nd <= gran.axis < nd:
                return [Diagnostic.error(
                    "E216", f"channel axis {gran.axis} is out of range for the {nd}-d {role.value} of "
                    f"{entry.type_name} layers", span,
                    f"a {nd}-d tensor has axes {-nd}..{nd - 1}; axis 1 is the channels",
                )]
        return []
    shape = param_shape(entry, role)
    if shape is None:
        return []
    # no layer name in the message: layers sharing a shape share one diagnostic, and the
    # resolver appends the list of layers as a note
    what = f"{role.value} of {entry.type_name} layers with shape {tuple(shape)}"
    if gran.kind is GranularityKind.CHANNEL and gran.axis is not None:
        nd = len(shape)
        if not -nd <= gran.axis < nd:
            return [Diagnostic.error(
                "E216", f"channel axis {gran.axis} is out of range for the {what}", span,
                f"a {nd}-d tensor has axes {-nd}..{nd - 1}; axis {OUT_CHANNEL_AXIS.get(entry.type_name, 0)} "
                "is the output channels",
            )]
    if gran.kind is GranularityKind.GROUP and (gran.group_size or 0) > 0 and len(shape) >= 2 \
            and not recipe.format.ragged_groups:
        row = math.prod(shape[1:])
        if row % gran.group_size:
            # suggest the divisors nearest to what was asked for
            divisors = sorted(g for g in range(2, row + 1) if row % g == 0)
            divisors = sorted(sorted(divisors, key=lambda g: abs(g - gran.group_size))[:6])
            return [Diagnostic.error(
                "E217", f"group size {gran.group_size} does not divide the reduction size {row} "
                f"(= {' x '.join(map(str, shape[1:]))}) of the {role.value} of {entry.type_name} layers",
                span,
                "groups run along each flattened weight row; sizes that fit: "
                + ", ".join(map(str, divisors)),
            )]
    return []

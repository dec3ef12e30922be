"""Model-aware lint: every layer of a resolved :class:`Plan` against a profile.

Per layer (op type from the module class, position from :mod:`qdsl.lint.graph`):

* each quantized role's full recipe against ``profile.caps(role, op, positions)``, each
  finding located where the offending value is written (the plan's provenance: inside
  the preset when it came through one; for a built-in default, at the source that
  introduced the role);
* float left behind: a skipped layer, a weighted layer nobody quantizes, or a float
  weight/input/bias next to quantized ones (E312 on integer-only targets, else E301 -
  E316 for the bias - when the role's ``kinds`` lack ``float``);
* the accumulator (``accumulator.py``): the exact worst case from bit widths and fan-in
  (W313), and with calibrated integer weights the exact reachable extremes (E314), each
  against the target's accumulator and against the spec's own ``accumulator(bits=P)`` when
  that is narrower (the graph exports the spec's width; those findings are located at the
  spec's accumulator setting); the spec's own accumulator against the target's (E315);
* bias rule (E316: its own scale where the target derives ``input*weight`` or the
  reverse, a float bias, a derived scale without quantized operands; the bias's storage
  width is checked against the profile's ``bias.bits``, and its actual values enter the
  tight accumulator bound) and fixed output ranges (E317);
* ops the target lacks, or has only fused (E310/E311), over the traced graph.

Findings with the same cause at the same place are grouped, listing the layers.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs
import numpy as np

from qdsl.lint.accumulator import bits_for, operand_range, operand_ranges, tight_range, worst_case_range
from qdsl.lint.capability import check_quantizer
from qdsl.lint.collect import Collector, violation_diagnostic
from qdsl.lint.fixes import accumulator_fix, use
from qdsl.lint.graph import ModelGraph
from qdsl.lint.ops import WEIGHTED_OPS, module_op
from qdsl.resolve.invariants import bias_scale_problem
from qdsl.resolve.plan import ATTENTION_TYPES, OUT_CHANNEL_AXIS, LayerPlan, Plan, QuantizerRecipe
from qdsl.spec.diagnostics import Diagnostic, Span
from qdsl.spec.model import DERIVED_BIAS_SCALE, Kind, Role, TENSOR_QUANT_FIELDS
from qdsl.spec.profile import CAPS_FIELDS, HardwareProfile, Position

__all__ = ["LayerInts", "check_plan", "tight_layer_range"]


@attrs.frozen
class LayerInts:
    """A calibrated layer's integers, for the tight accumulator bound.

    ``weight`` holds the integer codes, shape ``(out, ...)``; ``weight_zero_point`` is
    subtracted per output channel (scalar or shape ``(out,)``).  ``input_zero_point``
    ``None`` means unknown (both extremes are tried).  ``bias`` is the int32 bias at
    scale input×weight, added into the accumulator.
    """

    weight: Any
    weight_zero_point: Any = 0
    input_zero_point: int | None = None
    bias: Any = None


def _recipe_fields(r: QuantizerRecipe) -> dict[str, Any]:
    return {f: getattr(r, f) for f in TENSOR_QUANT_FIELDS}


def _written(layer: LayerPlan, role: Role, field: str, fallback: Span) -> tuple[Span, str]:
    """Where ``role.field``'s value is written, and how the message names its origin."""
    p = layer.provenance.get((role, field))
    if p is not None and p.set_by.label.startswith("override"):
        return p.set_by.span, p.set_by.label
    if p is not None and p.via:
        return p.via[-1].span, f"from preset '{p.via[-1].label}'"
    if p is not None and p.set_by.span.known:
        return p.set_by.span, ""
    # built-in default: point at the source that quantized this role at all
    for other in ("kind", "bits", "scale", "signed", "granularity", "observer"):
        q = layer.provenance.get((role, other))
        if q is not None and q.set_by.span.known:
            return q.set_by.span, "built-in default"
    return fallback, "built-in default"


def check_plan(
    plan: Plan,
    profile: HardwareProfile,
    graph: ModelGraph,
    ints: Mapping[str, LayerInts],
    pot_scales: frozenset[str],
    *,
    spec_file: str = "<spec>",
    model_label: str = "<model>",
) -> list[Diagnostic]:
    col = Collector()
    where_spec = Span(spec_file)
    memo: dict[tuple, list] = {}
    for layer in plan.layers:
        entry = plan.index.by_name.get(layer.fqn) if plan.index is not None else None
        op = module_op(layer.type_name)
        positions = tuple(p for p, names in ((Position.FIRST, graph.first), (Position.LAST, graph.last))
                          if layer.fqn in names)
        if layer.skip:
            if profile.integer_only:
                p = layer.provenance.get(("layer", "skip"))
                span = p.set_by.span if p is not None else where_spec
                col.add(("E312", "skip", span.location()), Diagnostic.error(
                    "E312", f"skipped layers stay in float, but {profile.name} is integer-only", span,
                    "quantize these layers instead of skipping them"), layer=layer.fqn)
            continue
        weighted = op in WEIGHTED_OPS
        if weighted and not layer.quantized:
            if profile.integer_only:
                col.add(("E312", "float-layer"), Diagnostic.error(
                    "E312", f"weighted layers left in float (no default or rule quantizes them), but "
                    f"{profile.name} is integer-only", where_spec,
                    "add weight/input quantizers to [defaults] or a rule that matches these layers"),
                    layer=layer.fqn)
            continue
        roles = entry.roles if entry is not None else tuple(layer.roles)
        # layers resolved from the same sources share recipe and provenance objects: check once
        key = (layer.type_name, positions, roles, tuple(map(id, layer.roles.values())),
               tuple(map(id, layer.provenance.values())))
        found = memo.get(key)
        if found is None:
            found = memo[key] = _role_findings(layer, roles, op, weighted, positions, profile, pot_scales,
                                               where_spec)
        for k, d in found:
            col.add(k, d, layer=layer.fqn)
        if weighted:
            _check_accumulator(layer, entry, op, profile, ints.get(layer.fqn), col, where_spec)
            _check_bias(layer, op, profile, col, where_spec)
        elif Role.WEIGHT_IH in layer.roles and entry is not None:
            _check_recurrent_accumulators(layer, entry, op, profile, col, where_spec)
        _check_fixed_output(layer, op, profile, col, where_spec)
    _check_ops(plan, graph, profile, col, model_label)
    _check_binary_after_relu(plan, graph, col, where_spec)
    return col.diagnostics()


_NONNEGATIVE_OPS = frozenset({"relu", "relu6"})
# ops that keep a non-negative input non-negative, looked through on the way back
_SIGN_PRESERVING = frozenset({"max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d", "global_avg_pool",
                              "mean", "reshape"})


def _check_binary_after_relu(plan: Plan, graph: ModelGraph, col: Collector, where_spec: Span) -> None:
    """W319: a signed binary input fed only by ReLU/ReLU6 outputs is ``sign(x) = +1`` always.

    ``sign(0) = +1``, so every code is +1: the layer sees a constant input and QAT cannot
    learn (measured: DigitsResNet with xnor-binary stays at chance).  Profile-independent;
    a learned threshold (``threshold = learned``, codes ``x >= t[c]``) makes it meaningful.
    """
    if not graph.traced:
        return
    calls = {n.module: n for n in graph.nodes if n.module is not None}
    for layer in plan.layers:
        x = layer.recipe(Role.INPUT)
        if layer.skip or x is None or x.format.activation_lowering(x.signed) != "bin" or x.threshold == "learned":
            continue
        node = calls.get(layer.fqn)
        if node is None:
            continue
        producers = graph.producers(node, skip_ops=_SIGN_PRESERVING)
        if producers and all(p.op in _NONNEGATIVE_OPS for p in producers):
            span, origin = _written(layer, Role.INPUT, "kind", where_spec)
            col.add(("W319", span.location()), Diagnostic.warning(
                "W319", "a signed binary input after a ReLU is always +1 (sign(0) = +1): the layer sees a "
                f"constant{' (' + origin + ')' if origin else ''}", span,
                "add a learned per-channel threshold: binary(signed, threshold=learned), or use a "
                "sign-symmetric activation before binary layers (e.g. Hardtanh)"), layer=layer.fqn)


def _role_findings(layer: LayerPlan, roles, op, weighted: bool, positions, profile: HardwareProfile,
                   pot_scales: frozenset[str], where_spec: Span) -> list[tuple[tuple, Diagnostic]]:
    """Each role's recipe (or float) against the layer's capabilities, as (key, diagnostic)."""
    out = []
    for role in roles:
        recipe = layer.roles.get(role)
        if recipe is None:
            if role is Role.OUTPUT or (role is Role.INPUT and not weighted):
                continue
            if role in (Role.SCORES, Role.PROBS) and layer.type_name not in ATTENTION_TYPES:
                continue  # a block's softmax roles: most blocks compute no softmax
            known: dict[str, Any] = {"kind": Kind.FLOAT}
        else:
            known = _recipe_fields(recipe)
            gran = known.get("granularity")
            out_axis = OUT_CHANNEL_AXIS.get(layer.type_name)
            if role is Role.WEIGHT and out_axis is not None and gran is not None and gran.axis == out_axis:
                # a profile's channel axes are weight-layout axes with the output channels at
                # 0; a transposed conv keeps them at OUT_CHANNEL_AXIS (its in × out/g × k layout)
                known["granularity"] = attrs.evolve(gran, axis=0)
        caps = profile.caps(role, op, positions)
        for v in check_quantizer(known, caps, role, integer_only=profile.integer_only, pot_scales=pot_scales,
                                 fmt=recipe.format if recipe is not None else None):
            if recipe is None:
                span, origin = _written(layer, role, "kind", where_spec)
                origin = origin if layer.provenance.get((role, "kind")) else "not quantized by any source"
            else:
                span, origin = _written(layer, role, v.field, where_spec)
            ctx = _context(profile, role, op, positions, v.caps_field)
            d = violation_diagnostic(v, role, span, profile, caps, origin=origin, context=ctx)
            out.append(((v.code, v.field, role, span.location(), span.path, v.requested, v.allowed, ctx), d))
    return out


def _shapes(caps, field: str) -> bool:
    return caps is not None and field in CAPS_FIELDS and getattr(caps, field) is not None


def _context(profile: HardwareProfile, role: Role, op: str | None, positions, caps_field: str) -> str:
    """" for conv2d (first_layer)": only the op/positions whose own caps set the violated field."""
    parts = []
    if op is not None and _shapes(profile.op_roles.get(op, {}).get(role), caps_field):
        parts.append(f" for {op}")
    shaped = [p.value for p in positions if _shapes(profile.positions.get(p, {}).get(role), caps_field)]
    if shaped:
        parts.append(f" ({', '.join(shaped)})" if parts else f" for the {' and '.join(shaped)}")
    return "".join(parts)


def _range_text(r: QuantizerRecipe) -> str:
    return r.format.describe(r.bits, r.signed, r.symmetric)


def _check_accumulator(layer: LayerPlan, entry, op: str, profile: HardwareProfile, li: LayerInts | None,
                       col: Collector, where_spec: Span) -> None:
    w, x = layer.roles.get(Role.WEIGHT), layer.roles.get(Role.INPUT)
    hw = profile.accumulator_for(op)
    p_acc = layer.provenance.get(("layer", "accumulator"))
    if p_acc is not None and p_acc.set_by.span.known and hw.bits is not None:
        acc = layer.accumulator
        if acc.bits > hw.bits or (hw.overflow is not None and acc.overflow is not hw.overflow):
            span = p_acc.set_by.span
            what = f"{acc.bits}-bit {acc.overflow.value}"
            col.add(("E315", span.location()), Diagnostic.error(
                "E315", f"the spec's accumulator ({what}) does not match {profile.name}'s "
                f"({hw.bits}-bit {hw.overflow.value if hw.overflow else 'wrap'})", span,
                accumulator_fix(hw.bits, hw.overflow.value if hw.overflow else None, span)),
                layer=layer.fqn)
    if w is not None and x is not None and hw.pair_bits is not None:
        _check_pairs(layer, w, x, hw.pair_bits, profile, col, where_spec)
    # the narrowest accumulator the layer's sums meet: the target's, and the spec's own when
    # it is narrower (the graph exports the spec's width: a 16-bit wrapping spec on a 24-bit
    # target overflows at 16 bits, which is an overflow finding, not only a mismatch)
    limits = []
    if hw.bits is not None:
        limits.append((hw.bits, hw.overflow.value if hw.overflow else "wrap", profile.name, None))
    if p_acc is not None and p_acc.set_by.span.known and layer.accumulator.bits < 64 and (
            hw.bits is None or layer.accumulator.bits < hw.bits):
        acc = layer.accumulator
        limits.append((acc.bits, acc.overflow.value, "the spec's accumulator", p_acc.set_by.span))
    if w is None or x is None or not limits or entry is None or "weight" not in entry.param_shapes:
        return
    wr = operand_range(w.kind, w.bits, w.signed, w.narrow_range, w.symmetric, w.format)
    xr = operand_range(x.kind, x.bits, x.signed, x.narrow_range, x.symmetric, x.format)
    if wr is None or xr is None:
        return
    shape = entry.param_shapes["weight"]
    fan_in = int(math.prod(shape[1:])) if len(shape) > 1 else 1
    if layer.type_name in OUT_CHANNEL_AXIS:  # in × out/groups × k..: at most in/groups · Π k taps reach an output
        fan_in = int(shape[0] // int(entry.attributes.get("groups", 1)) * math.prod(shape[2:]))
    worst = bits_for(*worst_case_range(wr, xr, fan_in))
    w_span, _ = _written(layer, Role.WEIGHT, "bits", where_spec)
    desc = f"weight {_range_text(w)} × input {_range_text(x)}, fan-in {fan_in}"
    tight = None
    if li is not None:
        lo, hi = tight_layer_range(w, x, layer.roles.get(Role.BIAS), li)
        tight = bits_for(lo, hi)
    for bits, overflow, who, acc_span in limits:
        span = acc_span if acc_span is not None else w_span
        has = f"{who} has {bits} ({overflow})"
        if tight is not None:
            if tight > bits:
                key = ("E314", layer.fqn) if acc_span is None else ("E314", layer.fqn, span.location())
                col.add(key, Diagnostic.error(
                    "E314", f"layer {layer.fqn}: with its integer weights the accumulator reaches [{lo}, {hi}], "
                    f"{tight} bits; {has}", span,
                    _acc_fix(w, x, fan_in, bits, profile, op, w_span),
                    notes=(desc + f"; worst case {worst} bits",)), layer=layer.fqn)
            continue
        if worst > bits:
            col.add(("W313", span.location(), worst, fan_in, desc), Diagnostic.warning(
                "W313", f"worst-case accumulator needs {worst} bits ({desc}); {has}",
                span, _acc_fix(w, x, fan_in, bits, profile, op, w_span),
                notes=("lint a calibrated model for the exact bound from the actual weights",)), layer=layer.fqn)


def _check_recurrent_accumulators(layer: LayerPlan, entry, op: str, profile: HardwareProfile,
                                  col: Collector, where_spec: Span) -> None:
    """A recurrent layer's two products per step, worst case: ``x·W_ih`` (fan-in: the
    widest ``weight_ih*`` row, i.e. the input size or hidden·directions) and ``h·W_hh``
    (fan-in: the hidden size)."""
    hw = profile.accumulator_for(op)
    if hw.bits is None:
        return
    for x_role, w_role in ((Role.INPUT, Role.WEIGHT_IH), (Role.HIDDEN, Role.WEIGHT_HH)):
        w, x = layer.roles.get(w_role), layer.roles.get(x_role)
        rows = [s for n, s in entry.param_shapes.items() if n.startswith(w_role.value) and len(s) == 2]
        if w is None or x is None or not rows:
            continue
        wr = operand_range(w.kind, w.bits, w.signed, w.narrow_range, w.symmetric, w.format)
        xr = operand_range(x.kind, x.bits, x.signed, x.narrow_range, x.symmetric, x.format)
        if wr is None or xr is None:
            continue
        fan_in = max(s[1] for s in rows)
        worst = bits_for(*worst_case_range(wr, xr, fan_in))
        if worst <= hw.bits:
            continue
        span, _ = _written(layer, w_role, "bits", where_spec)
        desc = f"{w_role.value} {_range_text(w)} × {x_role.value} {_range_text(x)}, fan-in {fan_in}"
        overflow = hw.overflow.value if hw.overflow else "wrap"
        col.add(("W313", span.location(), worst, fan_in, desc), Diagnostic.warning(
            "W313", f"worst-case accumulator needs {worst} bits ({desc}); {profile.name} has {hw.bits} ({overflow})",
            span, notes=("the bound for one time step's product; the state update adds in float or a wider type",)),
            layer=layer.fqn)


def _check_pairs(layer: LayerPlan, w: QuantizerRecipe, x: QuantizerRecipe, pair_bits: int,
                 profile: HardwareProfile, col: Collector, where_spec: Span) -> None:
    """Kernels such as x86 VPMADDUBSW multiply *raw* codes (u8 × s8; zero points are
    corrected afterwards through row sums) and add two adjacent products into a saturating
    int16: the pair sum's range is twice the raw product's extremes."""
    if not (w.format.affine and x.format.affine):
        return
    raw = [a * b for a in (w.qmin, w.qmax) for b in (x.qmin, x.qmax)]
    need = bits_for(2 * min(raw), 2 * max(raw))
    if need <= pair_bits:
        return
    span, _ = _written(layer, Role.INPUT, "bits", where_spec)
    fix = "reduce the activations by a bit (PyTorch's reduce_range)"
    for b in range(x.bits - 1, 1, -1):
        xmin, xmax = x.format.code_range(b, x.signed, False)
        pr = [a * c for a in (w.qmin, w.qmax) for c in (xmin, xmax)]
        if bits_for(2 * min(pr), 2 * max(pr)) <= pair_bits:
            fix = use("bits", b, span, Role.INPUT) + " for the input (PyTorch's reduce_range)"
            break
    col.add(("W318", span.location(), need), Diagnostic.warning(
        "W318", f"two adjacent products of weight {_range_text(w)} × input {_range_text(x)} codes sum to "
        f"{need} bits; {profile.name}'s {pair_bits}-bit pair intermediate saturates", span, fix,
        notes=("CPUs with VNNI accumulate without the saturating pair step",)), layer=layer.fqn)


def tight_layer_range(w: QuantizerRecipe, x: QuantizerRecipe, b: QuantizerRecipe | None,
                      li: LayerInts) -> tuple[int, int]:
    """Exact accumulator extremes of one calibrated layer over every input in range."""
    wi = np.asarray(li.weight).astype(np.int64)
    wi = wi.reshape(wi.shape[0], -1)
    zp = np.asarray(li.weight_zero_point, dtype=np.int64)
    wi = wi - (zp if zp.shape == wi.shape else zp.reshape(-1, 1))  # per element (groups) or per row
    if li.input_zero_point is not None and x.format.affine:
        x_ranges = [(x.qmin - li.input_zero_point, x.qmax - li.input_zero_point)]
    else:
        x_ranges = list(operand_ranges(x.kind, x.bits, x.signed, x.narrow_range, x.symmetric, x.format))
    # only a bias at scale input*weight is added in accumulator units
    bias = li.bias if b is not None and b.scale == DERIVED_BIAS_SCALE else None
    return tight_range(wi, x_ranges, bias)


def _acc_fix(w: QuantizerRecipe, x: QuantizerRecipe, fan_in: int, acc_bits: int, profile: HardwareProfile,
             op: str, span: Span) -> str:
    xr = operand_range(x.kind, x.bits, x.signed, x.narrow_range, x.symmetric, x.format)
    allowed = profile.caps(Role.WEIGHT, op).bits or tuple(range(1, w.bits))
    if w.format.affine:
        for b in sorted((b for b in allowed if b < w.bits), reverse=True):
            wr = operand_range(w.kind, b, w.signed, w.narrow_range, w.symmetric, w.format)
            if bits_for(*worst_case_range(wr, xr, fan_in)) <= acc_bits:
                return use("bits", b, span, Role.WEIGHT) + " for the weight (worst case then fits)"
    wr = operand_range(w.kind, w.bits, w.signed, w.narrow_range, w.symmetric, w.format)
    per_term = max(abs(a * b) for a in wr for b in xr) or 1
    max_fan = ((1 << (acc_bits - 1)) - 1) // per_term
    return f"keep the fan-in at most {max_fan} (split the layer), or narrow the weights/inputs"


def _check_bias(layer: LayerPlan, op: str, profile: HardwareProfile, col: Collector, where_spec: Span) -> None:
    b = layer.roles.get(Role.BIAS)
    if b is None or not b.format.affine:
        return
    problem = bias_scale_problem(layer.roles, layer.type_name)  # the one rule (qdsl/resolve/invariants.py)
    if problem is not None:
        if problem.missing:  # the resolver rejects this too (E214); kept for plans built by hand
            span, _ = _written(layer, Role.BIAS, "scale", where_spec)
            col.add(("E316", "derived", span.location()), Diagnostic.error(
                "E316", f"bias scale '{DERIVED_BIAS_SCALE}' needs the {' and '.join(problem.missing)} quantized", span,
                "quantize the layer's input and weight, or give the bias its own scale"), layer=layer.fqn)


def _check_fixed_output(layer: LayerPlan, op: str | None, profile: HardwareProfile, col: Collector,
                        where_spec: Span) -> None:
    fixed = profile.fixed_outputs.get(op) if op else None
    out = layer.roles.get(Role.OUTPUT)
    if fixed is None or out is None:
        return
    wrong = []
    if not out.format.affine or out.bits != fixed.bits:
        wrong.append(("bits", fixed.bits))
    if out.signed != fixed.signed:
        wrong.append(("signed", fixed.signed))
    if fixed.zero_point != 0 and out.symmetric:
        wrong.append(("symmetric", False))
    for field, value in wrong:
        span, _ = _written(layer, Role.OUTPUT, field, where_spec)
        fix = use(field, value, span, Role.OUTPUT)
        col.add(("E317", op, field, span.location()), Diagnostic.error(
            "E317", f"{profile.name} fixes the {op} output at scale {fixed.scale:g}, zero point {fixed.zero_point} "
            f"({fixed.bits}-bit {'signed' if fixed.signed else 'unsigned'}); output.{field} = "
            f"{_fmt(getattr(out, field))} cannot express it", span, fix), layer=layer.fqn)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(getattr(v, "value", v))


def _check_ops(plan: Plan, graph: ModelGraph, profile: HardwareProfile, col: Collector, model_label: str) -> None:
    folded = frozenset({"batch_norm"}) if plan.fold_bn else frozenset()
    for node in graph.nodes:
        if node.op is None or node.op in folded or profile.supports_op(node.op):
            continue
        span = Span(model_label, path=node.label)
        heads = profile.fusion_heads(node.op)
        if heads:
            producers = graph.producers(node, folded)
            if producers and all(p.op in heads for p in producers):
                continue
            col.add(("E311", node.op), Diagnostic.error(
                "E311", f"{profile.name} runs '{node.op}' only fused after {', '.join(dict.fromkeys(heads))}",
                span, f"restructure so each '{node.op}' directly follows one of those ops"), layer=node.label)
            continue
        col.add(("E310", node.op), Diagnostic.error(
            "E310", f"op '{node.op}' is not supported by {profile.name}", span,
            f"{profile.name} supports: {', '.join(profile.ops or ())}"
            + ("; or run this part of the model on the host" if not profile.integer_only else "")),
            layer=node.label)

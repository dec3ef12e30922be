"""``resolve(model, spec) -> Plan``: matching, the field-by-field cascade, provenance.

Which modules get a :class:`LayerPlan`: every module whose class is in
``WEIGHTED_TYPES`` (``defaults`` apply to those; a weighted layer nobody quantizes is
still listed, in float, so lint can see it) and every module a rule applies to
(containers too: an ``output`` quantizer on a residual block is what makes its ``+``
integer-exportable).  A rule *applies* to a module it matches when it sets ``skip``,
an accumulator, or a role the module has (weight/bias need the parameter; input and
output every module has).

The cascade (DESIGN.md §2), decided separately for every (role, field) of every layer:
built-in default < ``defaults`` < type rules < glob/regex rules < exact-name rules <
overrides.  A rule's level on a layer is that of its most specific target that matched
the layer.  Within one level the higher ``priority`` wins (absent = 0); two rules at the
same level and priority that give one field *different* values on a layer is an error
(E209) naming both; equal values do not conflict (the later rule is recorded as the
setter, the other as overridden).  A rule's role value contributes its whole preset
chain plus its own fields (``presets.py``).

A role is quantized only when some source that applies mentions it (overrides do not
count: they only change roles that end up quantized).  The winning ``skip = true`` puts
all roles of the layer in float; a winning ``kind = float`` puts that role in float.
Then overrides apply: each field an override states (a preset it names contributes its
expanded fields) replaces the cascaded value, fields it does not state keep theirs, and
the replaced value is recorded as overridden.  Built-in defaults fill the rest
(``validate.py``), and the recipe is validated with every error pointing at the span where the offending value is
written.  Layers that receive the same sources resolve identically, so the cascade runs
once per distinct combination (memoized) and only shape checks run per layer - this is
what keeps a 10,000-module model well under the 0.5 s budget (``benchmarks/resolve.py``).

Records filled besides the recipes: ``LayerPlan.provenance`` keyed by ``(role, field)``
for every field of every quantized role (and ``(role, "kind")`` for a role a source
set to float), plus ``("layer", "skip")`` and ``("layer", "accumulator")``;
``LayerPlan.matched_rules`` and ``Plan.rule_matches`` list the rules that *apply* to a
layer / the layers each rule applies to, in model order.

Errors: every problem is collected and raised as one ``SpecError``, in file order.  A
problem that several layers share (a conflict, an invalid combination, a group size
that does not divide a shape) is one diagnostic with an "on layers ..." note.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import attrs

from qdsl.parse import gc_paused
from qdsl.resolve.check import Body, Prepared, compose_if_needed, dedupe, prepare
from qdsl.resolve.explain import format_value
from qdsl.resolve.invariants import bias_scale_problem
from qdsl.resolve.plan import (
    FieldProvenance,
    LayerPlan,
    ModelIndex,
    ModuleEntry,
    Origin,
    Plan,
    QuantizerRecipe,
    RuleMatch,
    WEIGHTED_TYPES,
)
from qdsl.resolve.positions import trace_calls
from qdsl.resolve.presets import Contribution
from qdsl.resolve.targets import Level, TargetMatcher, unmatched_hint
from qdsl.resolve.validate import (
    builtin_value,
    check_shapes,
    fill_channel_axis,
    validate_fields,
    validate_observer,
)
from qdsl.spec.diagnostics import Diagnostic, QdslError, Span, SpecError
from qdsl.spec.formats import builtin_format, format_of, is_float
from qdsl.spec.model import (
    DERIVED_BIAS_SCALE,
    TENSOR_QUANT_FIELDS,
    Accumulator,
    GranularityKind,
    Kind,
    QuantSpec,
    Role,
    TargetKind,
    attrs_frozendict,
)
from qdsl.spec.registry import Registries

__all__ = ["resolve", "load_for_resolve", "index_of"]

_BUILTIN = Origin("built-in default")
_PARAM_ROLES = (Role.WEIGHT, Role.BIAS)
_RECURRENT_ROLES = (Role.WEIGHT_IH, Role.WEIGHT_HH, Role.HIDDEN, Role.CELL)
_Cand = tuple[Level, Body, Contribution]


def index_of(model_or_index: Any, trace: bool = False) -> ModelIndex:
    """A :class:`ModelIndex` as given, or built from an ``nn.Module`` (duck-typed);
    ``trace``: record the forward call order too (for ``@first`` / ``@last``)."""
    if isinstance(model_or_index, ModelIndex):
        return model_or_index
    if type(model_or_index).__module__.startswith("torch.jit"):
        # scripted/traced: every module is a RecursiveScriptModule, so type rules and
        # defaults would silently reach nothing (duck-typed: this layer never imports torch)
        raise QdslError(f"qdsl needs an eager nn.Module, got a TorchScript {type(model_or_index).__name__}: "
                        "resolve and apply the eager model before scripting or tracing it")
    if hasattr(model_or_index, "named_modules"):
        calls, note = trace_calls(model_or_index) if trace else (None, "")
        return ModelIndex.from_module(model_or_index, calls=calls, order_note=note)
    raise QdslError(f"qdsl needs an nn.Module (or a ModelIndex) to resolve against, got {type(model_or_index).__name__}")


def load_for_resolve(spec: QuantSpec | str | Path, overrides: Any = None) -> QuantSpec:
    """A composed spec: read a path with ``qdsl.parse.load_spec``, or compose a record."""
    if isinstance(spec, (str, Path)):
        from qdsl.parse import load_spec  # lazy: the parse layer is optional for records

        return load_spec(spec, overrides)
    if not isinstance(spec, QuantSpec):
        raise QdslError(f"a spec is a path to a .qspec / .qspec.toml file or a QuantSpec, got {type(spec).__name__}")
    if overrides:
        from qdsl.parse import compose

        return compose(spec, overrides)
    return compose_if_needed(spec)


def resolve(
    model_or_index: Any,
    spec: QuantSpec | str | Path,
    *,
    registries: Registries | None = None,
    overrides: Any = None,
) -> Plan:
    """Resolve ``spec`` against a model; raise :class:`SpecError` with every problem found."""
    spec = load_for_resolve(spec, overrides)
    with gc_paused():
        positional = any(t.kind is TargetKind.POSITION for r in spec.rules for t in r.targets)
        index = index_of(model_or_index, trace=positional)
        return _Resolver(prepare(spec, registries), index).run()


def _drop_shadowed_threshold(won: dict, written: dict, rank: dict, kind: Any, regs: Any) -> None:
    """A learned threshold belongs to signed binary activations: when a more specific
    source than the one that set it makes the quantizer another kind (a rule's ``input =
    a8`` over a thresholded ``defaults`` input) or unsigned, it does not apply there and
    falls back to ``none``.  Written at the same level or below (``abin(unsigned)`` on a
    thresholded ``abin``), it stays, and validation reports E220."""
    t = won.get("threshold")
    if t is None or t.value != "learned":
        return
    signed = won["signed"].value if "signed" in won else True
    fmt = format_of(kind, regs, builtin_format(Kind.INT))
    for field, bad in (("kind", not fmt.learned_threshold), ("signed", signed is False)):
        if bad and field in rank and rank[field] > rank["threshold"]:
            by = won[field].set_by
            won["threshold"] = FieldProvenance("none", Origin(f"built-in default (the {field} set by {by.label} "
                                                              "takes no threshold)", by.span),
                                               (), ((t.set_by, t.value),) + t.overridden)
            written.pop("threshold", None)
            return


@attrs.frozen
class _Outcome:
    """How one combination of sources resolves (shared by every layer that has it)."""

    roles: Mapping[Role, QuantizerRecipe | None]
    provenance: Mapping[tuple[Any, str], FieldProvenance]
    skip: bool
    accumulator: Accumulator
    applied: tuple[int, ...]
    gran_spans: dict[Role, Span]
    diagnostics: list[Diagnostic]
    conflicts: list[tuple[Any, ...]]


class _Resolver:
    def __init__(self, prep: Prepared, index: ModelIndex):
        self.prep = prep
        self.index = index
        self.regs = prep.registries
        self._memo: dict[tuple[Any, ...], _Outcome] = {}
        self._observers: dict[Any, Any] = {}
        # diagnostic (without layer names) -> layers it occurred on, in model order
        self._layer_diags: dict[Diagnostic, list[str]] = {}
        self._conflicts: dict[tuple[Any, ...], tuple[Diagnostic, list[str]]] = {}
        self._e203_rules: set[int] = set()

    # -- matching -------------------------------------------------------------------
    def _match(self) -> tuple[dict[str, dict[int, Level]], list[Diagnostic], list[int]]:
        per_fqn: dict[str, dict[int, Level]] = {}
        diags: list[Diagnostic] = []
        matched_any = []
        matcher = TargetMatcher(self.index)
        for i, compiled in enumerate(self.prep.targets):
            rule = self.prep.spec.rules[i]
            hits = [matcher.match(ct) for ct in compiled]
            for ct, fqns in zip(compiled, hits):
                if not fqns and not rule.optional:
                    diags.append(Diagnostic.error(
                        "E201", f"target '{ct.target.text}' of {rule.describe()} matches no module",
                        ct.target.span, unmatched_hint(ct.target, self.index),
                        "add 'optional' to the rule if matching nothing is expected",
                    ))
                for fqn in fqns:
                    levels = per_fqn.setdefault(fqn, {})
                    if levels.get(i, Level.BUILTIN) < ct.level:
                        levels[i] = ct.level
            if any(hits):
                matched_any.append(i)
        return per_fqn, diags, matched_any

    # -- the run ----------------------------------------------------------------------
    def run(self) -> Plan:
        per_fqn, diags, matched_any = self._match()
        layers = []
        applied_to: dict[int, list[str]] = {i: [] for i in range(len(self.prep.rules))}
        for entry in self.index.entries:
            matches = per_fqn.get(entry.fqn)
            weighted = entry.type_name in WEIGHTED_TYPES
            if not weighted and not matches:
                continue
            roles = entry.roles
            # leaf and own parameters: an optional rule naming a parameterless container (_outcome)
            key = (entry.type_name, roles, entry.leaf, not entry.param_shapes,
                   tuple(sorted(matches.items())) if matches else ())
            out = self._memo.get(key)
            if out is None:
                out = self._memo[key] = self._outcome(entry, weighted, key[-1])
            for d in out.diagnostics:
                self._layer_diags.setdefault(d, []).append(entry.fqn)
            if not weighted and not out.applied:
                continue
            for c in out.conflicts:
                self._note_conflict(c, entry.fqn)
            for i in out.applied:
                applied_to[i].append(entry.fqn)
            for role, recipe in out.roles.items():
                if recipe is not None and recipe.granularity.kind is not GranularityKind.TENSOR:
                    for d in check_shapes(recipe, role, entry, out.gran_spans.get(role, Span())):
                        self._layer_diags.setdefault(d, []).append(entry.fqn)
            layers.append(LayerPlan(
                entry.fqn, entry.type_name, out.roles, out.skip, out.accumulator, out.provenance, out.applied,
            ))
        diags += self._rule_diags(applied_to, matched_any)
        diags += [self._with_layers(d, fqns) for d, fqns in self._layer_diags.items()]
        diags += [self._with_layers(d, fqns) for d, fqns in self._conflicts.values()]
        # one list in file order (a stable sort keeps same-place problems in finding order)
        all_diags = dedupe(list(self.prep.diagnostics) + diags)
        all_diags.sort(key=lambda d: (d.span.file, d.span.line, d.span.col))
        if any(d.is_error for d in all_diags):
            raise SpecError(all_diags)
        matches = tuple(RuleMatch(i, tuple(f)) for i, f in applied_to.items())
        return Plan(self.prep.spec, tuple(layers), matches, self.index)

    def _rule_diags(self, applied_to: dict[int, list[str]], matched_any: list[int]) -> list[Diagnostic]:
        out = []
        for i in matched_any:
            rule, body = self.prep.spec.rules[i], self.prep.rules[i]
            # a rule already reported by E203 (exact name without that tensor) is not repeated
            if applied_to[i] or rule.optional or i in self._e203_rules:
                continue
            missing = " or ".join(r.value for r in body.roles)
            out.append(Diagnostic.error(
                "E202", f"{body.label} matches modules but applies to none of them: none has a {missing}",
                rule.span, "target layers that have these tensors, or add 'optional'",
            ))
        return out

    @staticmethod
    def _with_layers(d: Diagnostic, fqns: list[str]) -> Diagnostic:
        names = [f or "<root>" for f in fqns]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return attrs.evolve(d, notes=d.notes + (f"on layer{'s' if len(names) > 1 else ''} {shown}",))

    def _note_conflict(self, c: tuple[Any, ...], fqn: str) -> None:
        role, field, (lvl, a, ca), (_, b, cb) = c
        key = (role, field, a.order, b.order)
        if key not in self._conflicts:
            what = f"{role.value}.{field}" if isinstance(role, Role) else field
            d = Diagnostic.error(
                "E209",
                f"{b.label} and {a.label} both set {what} at the same specificity ({lvl.title}) "
                f"to different values: {format_value(cb.value)} vs {format_value(ca.value)}",
                ca.span,
                "give the rule that should win a higher 'priority', or make one target more specific",
                notes=(f"{b.label} sets it at {cb.span.location()}", f"{a.label} sets it at {ca.span.location()}"),
            )
            self._conflicts[key] = (d, [])
        self._conflicts[key][1].append(fqn)

    # -- one combination of sources ---------------------------------------------------
    def _outcome(self, entry: ModuleEntry, weighted: bool, matches: tuple[tuple[int, Level], ...]) -> _Outcome:
        has = set(entry.roles)
        has |= {r.refines for r in entry.roles if r.refines is not None}  # ``weight`` sets weight_ih/_hh
        diags: list[Diagnostic] = []
        conflicts: list[tuple[Any, ...]] = []
        bodies: list[tuple[Level, Body]] = [(Level.DEFAULTS, self.prep.defaults)] if weighted else []
        applied = []
        for i, lvl in matches:
            b = self.prep.rules[i]
            # an exact name, or a class (every instance of which lacks a weight kernel),
            # that cannot hold the tensor is the same mistake, reported the same way;
            # except an optional rule naming a container with no parameter of its own
            # (MobileNetV2's ``features.0`` is a ConvBN-ReLU6 block where a smaller net's
            # is a conv): that name is just not the layer the rule is for, as a name
            # matching nothing is not (LSTM-like layers with kernels stay E203)
            container = self.prep.spec.rules[i].optional and not entry.leaf and not entry.param_shapes
            if not container and (lvl is Level.EXACT or lvl is Level.TYPE):
                strict = lvl is Level.EXACT or Role.WEIGHT not in has
                for r in b.roles:
                    # a class-wide recurrent role on a class that is not recurrent at all
                    # (type:Linear { weight_hh = ... }) is the same mistake
                    if r not in has and (strict or (r in _RECURRENT_ROLES and Role.WEIGHT_IH not in has)):
                        self._e203_rules.add(i)
                        diags.append(self._e203(b, r, entry))
            if b.skip is not None or b.accumulator is not None or any(r in has for r in b.roles):
                applied.append(i)
                bodies.append((lvl, b))
        prov: dict[tuple[Any, str], FieldProvenance] = {}
        ov = self.prep.overrides

        def layer_field(name: str, default: Any) -> Any:
            cands = [(lvl, b, getattr(b, name)) for lvl, b in bodies if getattr(b, name) is not None]
            if getattr(ov, name) is not None:
                cands.append((Level.OVERRIDE, ov, getattr(ov, name)))
            if not cands:
                prov[("layer", name)] = FieldProvenance(default, _BUILTIN)
                return default
            p, _ = self._pick(cands, "layer", name, conflicts)
            prov[("layer", name)] = p
            return p.value

        skip = bool(layer_field("skip", False))
        acc = layer_field("accumulator", Accumulator())
        roles: dict[Role, QuantizerRecipe | None] = {}
        gran_spans: dict[Role, Span] = {}
        for role in entry.roles:
            parent = entry.inherits(role)
            srcs = [(lvl, b) for lvl, b in bodies if role in b.roles or (parent is not None and parent in b.roles)]
            if skip or not srcs:
                roles[role] = None
                continue
            roles[role] = self._role(role, srcs, prov, conflicts, diags, gran_spans, entry.type_name, parent)
        problem = bias_scale_problem(roles, entry.type_name)  # the one rule (qdsl/resolve/invariants.py)
        if problem is not None:
            p = prov[(Role.BIAS, "scale")]
            if problem.missing:
                recurrent = Role.WEIGHT_IH in roles  # two accumulators: x·W_ih and h·W_hh
                need = "input and weight_ih, hidden and weight_hh" if recurrent else "input and weight"
                diags.append(Diagnostic.error(
                    "E214", f"bias scale '{DERIVED_BIAS_SCALE}' needs the layer's {need} "
                    f"quantized, but its {' and '.join(problem.missing)} stays in float",
                    p.via[-1].span if p.via else p.set_by.span,
                    f"quantize the {need} of these layers, or give the bias its own scale",
                ))
            else:
                diags.append(Diagnostic.error(
                    "E214", f"bias scale '{DERIVED_BIAS_SCALE}' cannot be formed on these layers: {problem.reason}",
                    p.via[-1].span if p.via else p.set_by.span,
                    "change the input/weight granularity, or give the bias its own scale",
                ))
        # frozen once here so every layer with this outcome shares the maps (no per-layer copies)
        return _Outcome(
            attrs_frozendict(roles), attrs_frozendict(prov), skip, acc, tuple(applied), gran_spans, diags, conflicts
        )

    @staticmethod
    def _e203(b: Body, r: Role, entry: ModuleEntry) -> Diagnostic:
        kernels = [n for n, shape in entry.param_shapes.items() if len(shape) >= 2]
        notes = ()
        if kernels and not {Role.WEIGHT, Role.WEIGHT_IH} & set(entry.roles):  # a class qdsl has no weight role for
            shown = ", ".join(kernels[:4]) + (" ..." if len(kernels) > 4 else "")
            notes = (f"{entry.type_name} keeps its weights in {shown}: "
                     f"qdsl does not quantize {entry.type_name} weights yet",)
        return Diagnostic.error(
            "E203", f"{b.label} sets the {r.value} of a {entry.type_name}, which has no "
            f"{r.value} parameter", b.role_spans.get(r, b.span),
            f"{entry.type_name} can take: {', '.join(x.value for x in entry.roles)}", notes=notes,
        )

    def _role(
        self,
        role: Role,
        srcs: list[tuple[Level, Body]],
        prov: dict[tuple[Any, str], FieldProvenance],
        conflicts: list[tuple[Any, ...]],
        diags: list[Diagnostic],
        gran_spans: dict[Role, Span],
        type_name: str,
        parent: Role | None = None,
    ) -> QuantizerRecipe | None:
        """Cascade, override, fill and validate one role; None when it ends up in float."""
        won: dict[str, FieldProvenance] = {}
        written: dict[str, Span] = {}
        rank: dict[str, tuple[int, int]] = {}  # the winner's (level, refining role)
        for field in TENSOR_QUANT_FIELDS:
            cands = []
            for lvl, b in srcs:
                # a refining role (weight_ih) beats the role it refines (weight) at one level
                if field in b.roles.get(role, {}):
                    cands.append((lvl, b, b.roles[role][field], 1, role))
                elif parent is not None and field in b.roles.get(parent, {}):
                    cands.append((lvl, b, b.roles[parent][field], 0, parent))
            if cands:
                won[field], written[field] = self._pick(cands, role, field, conflicts, with_span=True)
                rank[field] = max((c[0], c[3]) for c in cands)
        kind = won["kind"].value if "kind" in won else Kind.INT
        if is_float(kind):
            prov[(role, "kind")] = won["kind"]
            return None
        # overrides only touch roles that are quantized at this point
        ov_fields = dict(self.prep.overrides.roles.get(parent, {})) if parent is not None else {}
        ov_fields.update(self.prep.overrides.roles.get(role, {}))
        for field, c in ov_fields.items():
            below = won.get(field)
            lower: tuple[tuple[Origin, Any], ...] = ()
            if below is not None:
                via = " via " + " > ".join(v.label for v in below.via) if below.via else ""
                lower = ((Origin(below.set_by.label + via, written[field]), below.value),) + below.overridden
            label = f"override {role.value}.{field}={format_value(c.value)}"
            at = c.span if not c.via else self.prep.overrides.role_spans.get(role, c.span)
            won[field] = FieldProvenance(c.value, Origin(label, at), c.via, lower)
            written[field] = c.span
            rank[field] = (Level.OVERRIDE, 1)
        kind = won["kind"].value if "kind" in won else Kind.INT
        if is_float(kind):
            prov[(role, "kind")] = won["kind"]
            return None
        _drop_shadowed_threshold(won, written, rank, kind, self.regs)
        scale = won["scale"].value if "scale" in won else None
        values: dict[str, Any] = {}
        for field in TENSOR_QUANT_FIELDS:
            if field not in won:
                won[field] = FieldProvenance(builtin_value(field, role, kind, scale, self.regs), _BUILTIN)
            values[field] = won[field].value
        gran = fill_channel_axis(values["granularity"], role, type_name)
        if gran is not values["granularity"]:
            values["granularity"] = gran
            won["granularity"] = attrs.evolve(won["granularity"], value=gran)
        gran_spans[role] = written.get("granularity", Span())
        diags += validate_fields(values, role, written, self.regs)
        if gran.kind is GranularityKind.GATE and role is Role.WEIGHT:  # recurrent layers have weight_ih/_hh
            diags.append(Diagnostic.error(
                "E212", f"gate granularity is only for a recurrent layer's weights, not a {type_name}'s",
                gran_spans[role], "set it in a rule for the recurrent layers "
                "(rule type:LSTM { weight = w8(granularity=gate) })"))
        obs_span = written.get("observer", values["observer"].span)
        params = self._observer_params(values["observer"], obs_span)
        for field in TENSOR_QUANT_FIELDS:
            prov[(role, field)] = won[field]
        return QuantizerRecipe(**values, observer_params=params, format=format_of(kind, self.regs, builtin_format(Kind.INT)))

    def _observer_params(self, observer: Any, span: Span) -> Any:
        if observer not in self._observers:
            _, params, _ = validate_observer(observer, span, self.regs)  # errors come from validate_fields
            self._observers[observer] = params
        return self._observers[observer]

    @staticmethod
    def _pick(cands: list[_Cand], role: Any, field: str, conflicts: list, with_span: bool = False):
        """The winning candidate's provenance (and written span); records same-level conflicts."""
        # role candidates carry (refining?, the role written): level, then the more
        # specific role, then priority, then file order
        cands.sort(key=lambda c: (c[0], c[3] if len(c) > 3 else 0, c[1].priority, c[1].order))
        win = cands[-1]
        lvl, body, c = win[:3]
        sub = win[3] if len(win) > 3 else 0
        for other in cands[:-1]:
            if (other[0] == lvl and other[1].priority == body.priority and other[2].value != c.value
                    and (other[3] if len(other) > 3 else 0) == sub):
                conflicts.append((role, field, win[:3], other[:3]))
        overridden = tuple(c.shadowed) + tuple(
            (Origin(b.label + (" via " + " > ".join(v.label for v in oc.via) if oc.via else ""), oc.span), oc.value)
            for _, b, oc, *_ in reversed(cands[:-1])
        )
        written_role = win[4] if len(win) > 4 else role
        span = body.set_by_span(written_role, c) if isinstance(role, Role) else c.span
        p = FieldProvenance(c.value, Origin(body.label, span), c.via, overridden)
        return (p, c.span) if with_span else (p, None)

"""The resolver's output: a frozen, fully explicit ``Plan``.

Nothing downstream (patch, calibrate, export, lint) re-reads the spec: every quantized
tensor of every layer has a :class:`QuantizerRecipe` in which every field is set, and
every field records where its value came from (:class:`FieldProvenance`), which is what
``qdsl explain`` prints.  A role mapped to ``None`` stays in float.

The :class:`ModelIndex` is a torch-free description of a model (dotted names, class
names, parameter shapes, a few constructor attributes), so matching is testable without
torch; ``ModelIndex.from_module`` builds it from an ``nn.Module`` by duck typing.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import attrs

from qdsl.spec.diagnostics import Span, UNKNOWN_SPAN
from qdsl.spec.formats import NumberFormat, builtin_format
from qdsl.spec.model import (
    Accumulator,
    Granularity,
    Kind,
    ObserverSpec,
    QuantSpec,
    Role,
    Rule,
    attrs_frozendict,
)

__all__ = [
    "ModuleEntry",
    "ModelIndex",
    "QuantizerRecipe",
    "Origin",
    "FieldProvenance",
    "LayerPlan",
    "RuleMatch",
    "Plan",
    "WEIGHTED_TYPES",
    "OUT_CHANNEL_AXIS",
    "MODULE_ATTRS",
    "RECURRENT_TYPES",
    "ATTENTION_TYPES",
    "param_shape",
]

RECURRENT_TYPES = ("LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell")
"""Recurrent classes qdsl quantizes (qdsl.patch.recurrent): roles ``weight_ih``,
``weight_hh`` (both set by ``weight``), ``bias``, ``input``, ``hidden`` (set by
``input`` too), ``cell`` (LSTM and LSTMCell) and ``output``."""

ATTENTION_TYPES = ("MultiheadAttention",)
"""Attention classes qdsl quantizes (qdsl.patch.attention): roles ``weight`` and ``bias``
(its ``in_proj_weight``/``in_proj_bias``, one proxy per q/k/v slice), ``input`` (query,
key and value), ``q``, ``k``, ``v``, ``scores``, ``probs`` (each set by ``input`` too) and
``output``.  Its ``out_proj`` is a Linear child (class ``NonDynamicallyQuantizableLinear``),
matched and quantized as a Linear."""

WEIGHTED_TYPES = (("Linear", "Conv1d", "Conv2d", "ConvTranspose1d", "ConvTranspose2d") + RECURRENT_TYPES
                  + ATTENTION_TYPES + ("NonDynamicallyQuantizableLinear",))
"""Module classes that ``defaults`` apply to (layers with a weight, and bias)."""

OUT_CHANNEL_AXIS = {"ConvTranspose1d": 1, "ConvTranspose2d": 1}
"""The weight axis of the output channels where it is not 0: a transposed convolution's
weight is ``in × out/groups × k..``.  ``channel`` granularity without an axis means this
axis for the weight (and bias) of these classes (per output channel, what an integer
accumulator needs)."""

MODULE_ATTRS = (
    "in_features",
    "out_features",
    "in_channels",
    "out_channels",
    "kernel_size",
    "stride",
    "padding",
    "output_padding",
    "dilation",
    "groups",
    "input_size",
    "hidden_size",
    "num_layers",
    "bidirectional",
    "proj_size",
)
"""Constructor attributes copied into the index (lint derives fan-in from them)."""


def _frozen_map(value: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """Freeze a mapping; an already frozen one is shared, not copied (the resolver hands
    the same read-only provenance map to every layer that resolved identically)."""
    return value if isinstance(value, attrs_frozendict) else attrs_frozendict(value)


def _plain_attr(mod: Any, name: str, default: Any) -> Any:
    """``getattr(mod, name, default)`` for plain instance/class attributes, without going
    through ``nn.Module.__getattr__`` for missing names (an exception per miss made
    indexing a 10,000-module model take most of resolve's time budget).  Parameters,
    buffers and submodules are never ints/tuples/strs/flags, so skipping them changes
    nothing for the attributes read here."""
    d = vars(mod)
    if name in d:
        return d[name]
    if hasattr(type(mod), name):  # class attribute or property: read it normally
        return getattr(mod, name, default)
    return default


@attrs.frozen
class ModuleEntry:
    """One module of a model, without torch."""

    fqn: str
    type_name: str
    param_shapes: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict, converter=attrs_frozendict)
    attributes: Mapping[str, Any] = attrs.field(factory=dict, converter=attrs_frozendict)
    leaf: bool = True

    @property
    def roles(self) -> tuple[Role, ...]:
        """The roles this module can have quantized.

        Weight and bias roles need a weight *kernel* (a parameter named ``weight`` with
        at least 2 dimensions: Linear, ConvNd, Embedding, user layers).  Normalization
        layers' 1-D ``weight``/``bias`` are per-channel affine terms, not quantization
        targets: BN folds into the conv before it, and a broad rule such as
        ``layer1.** { weight = w4 }`` must not quantize them by accident.
        """
        if self.type_name in RECURRENT_TYPES and "weight_ih" in _param_roots(self):
            out = [Role.WEIGHT_IH, Role.WEIGHT_HH]
            if "bias_ih" in _param_roots(self):
                out.append(Role.BIAS)
            out += [Role.INPUT, Role.HIDDEN]
            if self.type_name.startswith("LSTM"):
                out.append(Role.CELL)
            return tuple(out + [Role.OUTPUT])
        # separate q/k/v weights (kdim/vdim != embed_dim) get the roles too: apply refuses them by name (E511)
        if self.type_name in ATTENTION_TYPES and {"in_proj_weight", "q_proj_weight"} & set(self.param_shapes):
            out = [Role.WEIGHT] + ([Role.BIAS] if "in_proj_bias" in self.param_shapes else [])
            return tuple(out + [Role.INPUT, Role.Q, Role.K, Role.V, Role.SCORES, Role.PROBS, Role.OUTPUT])
        out = []
        weight = self.param_shapes.get("weight")
        if weight is not None and len(weight) >= 2:
            out.append(Role.WEIGHT)
            if "bias" in self.param_shapes:
                out.append(Role.BIAS)
        out += [Role.INPUT, Role.OUTPUT]
        if not self.leaf:
            # a module with children may compute a softmax in its forward (Hugging Face's
            # BertSelfAttention, a hand-written attention): its input and result
            # (qdsl.patch.softmax_roles); set only by name, never through ``input``
            out += [Role.SCORES, Role.PROBS]
        return tuple(out)

    def inherits(self, role: Role) -> Role | None:
        """The role a spec may set instead of ``role`` on this module (``Role.refines``),
        except a container's ``scores``/``probs``: a rule's ``input`` on a block must not
        put a quantizer inside every softmax it computes."""
        if role in (Role.SCORES, Role.PROBS) and self.type_name not in ATTENTION_TYPES:
            return None
        return role.refines


def _param_roots(entry: ModuleEntry) -> set[str]:
    # ``weight_ih_l1_reverse`` -> ``weight_ih``: a recurrent layer's parameter families
    return {"_".join(n.split("_")[:2]) for n in entry.param_shapes}


def param_shape(entry: ModuleEntry, role: Role) -> tuple[int, ...] | None:
    """The shape of the parameter ``role`` quantizes: ``weight``/``bias``, or a recurrent
    layer's first ``weight_ih*``/``weight_hh*``/``bias_ih*`` (every layer and direction
    shares the row count; layer 0's columns are the input size)."""
    if role.value in entry.param_shapes:
        return entry.param_shapes[role.value]
    if f"in_proj_{role.value}" in entry.param_shapes:  # MultiheadAttention
        return entry.param_shapes[f"in_proj_{role.value}"]
    prefix = "bias_ih" if role is Role.BIAS else role.value
    return next((s for n, s in entry.param_shapes.items() if n.startswith(prefix)), None)


@attrs.frozen
class ModelIndex:
    """All modules of a model in ``named_modules()`` order (the root has fqn ``""``)."""

    entries: tuple[ModuleEntry, ...] = attrs.field(converter=tuple)
    calls: tuple[str, ...] | None = attrs.field(default=None, kw_only=True)
    """Module fqns in forward execution order, one per call (a torch.fx trace), for the
    positional targets ``@first`` / ``@last``; ``None`` when not traced (then positions
    fall back to registration order and ``order_note`` says why)."""
    order_note: str = attrs.field(default="", kw_only=True)
    by_name: Mapping[str, ModuleEntry] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "by_name", {e.fqn: e for e in self.entries})

    @classmethod
    def from_module(cls, model: Any, skip: Iterable[Any] = (), calls: tuple[str, ...] | None = None,
                    order_note: str = "") -> "ModelIndex":
        """Index an ``nn.Module`` (duck-typed; no torch import).

        Modules marked internal (``_qdsl_internal = True``, as qdsl's own injected
        modules are) and their children are left out so rules never match them.
        """
        entries = []
        internal_prefixes: list[str] = []
        for fqn, mod in model.named_modules():
            if any(fqn == p or fqn.startswith(p + ".") for p in internal_prefixes):
                continue
            if _plain_attr(mod, "_qdsl_internal", False):
                internal_prefixes.append(fqn)
                continue
            shapes = {}
            # parametrized modules keep originals under .parametrizations; report the
            # logical parameter names and shapes.
            for pname, p in mod.named_parameters(recurse=False):
                shapes[pname] = tuple(p.shape)
            submodules = vars(mod).get("_modules")
            # a TorchScript module's OrderedModuleDict has no .get (and no parametrizations)
            parametrizations = (
                submodules.get("parametrizations") if isinstance(submodules, dict)
                else getattr(mod, "parametrizations", None)
            )
            if parametrizations is not None:
                for pname in parametrizations.keys():
                    shapes[pname] = tuple(getattr(parametrizations, pname).original.shape)
            attrs_ = {}
            for a in MODULE_ATTRS:
                v = _plain_attr(mod, a, None)
                if isinstance(v, (int, tuple, str)):
                    attrs_[a] = v
            children = [c for c in mod.children() if not _plain_attr(c, "_qdsl_internal", False)]
            entries.append(ModuleEntry(fqn, type(mod).__name__, shapes, attrs_, leaf=not children))
        return cls(entries, calls=calls, order_note=order_note)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)


@attrs.frozen
class QuantizerRecipe:
    """A fully resolved tensor quantizer: every field explicit.

    ``observer_params`` is the validated params object of the observer's registry
    entry (an attrs instance), so parts never re-validate.
    """

    kind: Kind
    bits: int
    signed: bool
    narrow_range: bool
    symmetric: bool
    scale: str
    granularity: Granularity
    observer: ObserverSpec
    rounding: str
    dynamic: bool
    threshold: str = "none"
    """``"learned"``: a signed binary activation with a learned per-channel threshold."""
    observer_params: Any = attrs.field(default=None, eq=False)
    format: NumberFormat = attrs.field(
        default=attrs.Factory(lambda self: builtin_format(self.kind), takes_self=True), eq=False, repr=False)
    """The number format's facts (qdsl.spec.formats): the resolver takes it from the
    registries (user formats); a recipe built by hand gets the built-in one of ``kind``."""

    @property
    def qmin(self) -> int:
        """Smallest integer code (the number format's code range)."""
        return self.format.code_range(self.bits, self.signed, self.narrow_range)[0]

    @property
    def qmax(self) -> int:
        """Largest integer code (the number format's code range)."""
        return self.format.code_range(self.bits, self.signed, self.narrow_range)[1]


@attrs.frozen
class Origin:
    """Who set a value: ``label`` (``defaults``, ``rule type:Conv1d``, ``preset w4pot``,
    ``override weight.bits=4``, ``built-in default``) and where it is written."""

    label: str
    span: Span = UNKNOWN_SPAN

    def __str__(self) -> str:
        if self.span.known:
            return f"{self.label} ({self.span.file}:{self.span.line})"
        return self.label


@attrs.frozen
class FieldProvenance:
    """Where one resolved field's value came from, and what it overrode."""

    value: Any
    set_by: Origin
    via: tuple[Origin, ...] = ()
    """Preset chain the value travelled through (``via w4pot (model.qspec:5)``)."""
    overridden: tuple[tuple[Origin, Any], ...] = ()
    """Lower-precedence sources that also set this field, with their values."""


@attrs.frozen
class LayerPlan:
    """Everything qdsl will do to one module."""

    fqn: str
    type_name: str
    roles: Mapping[Role, QuantizerRecipe | None] = attrs.field(converter=_frozen_map)
    skip: bool = False
    accumulator: Accumulator = Accumulator()
    provenance: Mapping[tuple[Role | str, str], FieldProvenance] = attrs.field(
        factory=dict, converter=_frozen_map, eq=False
    )
    """Keyed by ``(role, field)``; layer-level fields use role ``"layer"`` (skip, accumulator)."""
    matched_rules: tuple[int, ...] = ()
    """Indices into ``Plan.spec.rules`` of the rules that matched this layer."""

    def recipe(self, role: Role | str) -> QuantizerRecipe | None:
        return self.roles.get(Role(role))

    @property
    def quantized(self) -> bool:
        return not self.skip and any(r is not None for r in self.roles.values())


@attrs.frozen
class RuleMatch:
    """Which modules one rule matched (for lint's unmatched/shadowed checks)."""

    rule_index: int
    fqns: tuple[str, ...]


@attrs.frozen
class Plan:
    """The resolved spec for one model."""

    spec: QuantSpec
    """The composed (includes merged, overrides applied) spec the plan came from."""
    layers: tuple[LayerPlan, ...] = attrs.field(converter=tuple)
    rule_matches: tuple[RuleMatch, ...] = ()
    index: ModelIndex | None = attrs.field(default=None, eq=False, repr=False)

    def layer(self, fqn: str) -> LayerPlan:
        for layer in self.layers:
            if layer.fqn == fqn:
                return layer
        raise KeyError(f"no layer {fqn!r} in plan")

    def __iter__(self):
        return iter(self.layers)

    @property
    def fold_bn(self) -> bool:
        return bool(self.spec.fold_bn)

    @property
    def bias_correction(self) -> bool:
        return bool(self.spec.bias_correction)

"""The spec model: frozen attrs records that both front ends lower to.

A ``QuantSpec`` is pure data: no torch, no defaults that depend on other fields.
Everything in a ``TensorQuant`` is *partial* (``None`` = "this layer of the cascade
does not say"), because the resolver merges presets, defaults and rules field by field
(DESIGN.md §2).  The resolver turns the merged result into a fully explicit
``QuantizerRecipe`` (qdsl/resolve/plan.py) and only then checks combinations.

Spans: every node has ``span`` (where the node starts) and ``TensorQuant`` also has
``field_spans`` (where each field's *value* is written), both excluded from equality so
that the TOML and DSL forms of one spec compare equal.

Vocabulary (the closed sets are str Enums; registry-backed names are plain str):

* ``kind``: :class:`Kind` - int, binary, ternary, pot (weights ±2^k or 0), float (leave
  this tensor unquantized; ``bias = "float"`` is ``TensorQuant(kind=FLOAT)``).
* ``scale``: registry name; built-ins ``float``, ``pot``, ``pot_ceil``, ``learned``,
  ``learned_pot`` and, for the bias role only, ``input*weight`` (int32 bias whose scale
  is derived as input_scale × weight_scale).
* ``observer``: :class:`ObserverSpec` - registry name plus parameters.
* ``rounding``: registry name; built-ins ``half_even``, ``half_away``, ``floor``,
  ``stochastic``.
* ``granularity``: :class:`Granularity` - tensor, channel(axis), group(size), gate
  (recurrent weights).
* ``threshold``: ``none`` or ``learned`` (:data:`THRESHOLDS`): a signed binary
  activation's codes are ``+1`` where ``x >= t[c]`` and ``-1`` below, with ``t`` a learned
  per-channel parameter (ReActNet's RSign); ``none`` is ``t = 0``.
"""

from __future__ import annotations

import enum
from typing import Any, Mapping, Union

import attrs

from qdsl.spec.diagnostics import Span, UNKNOWN_SPAN

__all__ = [
    "Role",
    "Kind",
    "GranularityKind",
    "TargetKind",
    "TARGET_POSITIONS",
    "Overflow",
    "Granularity",
    "ObserverSpec",
    "TensorQuant",
    "Accumulator",
    "Target",
    "RuleBody",
    "Rule",
    "QuantSpec",
    "ParamValue",
    "TENSOR_QUANT_FIELDS",
    "THRESHOLDS",
    "BUILTIN_SCALES",
    "BUILTIN_ROUNDINGS",
    "BUILTIN_OBSERVERS",
    "DERIVED_BIAS_SCALE",
    "SPEC_VERSION",
]

SPEC_VERSION = 1
"""The spec language version this code reads and writes."""

ParamValue = Union[bool, int, float, str]


class Role(str, enum.Enum):
    """Which tensor of a layer a quantizer applies to."""

    WEIGHT = "weight"
    """The layer's weight parameter (patched with a parametrization)."""
    INPUT = "input"
    """The layer's first positional input (forward pre-hook)."""
    OUTPUT = "output"
    """The layer's output (forward hook)."""
    BIAS = "bias"
    """The layer's bias parameter (recurrent layers: every ``bias_ih*`` and ``bias_hh*``)."""
    WEIGHT_IH = "weight_ih"
    """Recurrent layers: the input-to-hidden weights (``weight_ih_l0``, ...); refines ``weight``."""
    WEIGHT_HH = "weight_hh"
    """Recurrent layers: the hidden-to-hidden weights (``weight_hh_l0``, ...); refines ``weight``."""
    HIDDEN = "hidden"
    """Recurrent layers: the hidden state ``h``, quantized at every time step (the initial
    state, each new ``h_t``); refines ``input`` (``h`` is the other operand of the gates'
    matrix products)."""
    CELL = "cell"
    """LSTM layers: the cell state ``c``, quantized at every time step."""
    Q = "q"
    """``nn.MultiheadAttention``: the projected queries ``query·W_qᵀ + b_q`` (before the
    ``1/sqrt(head_dim)`` scaling); refines ``input`` (an operand of ``q·kᵀ``)."""
    K = "k"
    """``nn.MultiheadAttention``: the projected keys; refines ``input``."""
    V = "v"
    """``nn.MultiheadAttention``: the projected values; refines ``input`` (an operand of ``probs·v``)."""
    SCORES = "scores"
    """``nn.MultiheadAttention``: the scaled scores ``q·kᵀ/sqrt(head_dim)``, before the mask
    and the softmax; refines ``input`` (the softmax's input)."""
    PROBS = "probs"
    """``nn.MultiheadAttention``: the attention probabilities (the softmax's result, before
    dropout); refines ``input`` (an operand of ``probs·v``)."""

    @property
    def is_param(self) -> bool:
        """A parameter (weights, bias): quantized from the tensor itself, no statistics."""
        return self in _PARAM_ROLES

    @property
    def is_weight(self) -> bool:
        """A weight kernel (``weight``, ``weight_ih``, ``weight_hh``)."""
        return self in _WEIGHT_ROLES

    @property
    def refines(self) -> "Role | None":
        """The broader role a spec may set instead (``weight_ih`` -> ``weight``,
        ``hidden`` -> ``input``); the more specific role wins at the same cascade level."""
        return _REFINES.get(self)


_WEIGHT_ROLES = frozenset({Role.WEIGHT, Role.WEIGHT_IH, Role.WEIGHT_HH})
_PARAM_ROLES = _WEIGHT_ROLES | {Role.BIAS}
_REFINES = {Role.WEIGHT_IH: Role.WEIGHT, Role.WEIGHT_HH: Role.WEIGHT, Role.HIDDEN: Role.INPUT,
            Role.Q: Role.INPUT, Role.K: Role.INPUT, Role.V: Role.INPUT, Role.SCORES: Role.INPUT,
            Role.PROBS: Role.INPUT}


class Kind(str, enum.Enum):
    """What set of values a quantized tensor takes."""

    INT = "int"
    """Affine integers: ``q = clamp(round(x/s) + z, qmin, qmax)``."""
    BINARY = "binary"
    """{-1, +1} times a scale (XNOR-Net); with ``signed = false``, {0, 1}."""
    TERNARY = "ternary"
    """{-1, 0, +1} times a scale."""
    POT = "pot"
    """Each value is ±2^k or 0, with the exponents within the bit budget."""
    FLOAT = "float"
    """Not quantized: the tensor stays in floating point."""


class GranularityKind(str, enum.Enum):
    """How many scales a tensor has."""

    TENSOR = "tensor"
    """One scale (and zero point) for the whole tensor."""
    CHANNEL = "channel"
    """One per slice along ``axis`` (default 0 = output channels of a weight)."""
    GROUP = "group"
    """One per ``group_size`` consecutive elements along the reduction axis of each output channel."""
    GATE = "gate"
    """Recurrent weights only: one per gate block of rows (LSTM 4: i, f, g, o; GRU 3: r, z, n; RNN 1)."""
    TOKEN = "token"
    """Dynamic activations only: one per row of the last axis (per token of a (batch, tokens,
    features) input, per sample of a (batch, features) one), what QUANTIZE_DYNAMIC's
    ``per_row`` computes."""


class TargetKind(str, enum.Enum):
    """How a rule target is matched against module names (DESIGN.md §2)."""

    EXACT = "exact"
    """The full dotted module name."""
    GLOB = "glob"
    """``*`` matches within one dotted component, ``**`` across components."""
    REGEX = "regex"
    """``re:<pattern>``, a full match of the dotted name."""
    TYPE = "type"
    """``type:<ClassName>``, the module's class name."""
    POSITION = "position"
    """``@first`` / ``@last``: the first / last weighted layer in forward execution order."""


TARGET_POSITIONS = ("first", "last")
"""The words a positional target (``@first``, ``@last``) may name."""


class Overflow(str, enum.Enum):
    """What a narrow accumulator does when a sum leaves its range."""

    WRAP = "wrap"
    """Two's complement wrap-around (what most silicon does)."""
    SATURATE = "saturate"
    """Clamp to the accumulator's range."""


BUILTIN_SCALES = ("float", "pot", "pot_ceil", "learned", "learned_pot")
DERIVED_BIAS_SCALE = "input*weight"
BUILTIN_ROUNDINGS = ("half_even", "half_away", "floor", "stochastic")
BUILTIN_OBSERVERS = ("minmax", "ema", "histogram", "percentile", "mse", "mean_abs", "auto")


@attrs.frozen
class Granularity:
    """tensor, channel(axis) or group(size)."""

    kind: GranularityKind = GranularityKind.TENSOR
    axis: int | None = None
    group_size: int | None = None
    span: Span = attrs.field(default=UNKNOWN_SPAN, eq=False, repr=False)

    def __str__(self) -> str:
        if self.kind is GranularityKind.CHANNEL:
            return "channel" if self.axis in (None, 0) else f"channel({self.axis})"
        if self.kind is GranularityKind.GROUP:
            return f"group({self.group_size})"
        if self.kind is GranularityKind.GATE:
            return "gate"
        return "tensor"


def _freeze_params(value: Any) -> tuple[tuple[str, ParamValue], ...]:
    if isinstance(value, Mapping):
        value = value.items()
    return tuple(sorted((str(k), v) for k, v in value))


@attrs.frozen
class ObserverSpec:
    """An observer by registry name, with its parameters (validated at resolve time)."""

    name: str
    params: tuple[tuple[str, ParamValue], ...] = attrs.field(default=(), converter=_freeze_params)
    span: Span = attrs.field(default=UNKNOWN_SPAN, eq=False, repr=False)

    def param_dict(self) -> dict[str, ParamValue]:
        return dict(self.params)

    def __str__(self) -> str:
        if not self.params:
            return self.name
        inner = ", ".join(f"{k}={v}" for k, v in self.params)
        return f"{self.name}({inner})"


@attrs.frozen
class TensorQuant:
    """A partial tensor quantizer: any field may be ``None`` (unset at this level).

    ``extends`` names a preset (``QuantSpec.quantizers``) whose fields this one
    inherits; fields set here win.  ``field_spans`` maps a field name to the span of its
    value in the source, for provenance and lint carets.
    """

    kind: Kind | None = None
    bits: int | None = None
    signed: bool | None = None
    narrow_range: bool | None = None
    symmetric: bool | None = None
    scale: str | None = None
    granularity: Granularity | None = None
    observer: ObserverSpec | None = None
    rounding: str | None = None
    dynamic: bool | None = None
    threshold: str | None = None
    extends: str | None = None
    span: Span = attrs.field(default=UNKNOWN_SPAN, eq=False, repr=False)
    field_spans: Mapping[str, Span] = attrs.field(factory=dict, eq=False, repr=False)

    def set_fields(self) -> dict[str, Any]:
        """The quantizer fields this node sets (not ``extends``), in declaration order."""
        return {f: getattr(self, f) for f in TENSOR_QUANT_FIELDS if getattr(self, f) is not None}

    def span_of(self, field: str) -> Span:
        return self.field_spans.get(field, self.span)


TENSOR_QUANT_FIELDS: tuple[str, ...] = (
    "kind",
    "bits",
    "signed",
    "narrow_range",
    "symmetric",
    "scale",
    "granularity",
    "observer",
    "rounding",
    "dynamic",
    "threshold",
)
"""The cascading fields of a tensor quantizer, in canonical order."""

THRESHOLDS: tuple[str, ...] = ("none", "learned")
"""Values of ``threshold``: ``none`` (binarise at 0) or ``learned`` (a learned per-channel
threshold; signed binary activations only)."""



@attrs.frozen
class Accumulator:
    """Accumulator width and overflow behaviour for a layer's integer dot products."""

    bits: int = 32
    overflow: Overflow = Overflow.WRAP
    constrain: bool = False
    """Constrain each output channel's integer weights (at freeze) so that no input in the
    quantized input range can overflow ``bits`` (an A2Q-style L1 bound; qdsl.patch.constrain)."""
    span: Span = attrs.field(default=UNKNOWN_SPAN, eq=False, repr=False)


@attrs.frozen
class Target:
    """One rule target; ``text`` is what the user wrote (``type:Conv2d``, ``layer1.*``)."""

    kind: TargetKind
    pattern: str
    span: Span = attrs.field(default=UNKNOWN_SPAN, eq=False, repr=False)

    @property
    def text(self) -> str:
        if self.kind is TargetKind.TYPE:
            return f"type:{self.pattern}"
        if self.kind is TargetKind.REGEX:
            return f"re:{self.pattern}"
        if self.kind is TargetKind.POSITION:
            return f"@{self.pattern}"
        return self.pattern

    @classmethod
    def parse(cls, text: str, span: Span = UNKNOWN_SPAN) -> "Target":
        """Classify a target string by its prefix; a glob is any name with ``*`` or ``?``."""
        if text.startswith("type:"):
            return cls(TargetKind.TYPE, text[5:], span)
        if text.startswith("re:"):
            return cls(TargetKind.REGEX, text[3:], span)
        if text.startswith("@"):
            return cls(TargetKind.POSITION, text[1:], span)
        if any(c in text for c in "*?["):
            return cls(TargetKind.GLOB, text, span)
        return cls(TargetKind.EXACT, text, span)

    def __str__(self) -> str:
        return self.text


def _freeze_roles(value: Mapping[Any, TensorQuant] | None) -> Mapping[Role, TensorQuant]:
    if not value:
        return attrs_frozendict({})
    return attrs_frozendict({Role(k): v for k, v in value.items()})


class attrs_frozendict(dict):
    """A hashable, read-only dict so records holding mappings stay frozen and hashable."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted((str(k), v) for k, v in self.items())))

    def _readonly(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("this mapping is read-only")

    def __reduce__(self):
        # rebuild from a plain dict: the default dict-subclass protocol calls __setitem__,
        # which is read-only (this makes copy.deepcopy and pickle of plans work)
        return (type(self), (dict(self),))

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]


@attrs.frozen
class RuleBody:
    """What defaults and rules can say: per-role quantizers, skip, accumulator.

    ``roles`` maps a :class:`Role` to a partial :class:`TensorQuant`.  ``skip`` leaves
    the matched layers entirely in float (and wins over everything else for them).
    """

    roles: Mapping[Role, TensorQuant] = attrs.field(factory=dict, converter=_freeze_roles)
    skip: bool | None = None
    accumulator: Accumulator | None = None
    span: Span = attrs.field(default=UNKNOWN_SPAN, eq=False, repr=False)


@attrs.frozen
class Rule:
    """``rule TARGETS [optional] [priority N] { body }``."""

    targets: tuple[Target, ...] = attrs.field(converter=tuple)
    body: RuleBody = attrs.field(factory=RuleBody)
    optional: bool = False
    priority: int | None = None
    name: str | None = None
    span: Span = attrs.field(default=UNKNOWN_SPAN, eq=False, repr=False)

    def describe(self) -> str:
        """``rule type:Conv1d`` - how provenance and errors name the rule."""
        if self.name:
            return f"rule {self.name}"
        return "rule " + ", ".join(t.text for t in self.targets)


def _freeze_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return attrs_frozendict(dict(value or {}))


@attrs.frozen
class QuantSpec:
    """A whole spec file, as written (includes not yet merged, overrides not applied).

    ``qdsl.parse.compose`` flattens ``includes`` and applies overrides into a spec with
    no includes, which is what the resolver consumes.
    """

    version: int = SPEC_VERSION
    fold_bn: bool | None = None
    bias_correction: bool | None = None
    learned_rounding: str | None = None
    """``None``/``"none"``, ``"adaround"`` or ``"gptq"`` (post-training learned weight rounding)."""
    includes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    quantizers: Mapping[str, TensorQuant] = attrs.field(factory=dict, converter=_freeze_mapping)
    defaults: RuleBody = attrs.field(factory=RuleBody)
    rules: tuple[Rule, ...] = attrs.field(default=(), converter=tuple)
    overrides: RuleBody = attrs.field(factory=RuleBody)
    """Applied above every rule (API ``overrides=`` / CLI ``--set weight.bits=4``): a field
    set here replaces that field on every layer whose role is quantized (not skipped,
    not ``kind = float``).  Never written in files; ``fmt`` does not print it."""
    source: str | None = attrs.field(default=None, eq=False)
    """Path of the file this spec was read from, if any."""
    span: Span = attrs.field(default=UNKNOWN_SPAN, eq=False, repr=False)
    include_spans: tuple[Span, ...] = attrs.field(default=(), converter=tuple, eq=False, repr=False)

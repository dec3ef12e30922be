"""Hardware capability profiles: frozen, torch-free records (loader: ``qdsl.lint.load_profile``).

A :class:`HardwareProfile` says what a deployment target can execute.  It is pure data,
already flattened through ``extends`` by the loader, so lint never re-reads a file.

Capabilities cascade like a spec does, field by field, from general to specific::

    roles.<role>  <  op.<op>.<role>  <  first_layer.<role> / last_layer.<role>

``TensorCaps`` fields are ``None`` when that level does not constrain the field; after
the cascade a ``None`` field means "anything goes".  The format is documented in
``docs/profiles.md``; the vocabulary matches the spec's (``qdsl.spec.model``).

Scale classes are what the *hardware* sees after export: ``float`` (any real scale,
applied with an int32 fixed-point multiplier and shift), ``pot`` (a power of two, applied
with a shift alone), and, for the bias role, ``input*weight`` (int32 bias sharing the
accumulator's scale).  A spec's ``learned`` scale exports as ``float``; ``pot``,
``pot_ceil`` and ``learned_pot`` export as ``pot``.  A ``pot`` scale is a real number too,
so a target that accepts ``float`` scales also accepts ``pot`` ones.  A scale coded in a
minifloat (``scale = fp8_e4m3``, NVFP4's block scales) exports as its own class, named
like the format; OCP MX's E8M0 block scale is ``pot``.

``kinds`` lists built-in kinds as :class:`Kind` members and minifloat formats by name
(``fp8_e4m3``...): a target names the element formats it executes.
"""

from __future__ import annotations

import enum
from typing import Mapping

import attrs

from qdsl.spec.diagnostics import Span, UNKNOWN_SPAN
from qdsl.spec.formats import minifloat_format
from qdsl.spec.model import GranularityKind, Kind, Overflow, Role, attrs_frozendict

__all__ = [
    "PROFILE_VERSION",
    "NarrowRange",
    "Position",
    "TensorCaps",
    "AccumulatorCaps",
    "FixedOutput",
    "HardwareProfile",
    "CAPS_FIELDS",
    "SCALE_CLASSES",
    "export_scale_class",
    "scale_allowed",
]

PROFILE_VERSION = 1
"""The profile format version this code reads."""

SCALE_CLASSES = ("float", "pot", "input*weight")
"""Scale classes a profile may list (``input*weight`` is for the bias role)."""

_SPEC_SCALE_CLASS = {
    "float": "float",
    "learned": "float",
    "pot": "pot",
    "pot_ceil": "pot",
    "learned_pot": "pot",
    "input*weight": "input*weight",
}


def export_scale_class(scale: str, pot_names: frozenset[str] = frozenset()) -> str:
    """The hardware scale class a spec scale exports as.

    Registered custom scale rules flagged ``pot`` (``PartInfo.extra["pot"]``) are passed
    in ``pot_names``; any other unknown name is a real-valued scale (``float``).
    """
    if scale in _SPEC_SCALE_CLASS:
        return _SPEC_SCALE_CLASS[scale]
    if minifloat_format(scale) is not None:  # a scale coded in a minifloat (NVFP4: fp8_e4m3)
        return scale
    return "pot" if scale in pot_names else "float"


def scale_allowed(cls: str, allowed: tuple[str, ...]) -> bool:
    """A scale of class ``cls`` is accepted by a target listing ``allowed``: a power of two
    and a minifloat-coded scale are real numbers too, so ``float`` accepts them."""
    if cls in allowed:
        return True
    return "float" in allowed and (cls == "pot" or minifloat_format(cls) is not None)


class NarrowRange(str, enum.Enum):
    """What the target says about the most negative code (-2^(b-1))."""

    REQUIRED = "required"
    """Signed codes must be symmetric, e.g. int8 in [-127, 127] (TFLite weights)."""
    FORBIDDEN = "forbidden"
    """The full range is expected."""
    ALLOWED = "allowed"
    """Either."""


class Position(str, enum.Enum):
    """Where a layer sits in the model, for position-dependent allowances."""

    FIRST = "first_layer"
    """Its input is the model input (no weighted layer in between)."""
    LAST = "last_layer"
    """Its output is the model output (no weighted layer in between)."""


CAPS_FIELDS = (
    "kinds",
    "bits",
    "signedness",
    "scales",
    "granularities",
    "channel_axes",
    "group_sizes",
    "zero_point",
    "narrow_range",
    "dynamic",
    "thresholds",
)
"""The fields of :class:`TensorCaps`, in the order lint checks them."""


@attrs.frozen
class TensorCaps:
    """What a target accepts for one operand role (all ``None`` = unconstrained).

    * ``kinds``: allowed :class:`Kind` values and minifloat format names; ``float`` means
      the role may stay float.
    * ``bits``: allowed bit widths for ``int`` and ``pot`` kinds (binary is 1 bit and
      ternary 2 by definition, so ``bits`` does not apply to them).
    * ``signedness``: subset of ``("signed", "unsigned")``.
    * ``scales``: allowed scale classes (see the module docstring).
    * ``granularities`` / ``channel_axes`` / ``group_sizes``: allowed granularities, the
      axes allowed for ``channel`` and the sizes allowed for ``group``.
    * ``zero_point``: ``False`` means symmetric quantization is required.
    * ``narrow_range``: :class:`NarrowRange`.
    * ``dynamic``: ``False`` means scales must be fixed at export (no per-batch scales).
    * ``thresholds``: ``False`` means binary activations binarise at 0 only (no learned
      per-channel threshold, ``threshold = learned``: a per-channel integer comparison).
    """

    kinds: tuple[Kind | str, ...] | None = None
    bits: tuple[int, ...] | None = None
    signedness: tuple[str, ...] | None = None
    scales: tuple[str, ...] | None = None
    granularities: tuple[GranularityKind, ...] | None = None
    channel_axes: tuple[int, ...] | None = None
    group_sizes: tuple[int, ...] | None = None
    zero_point: bool | None = None
    narrow_range: NarrowRange | None = None
    dynamic: bool | None = None
    thresholds: bool | None = None
    field_spans: Mapping[str, Span] = attrs.field(factory=dict, eq=False, repr=False, converter=attrs_frozendict)

    def over(self, base: "TensorCaps | None") -> "TensorCaps":
        """This level's constraints laid over ``base``'s, field by field."""
        if base is None:
            return self
        values = {}
        spans = dict(base.field_spans)
        for f in CAPS_FIELDS:
            mine = getattr(self, f)
            values[f] = mine if mine is not None else getattr(base, f)
            if mine is not None and f in self.field_spans:
                spans[f] = self.field_spans[f]
        return TensorCaps(**values, field_spans=spans)

    def span_of(self, field: str) -> Span:
        return self.field_spans.get(field, UNKNOWN_SPAN)

    @property
    def empty(self) -> bool:
        return all(getattr(self, f) is None for f in CAPS_FIELDS)


@attrs.frozen
class AccumulatorCaps:
    """The accumulator of the target's integer dot products.

    ``pair_bits``: some kernels first add two adjacent raw products into a saturating
    intermediate (x86 ``VPMADDUBSW``: u8×s8 pairs into int16) before accumulating; its
    width, when the target has one.
    """

    bits: int | None = None
    overflow: Overflow | None = None
    span: Span = attrs.field(default=UNKNOWN_SPAN, eq=False, repr=False)
    pair_bits: int | None = None

    def over(self, base: "AccumulatorCaps | None") -> "AccumulatorCaps":
        if base is None:
            return self
        return AccumulatorCaps(
            self.bits if self.bits is not None else base.bits,
            self.overflow if self.overflow is not None else base.overflow,
            self.span if self.span.known else base.span,
            self.pair_bits if self.pair_bits is not None else base.pair_bits,
        )


@attrs.frozen
class FixedOutput:
    """An op whose output quantization the target fixes (TFLite softmax: 1/256, zp -128)."""

    scale: float
    zero_point: int
    bits: int = 8
    signed: bool = True
    span: Span = attrs.field(default=UNKNOWN_SPAN, eq=False, repr=False)


def _freeze_nested(value: Mapping | None) -> Mapping:
    return attrs_frozendict({k: attrs_frozendict(v) if isinstance(v, Mapping) else v for k, v in (value or {}).items()})


@attrs.frozen
class HardwareProfile:
    """A flattened hardware profile (``extends`` already applied by the loader).

    ``ops`` is ``None`` when the profile does not restrict op types.  ``fusions`` are
    chains such as ``("conv2d", "relu")``: an op listed only as the tail of a fusion is
    supported only right after the chain's head.
    """

    name: str
    version: int = PROFILE_VERSION
    description: str = ""
    integer_only: bool = False
    accumulator: AccumulatorCaps = AccumulatorCaps()
    ops: tuple[str, ...] | None = None
    fusions: tuple[tuple[str, ...], ...] = ()
    fixed_outputs: Mapping[str, FixedOutput] = attrs.field(factory=dict, converter=attrs_frozendict)
    roles: Mapping[Role, TensorCaps] = attrs.field(factory=dict, converter=attrs_frozendict)
    op_roles: Mapping[str, Mapping[Role, TensorCaps]] = attrs.field(factory=dict, converter=_freeze_nested)
    op_accumulators: Mapping[str, AccumulatorCaps] = attrs.field(factory=dict, converter=attrs_frozendict)
    positions: Mapping[Position, Mapping[Role, TensorCaps]] = attrs.field(
        factory=dict, converter=_freeze_nested
    )
    source: str | None = attrs.field(default=None, eq=False)
    """Path of the file the profile was read from (bundled profiles: the packaged file)."""
    extends_chain: tuple[str, ...] = attrs.field(default=(), converter=tuple, eq=False)
    spans: Mapping[str, Span] = attrs.field(factory=dict, eq=False, repr=False, converter=attrs_frozendict)
    """Where top-level settings are written: ``integer_only``, ``ops``, ``fusions``."""

    @property
    def constrains_nothing(self) -> bool:
        """True when no setting restricts anything (e.g. a file with only ``version = 1``):
        every spec passes lint against it, which is more likely a mistake than a target."""
        blank = HardwareProfile(name=self.name, version=self.version, description=self.description)
        return self == blank

    def caps(self, role: Role | str, op: str | None = None, positions: tuple[Position, ...] = ()) -> TensorCaps:
        """The effective capabilities of ``role`` for ``op`` at ``positions`` (cascade).

        A recurrent layer's role the profile does not state takes the caps of the role it
        refines at the same level (``weight_ih``/``weight_hh`` -> ``weight``, ``hidden`` ->
        ``input``); ``cell`` has no fallback (an LSTM's cell state is commonly wider)."""
        role = Role(role)
        caps = _level(self.roles, role) or TensorCaps()
        if op is not None and op in self.op_roles:
            level = _level(self.op_roles[op], role)
            if level is not None:
                caps = level.over(caps)
        for pos in positions:
            level = _level(self.positions.get(pos, {}), role)
            if level is not None:
                caps = level.over(caps)
        return caps

    def accumulator_for(self, op: str | None = None) -> AccumulatorCaps:
        acc = self.accumulator
        if op is not None and op in self.op_accumulators:
            acc = self.op_accumulators[op].over(acc)
        return acc

    def supports_op(self, op: str) -> bool:
        """Listed in ``ops`` (or ``ops`` unrestricted); fusion tails are checked by lint."""
        return self.ops is None or op in self.ops

    def fusion_heads(self, op: str) -> tuple[str, ...]:
        """Ops that ``op`` may directly follow as part of a fusion."""
        return tuple(chain[i - 1] for chain in self.fusions for i in range(1, len(chain)) if chain[i] == op)


def _level(by_role: Mapping[Role, TensorCaps], role: Role) -> TensorCaps | None:
    """``role``'s entry, else that of the role it refines (``weight_ih`` -> ``weight``)."""
    caps = by_role.get(role)
    if caps is None and role.refines is not None:
        caps = by_role.get(role.refines)
    return caps

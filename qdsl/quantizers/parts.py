"""Building parts from a registry bundle: the torch side of :mod:`qdsl.spec.registry`.

``default_registries()`` is the bundle the public API uses: the built-in parts
(declared torch-free by :func:`qdsl.spec.builtins.builtin_registries`, their
implementations bound here as ``"module:attr"`` strings of this package) plus every
installed plugin (``qdsl.parts`` entry points).  Each call returns a
fresh bundle, so a user can register parts on it without affecting anyone else::

    regs = qdsl.default_registries()

    @regs.observers.register("absmax99", params=MyParams, needs_calibration=True)
    class AbsMax99(qdsl.quantizers.Observer): ...

Part protocols (what a factory must build, called as ``factory(ctx)`` or, for
observers, ``factory(params, ctx)``):

* **observer** - an ``nn.Module``: ``forward(x)`` accumulates statistics of ``x`` (it
  receives detached tensors), ``reset()`` forgets them, ``observed`` says whether any
  data was seen, ``range() -> (lo, hi)`` gives float32 tensors of shape
  ``ctx.param_shape(x_shape)`` (``[]``, ``[C]`` or ``[C, G]``).  All state in buffers.
  :class:`qdsl.quantizers.observers.Observer` is a convenient base.
* **scale rule** - an ``nn.Module``: ``forward(raw_scale) -> scale`` (same shape).
  A *learned* rule sets ``learned = True``, owns an ``nn.Parameter`` and a bool buffer
  ``initialized``; the first call with a raw scale (from the observer) initialises the
  parameter, later calls may be passed ``None`` and return the learned scale.
* **rounding** - a callable ``fn(x, generator=None) -> x rounded`` (float tensor).

A factory string is imported on first use and cached; an import failure is a
:class:`~qdsl.spec.diagnostics.QdslError` naming the part and the missing module.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import attrs

from qdsl.resolve.plan import QuantizerRecipe
from qdsl.spec.builtins import builtin_registries
from qdsl.spec.diagnostics import QdslError, SpecError
from qdsl.spec.formats import MINIFLOAT_PRESETS
from qdsl.spec.model import GranularityKind, Role
from qdsl.spec.registry import PartInfo, Registries, Registry, validate_params

__all__ = ["default_registries", "PartContext", "resolve_factory", "build_observer", "build_scale_rule", "build_rounding",
           "build_format_ops"]

_IMPORTED: dict[str, Any] = {}

# the implementations of the parts qdsl.spec.builtins declares; strings of this package,
# imported on first use so that building a bundle imports no torch module
_OBS, _ROUND, _SCALE = "qdsl.quantizers.observers:", "qdsl.quantizers.rounding:", "qdsl.quantizers.scales:"
_LEARNED = "qdsl.quantizers.learned:"
_MINIFLOAT = "qdsl.quantizers.formats.minifloat:"
_BUILTIN_FACTORIES: dict[str, dict[str, str]] = {
    "observers": {
        "minmax": _OBS + "MinMaxObserver",
        "ema": _OBS + "EmaObserver",
        "histogram": _OBS + "HistogramObserver",
        "percentile": _OBS + "PercentileObserver",
        "mse": _OBS + "MseObserver",
        "auto": "qdsl.quantizers.range_search:auto_observer",
        "mean_abs": _OBS + "MeanAbsObserver",
    },
    "roundings": {name: _ROUND + name for name in ("half_even", "half_away", "floor", "stochastic")},
    "scales": {
        "float": _SCALE + "FloatScale",
        "pot": _SCALE + "PotScale",
        "pot_ceil": _SCALE + "PotCeilScale",
        "learned": _LEARNED + "LearnedScale",
        "learned_pot": _LEARNED + "LearnedPotScale",
        "fp8_e4m3": _MINIFLOAT + "E4M3Scale",
        "fp8_e5m2": _MINIFLOAT + "E5M2Scale",
    },
    # number formats: the torch ops of the kinds qdsl.spec.formats describes
    "formats": {
        "int": "qdsl.quantizers.formats.int:IntOps",
        "binary": "qdsl.quantizers.formats.binary:BinaryOps",
        "ternary": "qdsl.quantizers.formats.ternary:TernaryOps",
        "pot": "qdsl.quantizers.formats.pot:PotOps",
        # every minifloat shares one ops class: the presets by name, the generic
        # fp{N}_e{E}m{M} names through their family entry (build_format_ops)
        **{name: _MINIFLOAT + "MinifloatOps" for name in ("minifloat",) + tuple(MINIFLOAT_PRESETS)},
    },
}


def default_registries() -> Registries:
    """A fresh bundle: built-in parts plus installed plugins."""
    regs = builtin_registries()
    for kind, factories in _BUILTIN_FACTORIES.items():
        registry = getattr(regs, kind)
        for name, factory in factories.items():
            registry.add(attrs.evolve(registry.get(name), factory=factory), override=True)
    regs.load_entry_points()
    return regs


def resolve_factory(info: PartInfo, registry: Registry) -> Any:
    """The part's factory object (importing a ``"module:attr"`` string once)."""
    factory = info.factory
    if factory is None:
        raise QdslError(f"{registry.kind} '{info.name}' is declared but not implemented in this bundle: "
                        "build parts with qdsl.default_registries() (or a copy of it)")
    if not isinstance(factory, str):
        return factory
    if factory in _IMPORTED:
        return _IMPORTED[factory]
    module, _, attr = factory.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise QdslError(
            f"{registry.kind} '{info.name}' is implemented by {factory}, which cannot be loaded ({exc})"
        ) from exc
    _IMPORTED[factory] = obj
    return obj


@attrs.frozen
class PartContext:
    """What a part may know about the tensor it quantizes."""

    recipe: QuantizerRecipe
    role: Role
    qmin: int
    qmax: int
    axis: int | None
    """Channel axis for ``channel`` granularity, else None."""
    group_size: int | None
    """Group size for ``group`` granularity, else None."""
    pot: bool = False
    """The scale rule restricts scales to powers of two (range searches use it)."""

    def param_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        from qdsl.quantizers.functional import param_shape

        return param_shape(tuple(shape), self.axis, self.group_size)


def _get(registry: Registry, name: str) -> PartInfo:
    try:
        return registry.get(name)
    except KeyError as exc:
        raise QdslError(str(exc.args[0])) from None


def build_observer(registries: Registries, ctx: PartContext) -> Any:
    spec = ctx.recipe.observer
    info = _get(registries.observers, spec.name)
    params = ctx.recipe.observer_params
    if params is None or not isinstance(params, info.params):
        params, diags = validate_params(info, spec.param_dict(), spec.span)
        if diags:
            raise SpecError(diags)
    return resolve_factory(info, registries.observers)(params, ctx)


def build_scale_rule(registries: Registries, ctx: PartContext) -> Any:
    info = _get(registries.scales, ctx.recipe.scale)
    return resolve_factory(info, registries.scales)(ctx)


def build_rounding(registries: Registries, name: str) -> Callable[..., Any]:
    info = _get(registries.roundings, name)
    return resolve_factory(info, registries.roundings)


def build_format_ops(registries: Registries, recipe: QuantizerRecipe) -> Any:
    """The torch ops of the recipe's number format, from ``registries.formats`` (a bundle
    without the name - an older copy - falls back to the built-in ops of that name)."""
    name = recipe.format.name
    family = recipe.format.family
    if name not in registries.formats and family and family in registries.formats:
        name = family  # a format of an open family (fp6_e3m2_b2): the family's ops
    if name in registries.formats:
        info = registries.formats.get(name)
    elif name in _BUILTIN_FACTORIES["formats"] or family in _BUILTIN_FACTORIES["formats"]:
        name = name if name in _BUILTIN_FACTORIES["formats"] else family
        info = PartInfo(name, _BUILTIN_FACTORIES["formats"][name])
    else:
        raise QdslError(f"number format '{name}' is not registered on this bundle; "
                        "register it with qdsl.spec.formats.register_format(registries, format, ops)")
    ops = resolve_factory(info, registries.formats)
    return ops() if isinstance(ops, type) else ops


def channel_axis(recipe: QuantizerRecipe, role: Role) -> tuple[int | None, int | None]:
    """``(axis, group_size)`` of a recipe; ``channel`` without an axis means 0 for
    parameters and 1 (the C of N,C,...) for activations, as the resolver fills it."""
    g = recipe.granularity
    if g.kind is GranularityKind.CHANNEL:
        if g.axis is not None:
            return g.axis, None
        return (0 if role.is_param else 1), None
    if g.kind is GranularityKind.GROUP:
        return None, g.group_size
    if g.kind is GranularityKind.TOKEN:  # per row of the last axis: axis 0 of the (rows, last) view
        return 0, None
    return None, None

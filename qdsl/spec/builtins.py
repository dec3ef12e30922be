"""The built-in parts' names, params classes and capabilities (torch-free).

``builtin_registries()`` returns a fresh :class:`Registries` bundle describing the
built-in observers, roundings and scale rules, without their implementations
(``factory`` is None), so resolve can validate a spec's part names and parameters
without importing torch - or naming a module of an upper layer.
``qdsl.quantizers.default_registries()``, the bundle the top-level API uses, binds the
implementations that layer owns (and adds plugins).
"""

from __future__ import annotations

import attrs

from qdsl.spec.formats import BUILTIN_FORMATS, MINIFLOAT_PRESETS, register_format
from qdsl.spec.registry import NoParams, PartInfo, Registries

__all__ = [
    "builtin_registries",
    "EmaParams",
    "HistogramParams",
    "PercentileParams",
    "MseParams",
]


def _positive(instance, attribute, value):
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def _percent(instance, attribute, value):
    if value is not None and not (0.0 < value <= 100.0):
        raise ValueError(f"{attribute.name} must be in (0, 100], got {value}")


@attrs.frozen
class EmaParams:
    """Exponential moving average of per-batch min/max: ``r = (1-momentum)·r + momentum·batch``."""

    momentum: float = attrs.field(default=0.01, converter=float, validator=_positive)


@attrs.frozen
class HistogramParams:
    """Histogram of |x| (or x); ``percentile`` clips there, otherwise an MSE search for the bit width."""

    bins: int = attrs.field(default=2048, converter=int, validator=_positive)
    percentile: float | None = attrs.field(default=None, validator=_percent)


@attrs.frozen
class PercentileParams:
    """Clip the range at this percentile of |x| (histogram-backed)."""

    percentile: float = attrs.field(default=99.99, converter=float, validator=_percent)
    bins: int = attrs.field(default=2048, converter=int, validator=_positive)


def _non_negative_or_none(instance, attribute, value):
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


@attrs.frozen
class MseParams:
    """Search ``grid`` clip ratios for the one minimising the Lp quantization error at the target bits.

    ``search_every`` (weights in QAT): the searched clip ratio is carried between searches;
    N > 0 searches again every N training forwards, 0 never (only on request), unset lets
    ``qdsl.qat.prepare_qat(weight_search_every=...)`` decide (default: never).
    """

    norm: float = attrs.field(default=2.0, converter=float, validator=_positive)
    grid: int = attrs.field(default=100, converter=int, validator=_positive)
    search_every: int | None = attrs.field(default=None, converter=attrs.converters.optional(int),
                                           validator=_non_negative_or_none)


def builtin_registries() -> Registries:
    # names, params and capabilities only: the implementations (torch modules) belong to
    # qdsl.quantizers, which binds them in default_registries(); a bundle from here
    # validates a spec but cannot build its parts
    regs = Registries()
    obs = regs.observers
    obs.add(PartInfo("minmax", None, NoParams, needs_calibration=True))
    obs.add(PartInfo("ema", None, EmaParams, needs_calibration=True))
    obs.add(PartInfo("histogram", None, HistogramParams, needs_calibration=True))
    obs.add(PartInfo("percentile", None, PercentileParams, needs_calibration=True))
    obs.add(PartInfo("mse", None, MseParams, needs_calibration=True))
    # minmax at >= 8 bits, the bit-aware mse/histogram search above it (qdsl.quantizers.range_search)
    obs.add(PartInfo("auto", None, MseParams, needs_calibration=True))
    obs.add(PartInfo("mean_abs", None, NoParams, needs_calibration=True, extra={"kinds": ("binary", "ternary")}))
    for name in ("half_even", "half_away", "floor", "stochastic"):
        regs.roundings.add(PartInfo(name, None))
    regs.scales.add(PartInfo("float", None))
    regs.scales.add(PartInfo("pot", None, extra={"pot": True}))
    regs.scales.add(PartInfo("pot_ceil", None, extra={"pot": True}))
    # learned scales: an nn.Parameter initialised from the observer, trained by QAT
    regs.scales.add(PartInfo("learned", None, extra={"learned": True}))
    regs.scales.add(PartInfo("learned_pot", None, extra={"learned": True, "pot": True}))
    # number formats: the torch-free facts here, their torch ops bound by qdsl.quantizers
    for fmt in BUILTIN_FORMATS.values():
        if fmt.quantized:  # float is "no format": never looked up in a registry
            register_format(regs, fmt)
    for fmt in MINIFLOAT_PRESETS.values():
        register_format(regs, fmt)
    # every minifloat (the presets and the generic fp{N}_e{E}m{M}... names) shares the torch
    # ops of this family entry; it names no format itself (qdsl.spec.formats.lookup_format)
    regs.formats.add(PartInfo("minifloat", None, extra={"family": True}))
    # a minifloat scale: the raw scale cast to an 8-bit float (NVFP4's block scales are
    # fp8_e4m3); scale rules by format name, so `scale = fp8_e4m3` reads like the kind
    for name in ("fp8_e4m3", "fp8_e5m2"):
        regs.scales.add(PartInfo(name, None, extra={"minifloat": name}))
    return regs

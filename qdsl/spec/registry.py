"""Registries of named parts (observers, roundings, scale rules), as instances.

A :class:`Registry` maps a snake_case name to a :class:`PartInfo`: the factory that
builds the part (a torch module, built by ``qdsl.quantizers``), a frozen params class
that validates the spec's parameters, and capability flags that ``export`` and ``lint``
read.  Registries are grouped in a :class:`Registries` bundle that is passed to
``resolve`` - never a module-level global (cattrs' converter-instance design) - so tests
build isolated bundles and users extend a copy::

    regs = qdsl.default_registries().copy()

    @regs.observers.register("my_obs", params=MyParams, needs_calibration=True)
    class MyObserver(torch.nn.Module): ...

This module is torch-free: resolve validates names and params through it without
importing torch.  Plugins: ``Registries.load_entry_points()`` imports every entry point
of the ``qdsl.parts`` group and calls it with the bundle.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator, Mapping

import attrs

from qdsl.spec.diagnostics import Diagnostic, Span, UNKNOWN_SPAN, did_you_mean

__all__ = ["PartInfo", "Registry", "Registries", "NoParams", "validate_params"]

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


@attrs.frozen
class NoParams:
    """Params class for parts that take no parameters."""


@attrs.frozen
class PartInfo:
    """A registered part: how to build it and what it can do."""

    name: str
    factory: Any
    params: type = NoParams
    integer_exportable: bool = True
    """The part's result can be expressed in the integer graph."""
    needs_calibration: bool = False
    """The part needs calibration data before its scale is meaningful."""
    extra: Mapping[str, Any] = attrs.field(factory=dict)
    """Free-form capabilities (e.g. ``{"kinds": ("binary",)}``)."""


class Registry:
    """One kind of part, by name.  Registering a name twice needs ``override=True``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._parts: dict[str, PartInfo] = {}

    def register(
        self,
        name: str,
        params: type = NoParams,
        *,
        override: bool = False,
        integer_exportable: bool = True,
        needs_calibration: bool = False,
        **extra: Any,
    ) -> Callable[[Any], Any]:
        """Decorator: ``@registry.register("name", params=P)`` on a factory or class."""

        def deco(factory: Any) -> Any:
            self.add(
                PartInfo(name, factory, params, integer_exportable, needs_calibration, extra),
                override=override,
            )
            return factory

        return deco

    def add(self, info: PartInfo, *, override: bool = False) -> None:
        if not _NAME_RE.match(info.name):
            raise ValueError(f"{self.kind} name {info.name!r} must be snake_case ([a-z][a-z0-9_]*)")
        if info.name in self._parts and not override:
            raise ValueError(
                f"{self.kind} {info.name!r} is already registered; pass override=True to replace it"
            )
        self._parts[info.name] = info

    def get(self, name: str) -> PartInfo:
        try:
            return self._parts[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; {did_you_mean(name, self._parts)}") from None

    def lookup(self, name: str, span: Span = UNKNOWN_SPAN) -> PartInfo | Diagnostic:
        """The part, or an E2xx diagnostic that lists what is registered."""
        if name in self._parts:
            return self._parts[name]
        return Diagnostic.error(
            "E204", f"unknown {self.kind} '{name}'", span, did_you_mean(name, self._parts)
        )

    def __contains__(self, name: object) -> bool:
        return name in self._parts

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._parts))

    def names(self) -> list[str]:
        return sorted(self._parts)

    def copy(self) -> "Registry":
        new = Registry(self.kind)
        new._parts = dict(self._parts)
        return new


class Registries:
    """The bundle passed to resolve/apply: ``observers``, ``roundings``, ``scales``,
    ``formats`` (number formats: one per quantizer kind, qdsl.spec.formats)."""

    def __init__(self) -> None:
        self.observers = Registry("observer")
        self.roundings = Registry("rounding")
        self.scales = Registry("scale rule")
        self.formats = Registry("number format")

    def copy(self) -> "Registries":
        new = Registries()
        new.observers = self.observers.copy()
        new.roundings = self.roundings.copy()
        new.scales = self.scales.copy()
        new.formats = self.formats.copy()
        return new

    def load_entry_points(self, group: str = "qdsl.parts") -> None:
        """Let installed plugins register parts: each entry point is ``fn(registries)``."""
        from importlib.metadata import entry_points

        for ep in entry_points(group=group):
            ep.load()(self)


def validate_params(
    info: PartInfo, params: Mapping[str, Any], span: Span = UNKNOWN_SPAN
) -> tuple[Any, list[Diagnostic]]:
    """Build ``info.params(**params)``, turning unknown keys and bad values into diagnostics."""
    diags: list[Diagnostic] = []
    known = [a.name for a in attrs.fields(info.params)] if attrs.has(info.params) else []
    clean = {}
    for key, value in params.items():
        if key not in known:
            hint = did_you_mean(key, known, "parameters") if known else f"'{info.name}' takes no parameters"
            diags.append(Diagnostic.error("E205", f"unknown parameter '{key}' for {info.name}", span, hint))
        else:
            clean[key] = value
    for key, value in clean.items():
        # a string or boolean where a number belongs would reach the params' converters
        # and validators as a Python TypeError ("'<' not supported ..."): say it plainly
        if _numeric_field(info.params, key) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            diags.append(Diagnostic.error(
                "E206", f"parameter '{key}' of {info.name} must be a number, got {value!r}", span))
    if diags:
        return None, diags
    try:
        return info.params(**clean), []
    except ValueError as exc:
        return None, [Diagnostic.error("E206", f"bad parameters for {info.name}: {exc}", span)]
    except TypeError:
        shown = ", ".join(f"{k}={v!r}" for k, v in clean.items())
        return None, [Diagnostic.error("E206", f"bad parameters for {info.name}: {shown}", span)]


def _numeric_field(params_cls: type, name: str) -> bool:
    """Whether the attrs field ``name`` holds a number (by its annotation or its default)."""
    field = attrs.fields_dict(params_cls).get(name) if attrs.has(params_cls) else None
    if field is None:
        return False
    ann = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    words = set(str(ann).replace("|", " ").replace("Optional[", " ").replace("]", " ").split())
    if words and words <= {"int", "float", "None"} and words & {"int", "float"}:
        return True
    default = field.default
    return isinstance(default, (int, float)) and not isinstance(default, bool)

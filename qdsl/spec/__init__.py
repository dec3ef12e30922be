"""Spec records, diagnostics and part registries: pure data, never imports torch."""

from qdsl.spec.diagnostics import Diagnostic, QdslError, Severity, Span, SpecError, did_you_mean
from qdsl.spec.model import (
    Accumulator,
    Granularity,
    GranularityKind,
    Kind,
    ObserverSpec,
    Overflow,
    QuantSpec,
    Role,
    Rule,
    RuleBody,
    Target,
    TargetKind,
    TensorQuant,
)
from qdsl.spec.registry import PartInfo, Registries, Registry

__all__ = [
    "Accumulator",
    "Diagnostic",
    "Granularity",
    "GranularityKind",
    "Kind",
    "ObserverSpec",
    "Overflow",
    "PartInfo",
    "QdslError",
    "QuantSpec",
    "Registries",
    "Registry",
    "Role",
    "Rule",
    "RuleBody",
    "Severity",
    "Span",
    "SpecError",
    "Target",
    "TargetKind",
    "TensorQuant",
    "did_you_mean",
]

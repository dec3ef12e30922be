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
    TARGET_POSITIONS,
    TensorQuant,
)
from qdsl.spec.profile import HardwareProfile, TensorCaps
from qdsl.spec.registry import PartInfo, Registries, Registry

__all__ = [
    "Accumulator",
    "Diagnostic",
    "Granularity",
    "GranularityKind",
    "HardwareProfile",
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
    "TARGET_POSITIONS",
    "TensorCaps",
    "TensorQuant",
    "did_you_mean",
]

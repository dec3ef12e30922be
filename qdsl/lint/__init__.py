"""Hardware capability profiles and ``qdsl lint`` (DESIGN.md §7).

Public API::

    load_profile(path_or_bundled_name) -> HardwareProfile
    lint(spec, profile, model=None, *, calibrated=None, overrides=None) -> list[Diagnostic]
    lint_plan(plan, profile, model=None) -> list[Diagnostic]
    enforce(plan_or_spec, profile, model=None, mode="error" | "warn")
    to_json(diagnostics) / to_sarif(diagnostics) / render_text(diagnostics)

The profile format and the W3xx/E3xx code table are documented in ``docs/profiles.md``;
the codes also live in :mod:`qdsl.lint.codes`.  Spec-only lint never imports torch.
"""

from qdsl.lint.api import LintWarning, enforce, lint, lint_plan
from qdsl.lint.codes import CODES
from qdsl.lint.plan_checks import LayerInts
from qdsl.lint.profile_loader import bundled_profiles, load_profile, parse_profile
from qdsl.lint.output import render_text, to_json, to_sarif

__all__ = [
    "lint",
    "lint_plan",
    "enforce",
    "LintWarning",
    "LayerInts",
    "load_profile",
    "parse_profile",
    "bundled_profiles",
    "render_text",
    "to_json",
    "to_sarif",
    "CODES",
]

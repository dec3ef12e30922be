"""Hardware capability profiles and ``qdsl lint`` (DESIGN.md §7).

Public API::

    load_profile(path_or_bundled_name) -> HardwareProfile
    lint(spec, profile, model=None, *, calibrated=None, overrides=None) -> list[Diagnostic]
    lint_plan(plan, profile, model=None) -> list[Diagnostic]
    enforce(plan_or_spec, profile, model=None, mode="error" | "warn")
    to_json(diagnostics) / to_sarif(diagnostics) / render_text(diagnostics)

The profile format and the W3xx/E3xx code table are documented in ``docs/profiles.md``;
the codes also live in :mod:`qdsl.lint.codes`.  Spec-only lint never imports torch.

This module is callable, and ``qdsl.lint.lint`` is the module itself:
``qdsl.lint(spec, profile, model)`` runs :func:`qdsl.lint.api.lint`.  Why: importing any
``qdsl.lint.*`` submodule binds the name ``lint`` on the ``qdsl`` package to this
module, while the package's lazy API binds it to whatever ``qdsl.lint.lint`` is.  Were
that a plain function, ``qdsl.lint.enforce`` and ``import qdsl.lint.api`` would break
after ``qdsl.lint(...)``, and ``qdsl.lint(...)`` after ``import qdsl.lint``; with the
module in both places every spelling works in any order.
"""

import sys

from qdsl._callable import make_callable
from qdsl.lint import api as _api
from qdsl.lint.api import LintWarning, enforce, lint_plan
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


make_callable(__name__, _api.lint)  # qdsl.lint(spec, profile) (qdsl/_callable.py)
lint = sys.modules[__name__]

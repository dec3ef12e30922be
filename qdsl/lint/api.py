"""``lint`` and ``enforce``: a spec (or plan) against a hardware profile, every finding at once.

Guarantees:

* ``lint`` returns *every* finding (never stops at the first), sorted by location, as
  located :class:`Diagnostic` s with codes from ``qdsl/lint/codes.py``.
* Unusable input raises :class:`SpecError` (a :class:`QdslError`): an unreadable spec or
  profile, or a spec with errors of its own (``qdsl check`` finds the same ones) - lint
  judges valid specs only.
* Without a model, the spec is checked as written (``spec_checks.py``); with a model
  (an ``nn.Module`` or a :class:`ModelIndex`), the resolved plan is checked layer by
  layer, plus the op graph and spec hygiene (``plan_checks.py``, ``hygiene.py``).
* ``calibrated``: ``None`` uses the integer weights when the model is a calibrated qdsl
  model (``qdsl.patch.int_tensors``) and worst-case bounds otherwise; ``False`` always
  uses worst-case bounds; ``True`` requires the integers; a mapping
  ``{fqn: LayerInts}`` supplies them directly.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import attrs

from qdsl.lint.collect import sort_key
from qdsl.lint.graph import ModelGraph, index_graph
from qdsl.lint.exact_export import exact_export_findings
from qdsl.lint.hygiene import check_hygiene
from qdsl.lint.plan_checks import LayerInts, check_plan
from qdsl.lint.profile_loader import load_profile
from qdsl.lint.export_width import export_width_findings
from qdsl.lint.lowering import lowering_findings
from qdsl.lint.spec_checks import check_prepared
from qdsl.resolve.check import prepare
from qdsl.resolve.plan import ModelIndex, Plan
from qdsl.spec.builtins import builtin_registries
from qdsl.spec.diagnostics import Diagnostic, QdslError, QdslWarning, Span, SpecError
from qdsl.spec.model import QuantSpec
from qdsl.spec.profile import HardwareProfile
from qdsl.spec.registry import Registries

__all__ = ["lint", "lint_plan", "enforce", "LintWarning"]


class LintWarning(QdslWarning):
    """Issued by ``enforce(..., mode="warn")`` with the rendered lint report."""


def _pot_scales(regs: Registries) -> frozenset[str]:
    return frozenset(n for n in regs.scales.names() if regs.scales.get(n).extra.get("pot"))


def _load_spec(spec: QuantSpec | str | os.PathLike, overrides: Any) -> QuantSpec:
    from qdsl.parse import compose, load_spec

    if isinstance(spec, QuantSpec):
        return compose(spec, overrides) if (overrides or spec.includes) else spec
    return load_spec(os.fspath(spec), overrides)


def _prepare(spec: QuantSpec, regs: Registries):
    prep = prepare(spec, regs)
    if any(d.is_error for d in prep.diagnostics):
        raise SpecError(list(prep.diagnostics))
    return prep


def lint(
    spec: QuantSpec | str | os.PathLike,
    profile: HardwareProfile | str | os.PathLike,
    model: Any = None,
    *,
    calibrated: bool | Mapping[str, LayerInts] | None = None,
    overrides: Any = None,
    registries: Registries | None = None,
    model_label: str = "<model>",
) -> list[Diagnostic]:
    """Every conflict between ``spec`` and the target ``profile`` (optionally on ``model``)."""
    prof = load_profile(profile)
    empty = _empty_profile(prof)
    handle = _handle(model)
    if registries is None:  # a patched model knows the parts it was applied with
        registries = handle.registries if handle is not None else builtin_registries()
    regs = registries
    composed = _load_spec(spec, overrides)
    prep = _prepare(composed, regs)
    if model is None:
        return sorted(check_prepared(prep, prof, _pot_scales(regs)) + empty, key=sort_key)
    from qdsl.resolve import resolve

    # Every rule optional: a rule that matches nothing becomes lint's W330 instead of
    # stopping the resolver, so the rest of the spec is still checked.
    lenient = attrs.evolve(composed, rules=tuple(attrs.evolve(r, optional=True) for r in composed.rules))
    # a patched model's parameters are renamed: resolve against the original's index
    plan = resolve(handle.plan.index if handle is not None else model, lenient, registries=regs)
    return sorted(_lint_plan(plan, prep, composed, prof, model, calibrated, regs, model_label) + empty, key=sort_key)


def lint_plan(
    plan: Plan,
    profile: HardwareProfile | str | os.PathLike,
    model: Any = None,
    *,
    calibrated: bool | Mapping[str, LayerInts] | None = None,
    registries: Registries | None = None,
    model_label: str = "<model>",
) -> list[Diagnostic]:
    """``lint`` for an already resolved plan (``model`` adds the traced op graph)."""
    prof = load_profile(profile)
    regs = registries if registries is not None else builtin_registries()
    prep = _prepare(plan.spec, regs)
    return sorted(_lint_plan(plan, prep, plan.spec, prof, model, calibrated, regs, model_label)
                  + _empty_profile(prof), key=sort_key)


def _empty_profile(prof: HardwareProfile) -> list[Diagnostic]:
    """W341 when the profile restricts nothing: "no findings" would otherwise read as a pass."""
    if not prof.constrains_nothing:
        return []
    text = _read(prof.source)
    # point at the `version` line (the one setting such a file has), else the first line
    lines = text.split("\n") if text else []
    line = next((i + 1 for i, ln in enumerate(lines) if ln.lstrip().startswith("version")), 1)
    col = len(lines[line - 1]) - len(lines[line - 1].lstrip()) + 1 if lines else 1
    where = Span(prof.source or prof.name, line, col, line, col + len("version"), source=text)
    return [Diagnostic.warning(
        "W341", f"profile '{prof.name}' constrains nothing: it sets no bits, kinds, scales, ops, "
        "accumulator or other capability, so every spec passes it", where,
        "add [roles.weight] / [roles.input] capabilities, ops = [...], or 'extends' a bundled profile "
        "(see docs/profiles.md)")]


def _read(path: str | None) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8") if path else None
    except (OSError, UnicodeDecodeError):
        return None


def _handle(model: Any):
    """The qdsl handle of a model qdsl was applied to, else ``None``."""
    if model is None or not hasattr(model, "_modules") or "_qdsl" not in model._modules:
        return None
    from qdsl.patch.handle import get_handle

    return get_handle(model)


def _graph(plan: Plan, model: Any) -> ModelGraph:
    if model is not None and not isinstance(model, ModelIndex) and hasattr(model, "named_modules"):
        from qdsl.lint.graph import model_graph

        return model_graph(model)
    index = plan.index if plan.index is not None else (model if isinstance(model, ModelIndex) else None)
    return index_graph(index) if index is not None else ModelGraph((), frozenset(), frozenset(), traced=False)


def _unplaced(plan: Plan, model: Any, graph: ModelGraph) -> tuple:
    """The operands of integer ops no implied quantizer can be placed on, found by the walk
    apply and export run (:mod:`qdsl.patch.unplaced`) on the eval-mode trace export lowers,
    so lint reports what export will refuse."""
    if not graph.traced or graph.trace is None or not hasattr(model, "named_modules"):
        return ()
    from qdsl.patch.implied import analyse_operands  # torch: only with a traced nn.Module
    from qdsl.patch.trace import trace_model

    modes = {m: m.training for m in model.modules()}
    model.eval()  # training-only branches (stochastic depth) are not exported
    try:
        trace = trace_model(model) if any(modes.values()) else graph.trace
    finally:
        for m, mode in modes.items():
            m.training = mode
    return analyse_operands(model, trace, plan).unplaced


def _ints(model: Any, calibrated: Any) -> Mapping[str, LayerInts]:
    if isinstance(calibrated, Mapping):
        return calibrated
    if calibrated is False or model is None or isinstance(model, ModelIndex):
        return {}
    try:
        from qdsl.lint.calibrated import layer_ints
    except ImportError:  # pragma: no cover - torch-free install
        layer_ints = None
    got = layer_ints(model) if layer_ints is not None else None
    if got is None and calibrated is True:
        raise QdslError("lint: calibrated=True but the model has no calibrated qdsl integer tensors "
                        "(apply, calibrate and freeze it first)")
    return got or {}


def _lint_plan(plan, prep, original, prof, model, calibrated, regs, model_label) -> list[Diagnostic]:
    graph = _graph(plan, model)
    spec_file = original.source or "<spec>"
    diags = check_plan(plan, prof, graph, _ints(model, calibrated), _pot_scales(regs),
                       spec_file=spec_file, model_label=model_label)
    diags += check_hygiene(plan, prep, original) + export_width_findings(prep)
    diags += lowering_findings(graph, model_label, plan, _unplaced(plan, model, graph))
    if model is not None and not isinstance(model, ModelIndex) and calibrated is not False:
        diags += exact_export_findings(model, plan, model_label)  # a frozen model's actual weights
    if not graph.traced and model is not None and (prof.ops is not None or prof.integer_only):
        if isinstance(model, ModelIndex):
            what, hint = "a ModelIndex has no forward()", "lint the nn.Module itself to check them"
        else:
            what, hint = ("could not trace the model with torch.fx",
                          "make forward() traceable (no data-dependent control flow) to check them")
        diags.append(Diagnostic.warning(
            "W340", f"{what}; functional ops (+, cat, F.relu) were not checked against {prof.name}",
            Span(model_label), hint))
    return sorted(diags, key=sort_key)


def enforce(
    plan_or_spec: Plan | QuantSpec | str | os.PathLike,
    profile: HardwareProfile | str | os.PathLike,
    model: Any = None,
    mode: str = "error",
) -> list[Diagnostic]:
    """Refuse (``mode="error"``: raise :class:`SpecError` when any finding is an error) or
    warn about (``mode="warn"``, and warnings-only reports: :class:`LintWarning`) a spec
    the profile rejects; returns the findings when it does not raise.

    Meant for ``qdsl.apply(model, spec, hw=PROFILE)``: one call before patching.
    """
    if mode not in ("error", "warn"):
        raise ValueError(f"enforce mode must be 'error' or 'warn', got {mode!r}")
    if isinstance(plan_or_spec, Plan):
        diags = lint_plan(plan_or_spec, profile, model)
    else:
        diags = lint(plan_or_spec, profile, model)
    if diags:
        prof_name = profile.name if isinstance(profile, HardwareProfile) else os.fspath(profile)
        if mode == "error" and any(d.is_error for d in diags):
            raise SpecError(diags)
        warnings.warn(f"lint against {Path(prof_name).stem}:\n" + "\n\n".join(d.render() for d in diags),
                      LintWarning, stacklevel=2)
    return diags

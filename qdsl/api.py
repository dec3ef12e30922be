"""The façade's own functions: where the layers below are composed for ``qdsl.apply`` and
``qdsl.calibrate``.

Each layer imports only the layers below it (docs/architecture.md, "Layers"), so a step
that needs an upper layer is wired here, at the top, instead of being reached for from
below:

* :func:`apply` is :func:`qdsl.patch.apply` plus ``hw=``: the resolved plan is linted
  against a hardware profile (:func:`qdsl.lint.enforce`, which sits above patch) before
  anything is patched;
* :func:`calibrate` is :func:`qdsl.calibration.calibrate` with the PTQ steps the spec
  enables (learned rounding, bias correction: :mod:`qdsl.ptq.pipeline`) plugged in.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["apply", "calibrate"]


def apply(model: Any, spec: Any, *, overrides: Any = None, registries: Any = None,
          example_input: Any = None, hw: Any = None, hw_mode: str = "error", strict: bool = False,
          check_finite: bool = False, materialize: bool = True) -> Any:
    """:func:`qdsl.patch.apply` (see there for everything but ``hw``).

    ``hw`` (a hardware profile: bundled name, path or ``HardwareProfile``) lints the
    resolved plan against that target before anything is patched: with
    ``hw_mode="error"`` a plan the profile rejects raises :class:`SpecError` carrying the
    whole lint report and the model is left untouched; ``hw_mode="warn"`` patches anyway
    and emits the report as a ``LintWarning``.
    """
    from qdsl.patch.apply import apply as patch_apply, plan_for

    if hw is not None:
        from qdsl.lint import enforce

        spec, registries = plan_for(model, spec, overrides, registries)
        overrides = None
        enforce(spec, hw, model, mode=hw_mode)
    return patch_apply(model, spec, overrides=overrides, registries=registries, example_input=example_input,
                       strict=strict, check_finite=check_finite, materialize=materialize)


def calibrate(model: Any, batches: Iterable[Any], num_batches: int | None = None,
              progress: bool | None = None, *, inputs: Any = None) -> Any:
    """:func:`qdsl.calibration.calibrate` followed by the PTQ steps the spec enables
    (:func:`qdsl.ptq.finish_calibration`), on the same batches.

    A batch is a tensor, a tuple/list or a dict of keyword arguments: a tuple passes as
    many leading elements as ``model.forward`` has required positional parameters (so
    ``(x, y)`` pairs call ``model(x)`` and ``(x, h, c)`` calls ``model(x, h, c)``), a
    ``((x, mask), y)`` tuple passes its first element; ``inputs="all"``, ``inputs=k`` or
    ``inputs=lambda batch: ...`` say it explicitly (:mod:`qdsl.calibration.batches`).
    A batch that does not fit the forward is a ``BatchError`` naming both."""
    from qdsl.calibration import calibrate as observe
    from qdsl.ptq import pipeline

    return observe(model, batches, num_batches, progress, steps=pipeline, inputs=inputs)

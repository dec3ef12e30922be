"""The PTQ steps a spec enables (or ``auto`` chooses), run after the observers, each
kept per layer only where it lowers that layer's held-back output error.

``finish_calibration(model, batches) -> PtqReport``: ``qdsl.calibrate`` calls it once its
observer pass is done (the batches must be re-iterable: a list, or anything ``list()``
can hold).  It

1. resolves, per weighted layer, which steps to try (:mod:`qdsl.resolve.ptq_policy`: the
   spec's explicit ``learned_rounding`` / ``bias_correction``, else the ``auto`` table by
   the layer's bit width);
2. runs the steps in order - learned rounding, then bias correction - each on the layers
   that asked for it;
3. returns one :class:`~qdsl.ptq.report.PtqReport` with every step's per-layer decisions,
   also kept on the model: ``qdsl.ptq.ptq_report(model)`` (``None`` before a calibration
   that ran steps); ``qdsl explain --data`` prints it.

With no step to try it does nothing and costs nothing (an empty report).  The lower
``qdsl.calibration.calibrate`` without ``steps=`` runs observers only: it refuses a spec
that *names* a step, and leaves ``auto``'s steps out (they are a default, not a request).

The step contract (what learned rounding / reconstruction methods implement)
-----------------------------------------------------------------------------
A step is a function in :data:`STEPS` (keyed by its registry name: ``"bias_correction"``
or a learned rounding name of ``qdsl.ptq.rounding.LEARNED_ROUNDINGS``)::

    step(model, batches, *, layers: list[str], report: PtqReport) -> Any

* ``batches``: every calibration batch (a list).  The step splits them itself with
  ``qdsl.ptq.report.split_heldback(batches)`` (deterministic, so every step holds back
  the same batches), fits on the first part and judges on the held-back part.
* ``layers``: the fqns (execution order) the step should act on; others stay untouched.
* ``report``: the step appends one ``LayerDecision(layer, step, kept, error_before,
  error_after, note)`` per layer of ``layers`` it considered, where the errors are the
  layer's (or block's) held-back output MSE on the quantized path vs the float model
  without and with the change (:mod:`qdsl.ptq.guard` measures exactly that).  A change
  that does not lower the error is undone.
* the return value is the step's own result (not kept: the decisions are the record).

Learned rounding follows the contract through ``qdsl.ptq.rounding.learn_rounding(...,
only=layers, report=report)``: GPTQ checks each layer on the held-back batches
(nearest rounding where GPTQ does not help), ``adaround`` each block
(:mod:`qdsl.ptq.reconstruct`).  A layer the method cannot round (a binary or
group-scaled weight for ``adaround``) stops the step and is reported on every layer it
was asked for.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch import nn

from qdsl.calibration.batches import BatchCall
from qdsl.patch.handle import get_handle
from qdsl.ptq.guard import shared_references
from qdsl.ptq.layers import require_batches, scales_fixed
from qdsl.ptq.report import LayerDecision, PtqReport, split_heldback
from qdsl.resolve.ptq_policy import BIAS_CORRECTION, LayerSteps, layer_steps
from qdsl.spec.diagnostics import QdslError

__all__ = ["finish_calibration", "ptq_steps", "planned_steps", "ptq_report", "STEPS"]


def planned_steps(model: nn.Module) -> list[LayerSteps]:
    """Per weighted layer of the applied plan: the steps to try and who chose them (a
    model whose QAT gradient path is installed gets no ``auto`` step)."""
    handle = get_handle(model)
    qat = any(getattr(q, "grad_path", None) is not None for q in handle.container.quantizers.values())
    return layer_steps(handle.plan, qat=qat)


def ptq_steps(model: nn.Module) -> list[str]:
    """The post-observer steps that will run on some layer, in run order.  An explicit
    learned rounding qdsl does not implement is an error here, before calibration."""
    from qdsl.ptq.rounding import LEARNED_ROUNDINGS

    spec = get_handle(model).plan.spec
    lr = spec.learned_rounding
    if lr not in (None, "none") and lr not in LEARNED_ROUNDINGS:
        # checked before calibration starts, so nothing runs for nothing
        raise QdslError(
            f"the spec sets learned_rounding = '{lr}', which qdsl does not implement; "
            f"use {' or '.join(repr(m) for m in LEARNED_ROUNDINGS)} (GPTQ: closed-form, CPU-friendly, "
            "see qdsl.ptq.gptq) or 'none'"
        )
    names: list[str] = []
    for ls in planned_steps(model):
        for s in ls.steps:
            if s not in names:
                names.append(s)
    unknown = [s for s in names if s != BIAS_CORRECTION and s not in LEARNED_ROUNDINGS]
    if unknown:  # a name in the auto table that no module registers: a qdsl bug, said plainly
        raise QdslError(f"the auto PTQ table names {', '.join(unknown)}, which qdsl.ptq.rounding does not register")
    return [s for s in names if s != BIAS_CORRECTION] + [s for s in names if s == BIAS_CORRECTION]


def _bias_correction(model: nn.Module, batches: list[Any], *, layers: list[str], report: PtqReport) -> Any:
    from qdsl.ptq.bias_correction import correct_bias

    fit, held = split_heldback(batches)
    return correct_bias(model, fit, layers=layers, heldback=held, report=report)


def _learned_rounding(method: str) -> Callable[..., Any]:
    def step(model: nn.Module, batches: list[Any], *, layers: list[str], report: PtqReport) -> Any:
        from qdsl.ptq.rounding import learn_rounding  # ptq.rounding imports the GPTQ maths: only when used

        try:
            return learn_rounding(model, batches, method, only=layers, report=report)
        except QdslError as exc:  # e.g. a weight this method cannot round: say so per layer
            for fqn in layers:
                report.add(_not_run(fqn, method, str(exc)))
            return None

    return step


def _not_run(fqn: str, step: str, why: str) -> LayerDecision:
    return LayerDecision(fqn, step, False, math.nan, math.nan, f"not run: {why}")


def _step(name: str) -> Callable[..., Any]:
    return STEPS.get(name) or _learned_rounding(name)


STEPS: dict[str, Callable[..., Any]] = {BIAS_CORRECTION: _bias_correction}
"""Step functions by registry name (the contract in the module docstring).  A learned
rounding method not listed here runs through ``learn_rounding`` (:func:`_learned_rounding`)."""


def finish_calibration(model: nn.Module, batches: Iterable[Any]) -> PtqReport:
    """Run the steps each layer asks for (module docstring); returns the report, which
    ``ptq_report(model)`` also returns afterwards."""
    out = PtqReport()
    order = ptq_steps(model)
    if not order:
        return out
    batches = _rows_as_batches(require_batches(batches, "learned rounding and bias correction"))
    plan = planned_steps(model)
    with scales_fixed(model), shared_references():
        for name in order:
            layers = [ls.fqn for ls in plan if name in ls.steps]
            _step(name)(model, batches, layers=layers, report=out)
    get_handle(model).ptq_report = out
    return out


def _rows_as_batches(batches: list[Any], parts: int = 4) -> list[Any]:
    """One calibration call whose positional arguments are all tensors of the same batch
    size (no keyword arguments) becomes ``parts`` calls over row slices, so
    ``split_heldback`` can hold some rows back; anything else is returned as it is."""
    if len(batches) != 1 or not isinstance(batches[0], BatchCall):
        return batches
    call = batches[0]
    args = call.args
    if call.kwargs or not args or not all(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args):
        return batches
    n = args[0].shape[0]
    if n < parts or any(a.shape[0] != n for a in args):
        return batches
    cuts = [round(i * n / parts) for i in range(parts + 1)]
    return [BatchCall(tuple(a[cuts[i] : cuts[i + 1]] for a in args), {}) for i in range(parts)]


def ptq_report(model: nn.Module) -> PtqReport | None:
    """The :class:`PtqReport` of the model's last ``qdsl.calibrate`` that ran PTQ steps."""
    return getattr(get_handle(model), "ptq_report", None)  # a handle pickled before reports existed

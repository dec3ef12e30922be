"""The PTQ steps a spec enables, run after the observers have seen the calibration data.

``finish_calibration(model, batches)`` reads the applied spec
(``handle.plan.spec.learned_rounding``, ``handle.plan.bias_correction``) and runs, in
this order, learned rounding then bias correction.  With neither enabled it does
nothing and costs nothing.  ``qdsl.calibrate`` calls it once its observer pass is done
(the batches must be re-iterable: a list, or anything ``list()`` can hold).
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from qdsl.patch.handle import get_handle
from qdsl.ptq.layers import scales_fixed
from qdsl.spec.diagnostics import QdslError

__all__ = ["finish_calibration", "ptq_steps"]


def ptq_steps(model: nn.Module) -> list[str]:
    """The post-observer steps the applied spec enables, in run order."""
    spec = get_handle(model).plan.spec
    steps = []
    lr = spec.learned_rounding
    if lr not in (None, "none"):
        from qdsl.ptq.rounding import LEARNED_ROUNDINGS

        if lr not in LEARNED_ROUNDINGS:
            # checked before calibration starts, so nothing runs for nothing
            raise QdslError(
                f"the spec sets learned_rounding = '{lr}', which qdsl does not implement; "
                f"use {' or '.join(repr(m) for m in LEARNED_ROUNDINGS)} (GPTQ: closed-form, CPU-friendly, "
                "see qdsl.ptq.gptq) or 'none'"
            )
        steps.append(str(lr))
    if spec.bias_correction:
        steps.append("bias_correction")
    return steps


def finish_calibration(model: nn.Module, batches: Iterable[Any]) -> dict[str, Any]:
    """Run the enabled steps; returns ``{step: its result}``."""
    steps = ptq_steps(model)
    if not steps:
        return {}
    batches = list(batches)
    if not batches:
        raise QdslError("learned rounding and bias correction need calibration batches; got none")
    out: dict[str, Any] = {}
    with scales_fixed(model):
        for step in steps:
            if step == "bias_correction":
                from qdsl.ptq.bias_correction import correct_bias

                out[step] = correct_bias(model, batches)
            else:
                from qdsl.ptq.rounding import learn_rounding

                out[step] = learn_rounding(model, batches, step)
    return out

"""Post-training quantization accuracy below 8 bits: what runs after the observers.

Public API::

    qdsl.ptq.finish_calibration(model, batches) -> PtqReport
        the steps the spec asks for or ``auto`` picks by bit width
        (qdsl.resolve.ptq_policy), in order: learned rounding, then bias correction,
        each kept per layer only where it lowers the held-back output error; called by
        qdsl.calibrate after the observers
    qdsl.ptq.ptq_report(model)   # that PtqReport after qdsl.calibrate (None if no step ran)
    qdsl.ptq.learn_rounding(model, batches, "gptq")
    qdsl.ptq.learn_rounding(model, batches, "adaround")   # -> PtqReport (qdsl.ptq.reconstruct)
    qdsl.ptq.correct_bias(model, batches)

Sensitivity analysis and mixed precision, which run whole apply/calibrate cycles through
the façade, are a workflow: :mod:`qdsl.workflows.sensitivity` (``qdsl.sensitivity``).
Range search (the observers' side) lives in :mod:`qdsl.quantizers.range_search`.
Order matters: rounding is learned on the calibrated grid, and bias correction then
removes the mean shift that remains (including the rounding's).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "finish_calibration",
    "ptq_report",
    "PtqReport",
    "LayerDecision",
    "learn_rounding",
    "correct_bias",
]

_LAZY = {
    "finish_calibration": "qdsl.ptq.pipeline",
    "ptq_report": "qdsl.ptq.pipeline",
    "PtqReport": "qdsl.ptq.report",
    "LayerDecision": "qdsl.ptq.report",
    "learn_rounding": "qdsl.ptq.rounding",
    "correct_bias": "qdsl.ptq.bias_correction",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qdsl.ptq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

"""Weights export can take only when exact (W320), checked on a frozen model's actual weights.

A weight whose format has no integer form of its own (a minifloat) or whose scales are
group-wise (OCP MX, NVFP4) lowers to the integer graph only when each output channel's
values are exact int8 codes times one scale (``qdsl/export/exact_weights.py``): a property
of the weights, not of the spec.  Given a frozen qdsl model, lint runs the very decode
export runs and reports each layer it would refuse, as W320 at the place the spec writes
the weight's kind (or granularity), naming the layer, the format and the channel, so lint
on a calibrated model reports what ``qdsl.export`` refuses.  (FP8 weights per tensor or
channel still export to ONNX, as FLOAT8: the hint says so.)
"""

from __future__ import annotations

from typing import Any

from qdsl.spec.diagnostics import Diagnostic, Span
from qdsl.spec.model import Role

__all__ = ["exact_export_findings"]


def _span(layer, field: str, fallback: Span) -> Span:
    p = layer.provenance.get((Role.WEIGHT, field)) if layer is not None else None
    if p is None:
        return fallback
    origin = p.via[-1] if p.via else p.set_by
    return origin.span if origin.span.known else fallback


def exact_export_findings(model: Any, plan, model_label: str = "<model>") -> list[Diagnostic]:
    """W320 for every layer of the frozen ``model`` whose weights export would refuse (module doc);
    nothing for a model that is not a frozen qdsl model."""
    try:
        from qdsl.export.exact_weights import NotExact, exact_weight_ints
        from qdsl.export.float8 import onnx_float8_type
        from qdsl.export.lower_layers import decoded_weight
        from qdsl.patch.handle import State, get_handle, state_of
    except ImportError:  # pragma: no cover - torch-free install
        return []
    if state_of(model) not in (State.FROZEN, State.EXPORTED):
        return []
    layers = {lp.fqn: lp for lp in plan.layers} if plan is not None else {}
    out = []
    for fqn, patch in get_handle(model).layers.items():
        wq = patch.wq
        w = patch.float_params()[0] if wq is not None else None
        if w is None or not wq.frozen or not decoded_weight(wq):
            continue
        out_axis = 1 if wq.axis == 1 else 0
        got = exact_weight_ints(wq, w, out_axis)
        if not isinstance(got, NotExact):
            continue
        what = f"{wq.format.name} weights" + (f" with group({wq.group_size}) scales" if wq.group_size else "")
        field = "granularity" if wq.group_size else "kind"
        hint = "qdsl.export.onnx.export_onnx writes them as FLOAT8" if onnx_float8_type(wq.format) and \
            not wq.group_size else "use weights whose channels fit int8 (fp4_e2m1 per channel always does)"
        out.append(Diagnostic.warning(
            "W320", f"'{fqn}': {got.message(what)}: qdsl.export refuses this model",
            _span(layers.get(fqn), field, Span(model_label, path=fqn)), hint))
    return out

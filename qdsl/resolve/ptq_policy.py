"""What ``auto`` turns on after the observers, per layer, by bit width (torch-free).

A spec that leaves ``learned_rounding`` and ``bias_correction`` unset gets "the best we
know at this bit width": :data:`AUTO_STEPS` is a small table keyed by the layer's bit
width naming the post-observer PTQ steps by their registry name (a learned rounding
method of ``qdsl.ptq.rounding`` or ``"bias_correction"``).  An explicit setting in the
spec overrides the table on every layer: ``learned_rounding = none`` / ``= gptq``,
``bias_correction = false`` / ``= true``.

Every step that runs is still checked per layer on held-back calibration data and kept
only where it lowers the layer's output error (``qdsl.ptq.pipeline``), so the table says
what is *tried*; ``qdsl.ptq.report(model)`` says what was kept.

The layer's bit width is the narrowest of its quantized weight and input (a weight-only
layer: its weight's).  A layer with a learned weight or input scale (``learned``,
``learned_pot``: a QAT spec) gets no ``auto`` step: fixed GPTQ codes would stop the
weight's gradient, and QAT learns what bias correction would shift.  Only Linear/Conv layers with an ``int`` weight take part; other
kinds (binary, ternary, pot, minifloat) have no learned rounding or bias correction here.
The activation side of ``auto`` (the observers' range search, the joint (min, max)
search below 5 bits) is the observer's business: :mod:`qdsl.quantizers.range_search`.

``qdsl explain`` prints :func:`format_layer_steps` under the provenance table.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from qdsl.resolve.plan import Plan
from qdsl.spec.model import Role

__all__ = ["AUTO_STEPS", "BIAS_CORRECTION", "WEIGHTED_TYPES", "LayerSteps", "auto_steps", "layer_steps",
           "format_layer_steps"]

BIAS_CORRECTION = "bias_correction"
"""The step name of empirical bias correction (``qdsl.ptq.bias_correction``)."""

WEIGHTED_TYPES = ("Linear", "Conv1d", "Conv2d")
"""Module types the PTQ steps round and correct (``qdsl.ptq.layers.WEIGHTED``)."""

AUTO_STEPS: tuple[tuple[int, tuple[str, ...]], ...] = (
    # (layers of at most this many bits, the steps ``auto`` tries on them, in run order)
    # The first row that covers the layer's bits wins; 8 bits and up: no steps (min/max
    # and nearest rounding are already within noise of float there).
    # 2 bits: block reconstruction (AdaRound + QDrop, qdsl.ptq.reconstruct); on the digits
    # ResNet / keyword Conv1dNet W2A2 it reaches 92.9 / 80.0 % where GPTQ reaches 88.0 / 77.0
    # (benchmarks/ptq_lowbit.py), at ~1-2x GPTQ's time; at 3 bits GPTQ is as good and cheaper.
    (2, ("adaround", BIAS_CORRECTION)),
    (7, ("gptq", BIAS_CORRECTION)),
)


def auto_steps(bits: int) -> tuple[str, ...]:
    """The steps ``auto`` tries on a layer of ``bits`` bits (see :data:`AUTO_STEPS`).

    >>> auto_steps(8), auto_steps(3), auto_steps(2)
    ((), ('gptq', 'bias_correction'), ('adaround', 'bias_correction'))
    """
    for max_bits, steps in AUTO_STEPS:
        if bits <= max_bits:
            return steps
    return ()


@attrs.frozen
class LayerSteps:
    """The post-observer steps of one layer and who chose them."""

    fqn: str
    bits: int
    learned_rounding: str | None
    learned_rounding_by: str
    bias_correction: bool
    bias_correction_by: str

    @property
    def steps(self) -> tuple[str, ...]:
        """Step names in run order: learned rounding, then bias correction."""
        out = (self.learned_rounding,) if self.learned_rounding else ()
        return out + ((BIAS_CORRECTION,) if self.bias_correction else ())


def _bits(lp) -> int | None:
    w = lp.roles.get(Role.WEIGHT)
    if lp.skip or lp.type_name not in WEIGHTED_TYPES or w is None or not w.format.fixed_codes:
        return None
    i = lp.roles.get(Role.INPUT)
    return min(w.bits, i.bits) if i is not None else w.bits


def _learned(lp) -> bool:
    return any(r is not None and r.scale.startswith("learned") for r in (lp.roles.get(Role.WEIGHT),
                                                                        lp.roles.get(Role.INPUT)))


def layer_steps(plan: Plan, *, qat: bool = False) -> list[LayerSteps]:
    """One :class:`LayerSteps` per weighted layer with an int weight, in plan order.
    ``qat``: the model trains (its QAT gradient path is installed): ``auto`` adds no step,
    a recalibration mid-QAT must not pin codes or shift biases the training then fights."""
    spec = plan.spec
    out = []
    for lp in plan.layers:
        bits = _bits(lp)
        if bits is None:
            continue
        auto = auto_steps(bits)
        auto_by = f"auto at {bits} bits"
        if _learned(lp):  # QAT learns scales (and the rounding/shift with them): fixed codes would stop it
            auto, auto_by = (), f"auto at {bits} bits: learned scale, left to QAT"
        elif qat:
            auto, auto_by = (), f"auto at {bits} bits: QAT model, left to QAT"
        if spec.learned_rounding is None:
            lr = next((s for s in auto if s != BIAS_CORRECTION), None)
            lr_by = auto_by
        else:
            lr = None if spec.learned_rounding == "none" else spec.learned_rounding
            lr_by = f"spec learned_rounding = {spec.learned_rounding}"
        if spec.bias_correction is None:
            bc, bc_by = BIAS_CORRECTION in auto, auto_by
        else:
            bc = bool(spec.bias_correction)
            bc_by = f"spec bias_correction = {'true' if bc else 'false'}"
        out.append(LayerSteps(lp.fqn, bits, lr, lr_by, bc, bc_by))
    return out


def format_layer_steps(steps: Sequence[LayerSteps]) -> str:
    """A table: layer, bits, learned rounding, bias correction, each with its source."""
    if not steps:
        return "PTQ steps: no Linear/Conv layer with an int weight"
    rows = [("layer", "bits", "learned rounding", "bias correction")]
    for s in steps:
        rows.append((s.fqn, str(s.bits), f"{s.learned_rounding or 'none'} ({s.learned_rounding_by})",
                     f"{'on' if s.bias_correction else 'off'} ({s.bias_correction_by})"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["PTQ steps tried after the observers (each kept per layer only if it lowers held-back error):"]
    for r in rows:
        lines.append("  ".join([r[i].ljust(widths[i]) for i in range(3)] + [r[3]]).rstrip())
    return "\n".join(lines)

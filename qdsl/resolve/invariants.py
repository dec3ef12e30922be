"""The invariants a :class:`~qdsl.resolve.plan.Plan` must hold, each checked by one function.

Three stages report a broken invariant, each with its own code and wording: ``resolve``
(E214, located at the spec text that set the field), ``apply`` given a hand-built Plan
(E504) and ``lint`` checking a plan against a target (E316).  They all ask the functions
here, so the rule itself is written once.

* A bias with the derived scale ``input*weight`` needs the layer's input and weight
  quantized, with scales that can form ``s_in · s_w`` (:func:`bias_scale_problem`).

Torch-free.
"""

from __future__ import annotations

from typing import Mapping

import attrs

from qdsl.resolve.plan import Plan, QuantizerRecipe
from qdsl.resolve.validate import derived_bias_problem
from qdsl.spec.model import DERIVED_BIAS_SCALE, Role

__all__ = ["BiasScaleProblem", "bias_scale_problem", "plan_problems"]


@attrs.frozen
class BiasScaleProblem:
    """Why a layer's ``input*weight`` bias scale cannot be formed."""

    missing: tuple[str, ...]
    """``"input"`` / ``"weight"`` (recurrent: ``"hidden"``, ``"weight_ih"``...) when that role has no quantizer."""
    reason: str
    """What is wrong, as a clause: ``"the input needs one scale (granularity tensor)"``."""


def bias_scale_problem(roles: Mapping[Role, QuantizerRecipe | None],
                       type_name: str | None = None) -> BiasScaleProblem | None:
    """The problem with a layer's derived bias scale, or ``None`` (also when the bias has
    none: no bias quantizer, or its own scale).  ``type_name``: the layer's class (which
    weight axis holds its output channels)."""
    bias = roles.get(Role.BIAS)
    if bias is None or bias.scale != DERIVED_BIAS_SCALE:
        return None
    # a recurrent layer has two accumulators: x·W_ih (+ bias_ih, scale s_x·s_wih) and
    # h·W_hh (+ bias_hh, scale s_h·s_whh)
    pairs = ((Role.INPUT, Role.WEIGHT_IH), (Role.HIDDEN, Role.WEIGHT_HH)) if Role.WEIGHT_IH in roles \
        else ((Role.INPUT, Role.WEIGHT),)
    for x, w in pairs:
        reason = derived_bias_problem(roles.get(x), roles.get(w), type_name)
        if reason is not None:
            if x is not Role.INPUT:
                reason = reason.replace("its input", f"its {x.value} state").replace("the input", f"the {x.value} state")
            if w is not Role.WEIGHT:
                reason = reason.replace("weight", w.value)
            missing = tuple(r.value for r in (x, w) if roles.get(r) is None)
            return BiasScaleProblem(missing, reason)
    return None


def plan_problems(plan: Plan) -> dict[str, BiasScaleProblem]:
    """``{fqn: problem}`` for every layer of ``plan`` that breaks an invariant."""
    out: dict[str, BiasScaleProblem] = {}
    for layer in plan.layers:
        p = bias_scale_problem(layer.roles, layer.type_name)
        if p is not None:
            out[layer.fqn] = p
    return out

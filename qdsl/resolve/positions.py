"""Positional targets: which module ``@first`` and ``@last`` name.

Definition (docs/spec-language.md, "Targets"):

* A *weighted layer* is a module whose class is in ``WEIGHTED_TYPES`` (Linear, Conv1d/2d,
  ConvTranspose1d/2d, the recurrent classes) and that has a weight kernel: the modules
  ``defaults`` apply to.  Containers (MobileNet's ``features.0`` block, a ResNet
  ``Sequential``) never are.
* ``@first`` is the weighted layer called first in the model's forward pass, ``@last``
  the weighted layer called last (a layer called several times counts at its first call
  for ``@first`` and at its last call for ``@last``).  The order comes from one torch.fx
  trace of the model (:func:`trace_calls`); a weighted layer the trace does not see (not
  called, or inside a module fx keeps whole) is not a candidate.
* When the model cannot be traced (data-dependent control flow), or only a
  :class:`ModelIndex` without calls was given, the order is *registration* order
  (``named_modules()``), and ``Positions.note`` says so; ``qdsl explain`` prints it.
* A model with one weighted layer: ``@first`` and ``@last`` both name it.  A model with
  none: both match nothing (E201 unless the rule is ``optional``).

Positional targets are as specific as an exact name in the cascade: each names one module.
This module imports torch only inside :func:`trace_calls`, for a live model.
"""

from __future__ import annotations

from typing import Any

import attrs

from qdsl.resolve.plan import WEIGHTED_TYPES, ModelIndex
from qdsl.spec.model import Role

__all__ = ["Positions", "positions", "trace_calls"]


@attrs.frozen
class Positions:
    """What ``@first`` / ``@last`` resolve to on one model (``None``: no weighted layer)."""

    first: str | None
    last: str | None
    traced: bool
    """True when the order is forward execution order (a trace), False for registration order."""
    note: str = ""
    """Why the order is registration order (empty when traced)."""

    def of(self, word: str) -> str | None:
        return self.first if word == "first" else self.last if word == "last" else None


def _weighted(index: ModelIndex) -> list[str]:
    return [e.fqn for e in index.entries
            if e.type_name in WEIGHTED_TYPES and {Role.WEIGHT, Role.WEIGHT_IH} & set(e.roles)]


def positions(index: ModelIndex) -> Positions:
    """``@first`` / ``@last`` on ``index`` (see the module docstring)."""
    weighted = _weighted(index)
    if index.calls is not None:
        wanted = set(weighted)
        seq = [c for c in index.calls if c in wanted]
        if seq:
            return Positions(seq[0], seq[-1], True)
        if weighted:
            note = "the trace called no weighted layer; positions use registration order"
            return Positions(weighted[0], weighted[-1], False, note)
        return Positions(None, None, True)
    note = index.order_note or "no trace of the model; positions use registration order (named_modules)"
    return Positions(weighted[0] if weighted else None, weighted[-1] if weighted else None, False, note)


def trace_calls(model: Any) -> tuple[tuple[str, ...] | None, str]:
    """(module fqns in forward call order, "") from a torch.fx trace of ``model``, or
    (None, why) when fx cannot trace it.  Never raises for an untraceable model."""
    import torch.fx  # a live model is being resolved: torch is loaded already

    # the plain tracer (no subclass: every qdsl tracer lives in qdsl/patch/trace.py, which this
    # torch-free layer cannot import): torch.nn layers stay call_module nodes, in call order
    try:
        graph = torch.fx.Tracer().trace(model)
    except Exception as exc:  # noqa: BLE001 - fx raises many types (TraceError, TypeError, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        why = f"{type(exc).__name__}: {first}"[:200]
        return None, f"torch.fx cannot trace {type(model).__name__} ({why}); positions use registration order"
    # the root runs first (fx calls its forward, not call_module)
    calls = [""] + [str(n.target) for n in graph.nodes if n.op == "call_module"]
    return tuple(calls), ""

"""How a calibration (or PTQ, or sweep) batch becomes a call of the model: one rule for
every place qdsl forwards user batches (``calibrate``, the PTQ steps, ``sweep``).

The rule (``inputs=None``, the default):

* a tensor ``x``                  -> ``model(x)``;
* a dict ``{"ids": a, "mask": m}`` -> ``model(ids=a, mask=m)`` (keyword arguments);
* a tuple/list whose first element is itself a tuple/list or a dict, ``((x, mask), y)``
  or ``({"ids": a}, y)``     -> ``model(x, mask)`` / ``model(ids=a)``: the first element
  is the inputs, the rest (targets) is ignored;
* any other tuple/list ``(a, b, c, ...)`` -> ``model(a, ..., k-th)``, where ``k`` is the
  number of *required* positional parameters of ``model.forward`` (at least 1); the
  elements after them are targets and are ignored.  So the ``(x, y)`` pairs of a
  classification dataset call ``forward(self, x)`` with ``x`` as always, while
  ``(x, h, c)`` calls ``forward(self, x, h, c)`` with all three.

Optional parameters are never filled from a tuple (``forward(x, mask=None)`` gets only
``x`` from ``(x, y)``: the label is not taken for the mask).  Where that is not what is
wanted, say it with ``inputs=``:

* ``inputs="all"``: every element of a tuple/list is a positional argument;
* ``inputs=k`` (an int >= 1): the first ``k`` elements are;
* ``inputs=callable``: ``callable(batch)`` returns the inputs: a tensor, a tuple (positional)
  or a dict (keyword arguments).

Before the model runs, the arguments are bound to ``forward``'s signature; a mismatch
(too many, too few, an unknown keyword) is a :class:`BatchError` naming the batch, what
it was turned into, and ``forward``'s definition (file:line), instead of the model's raw
``TypeError``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from qdsl.spec.diagnostics import QdslError

__all__ = ["BatchError", "BatchCall", "INPUT_MODES", "batch_call", "forward_batch", "describe"]

INPUT_MODES = ("all",)
"""The string values ``inputs=`` accepts (besides None, an int and a callable)."""


class BatchError(QdslError):
    """A batch cannot be turned into a call of the model (see the module docstring)."""


class BatchCall:
    """A batch already split into ``(args, kwargs)``: passed through unchanged, so the PTQ
    steps re-run the calls ``calibrate`` made (with its ``inputs=``) and not a re-guess."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs = args, kwargs


def describe(value: Any) -> str:
    """A short structural description: ``tuple(Tensor[4, 8], Tensor[4])``."""
    if isinstance(value, torch.Tensor):
        return f"Tensor[{', '.join(str(d) for d in value.shape)}]"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe(v) for v in value[:6]) + (", ..." if len(value) > 6 else "")
        return f"{type(value).__name__}({inner})"
    if isinstance(value, dict):
        inner = ", ".join(f"{k}={describe(v)}" for k, v in list(value.items())[:6])
        return f"dict({inner})"
    return type(value).__name__


def _signature(model: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C forward: nothing to inspect
        return None


def _required_positional(sig: inspect.Signature | None) -> int:
    if sig is None:
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    n = sum(1 for p in sig.parameters.values() if p.kind in kinds and p.default is inspect.Parameter.empty)
    return max(n, 1)


def _where(model: nn.Module) -> str:
    fn = getattr(type(model), "forward", None)
    try:
        file = inspect.getsourcefile(fn)  # type: ignore[arg-type]
        line = inspect.getsourcelines(fn)[1]  # type: ignore[arg-type]
    except (TypeError, OSError):
        return f"{type(model).__name__}.forward"
    return f"{file}:{line}: {type(model).__name__}.forward"


def _as_call(value: Any) -> tuple[tuple, dict]:
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    return (value,), {}


def _split(model: nn.Module, batch: Any, inputs: Any, sig: inspect.Signature | None, label: str,
           what: str) -> tuple[tuple, dict]:
    if isinstance(batch, BatchCall):
        return batch.args, batch.kwargs
    if callable(inputs):
        return _as_call(inputs(batch))
    if isinstance(batch, dict):
        return (), dict(batch)
    if not isinstance(batch, (tuple, list)):
        if isinstance(batch, torch.Tensor):
            return (batch,), {}
        raise BatchError(f"{label}: {what} batches must be tensors, tuples/lists or dicts of keyword arguments, "
                         f"got {describe(batch)}")
    if not batch:
        raise BatchError(f"{label}: the batch is an empty {type(batch).__name__}")
    if inputs == "all":
        return tuple(batch), {}
    if isinstance(inputs, int) and not isinstance(inputs, bool):
        if len(batch) < inputs:
            raise BatchError(f"{label}: inputs={inputs} takes the first {inputs} elements, but the batch is "
                             f"{describe(batch)}")
        return tuple(batch[:inputs]), {}
    if isinstance(batch[0], (tuple, list, dict)):
        return _as_call(batch[0])  # ((inputs...), target) or ({kwargs}, target)
    k = _required_positional(sig)
    if len(batch) < k:
        raise BatchError(f"{label}: {_where(model)} needs {k} positional inputs, but the batch is {describe(batch)}")
    return tuple(batch[:k]), {}


def _check_inputs(inputs: Any) -> None:
    ok = inputs is None or callable(inputs) or inputs in INPUT_MODES or (
        isinstance(inputs, int) and not isinstance(inputs, bool) and inputs >= 1)
    if not ok:
        raise BatchError(f"inputs={inputs!r}: expected None (the default rule), 'all', an int >= 1 or a callable "
                         "batch -> inputs (a tensor, a tuple of positional or a dict of keyword arguments)")


def batch_call(model: nn.Module, batch: Any, inputs: Any = None, *, index: int | None = None,
               what: str = "calibration") -> BatchCall:
    """``batch`` as the call the rule (module docstring) makes, bound-checked against
    ``model.forward``; raises :class:`BatchError` on a mismatch."""
    _check_inputs(inputs)
    label = f"{what} batch {index}" if index is not None else f"{what} batch"
    sig = _signature(model)
    args, kwargs = _split(model, batch, inputs, sig, label, what)
    if sig is not None:
        try:
            sig.bind(*args, **kwargs)
        except TypeError as exc:
            given = ", ".join([describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()])
            raise BatchError(
                f"{label} ({describe(batch)}) does not fit the model: calling {type(model).__name__}({given}) "
                f"fails: {exc}\n  {_where(model)}{sig}\n"
                "  hint: a tuple passes as many leading elements as forward has required positional "
                "parameters; say which elements are inputs with inputs='all', inputs=k or "
                "inputs=lambda batch: ..., or use ((inputs...), target) or a dict of keyword arguments"
            ) from None
    return BatchCall(args, kwargs)


def forward_batch(model: nn.Module, batch: Any, inputs: Any = None, *, index: int | None = None,
                  what: str = "calibration") -> Any:
    """Run ``model`` on ``batch`` by the rule; returns the model's output."""
    call = batch_call(model, batch, inputs, index=index, what=what)
    return model(*call.args, **call.kwargs)

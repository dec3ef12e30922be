"""Keep a PTQ step's change to a layer only if it lowers that layer's output error on
held-back calibration data.

The error of layer ``L`` (:class:`LayerProbe`) is the mean squared difference between
``L``'s output in the patched model (the *quantized path*: every layer before ``L`` as it
is now, ``L``'s own input, weight, bias and output proxies applied) and ``L``'s output in
the float model (every proxy disabled, :func:`qdsl.ptq.layers.float_mode`), over the
held-back batches.  Each forward stops right after ``L`` (``capture(stop=True)``), so a
probe costs one float and one quantized partial pass over the held-back data per
measurement, and holds only ``L``'s float outputs on them.

:func:`guarded` measures before, applies the change, measures after, and undoes it
unless the error went down (a tie keeps the layer as it was); it writes one
:class:`~qdsl.ptq.report.LayerDecision` either way.  Without held-back data the change
is kept unchecked and the decision says so.

Inside :func:`shared_references` (``finish_calibration`` opens it around all steps) a
layer's float outputs on the held-back batches are computed once and reused by every
step that probes that layer (they do not change: the float path ignores the proxies),
up to :data:`SHARED_ELEMENTS` cached elements; beyond that each probe recomputes.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, Iterator

import torch
from torch import nn

from qdsl.ptq.layers import capture, float_mode, run_batches
from qdsl.ptq.report import LayerDecision, PtqReport

__all__ = ["LayerProbe", "decide", "guarded", "shared_references", "SHARED_ELEMENTS"]

SHARED_ELEMENTS = 1 << 25
"""Most float32 elements (128 MiB) :func:`shared_references` keeps."""

_SHARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("qdsl_ptq_float_refs", default=None)


@contextlib.contextmanager
def shared_references() -> Iterator[None]:
    """Reuse each layer's float held-back outputs across the probes inside the block."""
    token = _SHARED.set({"size": 0})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _first_tensor(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


class LayerProbe:
    """Held-back output error of one layer of a patched model against its float output."""

    def __init__(self, model: nn.Module, module: nn.Module, heldback: list[Any]):
        self.model, self.module, self.heldback = model, module, heldback
        shared = _SHARED.get()
        key = (id(model), id(module), tuple(id(b) for b in heldback))
        if shared is not None and key in shared:
            self.ref = shared[key]
            return
        self.ref = self._outputs(float_path=True)
        size = sum(t.numel() for t in self.ref)
        if shared is not None and shared["size"] + size <= SHARED_ELEMENTS:
            shared[key] = self.ref
            shared["size"] += size

    def _outputs(self, float_path: bool = False) -> list[torch.Tensor]:
        outs: list[torch.Tensor] = []

        def keep(_x, o):
            outs.append(_first_tensor(o).detach().to(torch.float32))

        with capture(self.module, keep, stop=True):
            if float_path:
                with float_mode(self.model):
                    run_batches(self.model, self.heldback)
            else:
                run_batches(self.model, self.heldback)
        return outs

    def error(self) -> float:
        """Mean squared error of the layer's current quantized-path output (nan if the
        layer never ran on the held-back batches)."""
        total, n = 0.0, 0
        for q, f in zip(self._outputs(), self.ref):
            total += float(torch.sum((q - f) ** 2, dtype=torch.float64))
            n += q.numel()
        return total / n if n else math.nan


def decide(report: PtqReport, fqn: str, step: str, before: float, after: float, *,
           undo: Callable[[], Any] | None = None, note: str = "", unchecked: str = "no held-back data") -> bool:
    """The one rule every PTQ step's held-back check follows: keep the change only if the
    error went down (a tie keeps the layer as it was, calling ``undo``); a nan error (no
    held-back data, or the layer did not run on it) keeps it unchecked, saying
    ``unchecked`` why.  Writes the :class:`LayerDecision` and returns whether it was kept.

    The errors themselves are each step's own: :class:`LayerProbe` for a layer in the whole
    model, GPTQ's output error on captured inputs (they stay fixed, so it is cheap), block
    reconstruction's on stacked block inputs."""
    if math.isnan(before) or math.isnan(after):
        report.add(LayerDecision(fqn, step, True, before, after,
                                 f"{unchecked}: kept unchecked" + (f"; {note}" if note else "")))
        return True
    kept = after < before
    if not kept and undo is not None:
        undo()
    report.add(LayerDecision(fqn, step, kept, before, after, note))
    return kept


def guarded(model: nn.Module, fqn: str, module: nn.Module, heldback: list[Any], step: str,
            apply: Callable[[], Any], undo: Callable[[], Any], report: PtqReport, note: str = "") -> bool:
    """Apply a change to one layer, keep it only if its held-back error drops; returns
    whether it was kept (see the module docstring)."""
    if not heldback:
        apply()
        return decide(report, fqn, step, math.nan, math.nan, note=note)
    probe = LayerProbe(model, module, heldback)
    before = probe.error()
    apply()
    return decide(report, fqn, step, before, probe.error(), undo=undo, note=note,
                  unchecked="layer did not run on held-back data")

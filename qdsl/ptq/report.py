"""What each PTQ step did to each layer, and why: the record every step writes.

A PTQ step (range search, learned rounding, block reconstruction, bias correction) may
make a layer worse on data it was not fitted on.  So each step measures the layer's (or
block's) output error on *held-back* calibration data with and without its change, keeps
the change only when the error goes down, and writes one :class:`LayerDecision` saying
so.  :class:`PtqReport` collects them in run order; ``qdsl explain`` and the benchmark
scripts print it.

Held-back data: :func:`split_heldback` sets aside every ``k``-th batch (or, with a single
batch, its last rows), so the fit and the check never see the same samples.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import attrs
import torch

__all__ = ["LayerDecision", "PtqReport", "split_heldback"]


@attrs.frozen
class LayerDecision:
    """One step's verdict on one layer (or block, named by its first layer's fqn).

    ``error_before``/``error_after`` are the held-back output errors (mean squared error
    against the float layer/block output, same units for both) without and with the
    step's change; ``kept`` says whether the change stayed.  ``note`` is free text
    ("no held-back data", "fewer than 2 batches", ...)."""

    layer: str
    step: str
    kept: bool
    error_before: float
    error_after: float
    note: str = ""

    @property
    def gain(self) -> float:
        """Relative error reduction of the change (positive = better), 0 when undefined."""
        if self.error_before <= 0:
            return 0.0
        return 1.0 - self.error_after / self.error_before


@attrs.define
class PtqReport:
    """The decisions of one ``finish_calibration`` run, in run order."""

    decisions: list[LayerDecision] = attrs.field(factory=list)

    def add(self, decision: LayerDecision) -> LayerDecision:
        self.decisions.append(decision)
        return decision

    def __iter__(self) -> Iterator[LayerDecision]:
        return iter(self.decisions)

    def __len__(self) -> int:
        return len(self.decisions)

    def for_step(self, step: str) -> list[LayerDecision]:
        return [d for d in self.decisions if d.step == step]

    def format(self) -> str:
        """A fixed-width table: layer, step, kept, error before -> after, note."""
        if not self.decisions:
            return "PTQ steps: none ran"
        width = max(len(d.layer) for d in self.decisions)
        step_w = max(len(d.step) for d in self.decisions)
        lines = [f"{'layer':<{width}}  {'step':<{step_w}}  kept  held-back error before -> after"]
        for d in self.decisions:
            verdict = "yes " if d.kept else "no  "
            line = f"{d.layer:<{width}}  {d.step:<{step_w}}  {verdict}  {d.error_before:.4g} -> {d.error_after:.4g}"
            if d.note:
                line += f"  ({d.note})"
            lines.append(line)
        return "\n".join(lines)


def split_heldback(batches: Sequence[Any], every: int = 4) -> tuple[list[Any], list[Any]]:
    """``(fit, heldback)``: every ``every``-th batch held back (at least one batch each
    side when there are two or more).  A single tensor batch is split along its first
    dimension instead (its last quarter held back); a single non-tensor batch cannot be
    split and comes back as ``([batch], [])`` - the caller then keeps its change
    unchecked and says so in the decision's note."""
    batches = list(batches)
    if len(batches) >= 2:
        held = [b for i, b in enumerate(batches) if i % every == every - 1] or [batches[-1]]
        held_ids = {id(b) for b in held}
        fit = [b for b in batches if id(b) not in held_ids]
        return fit, held
    if len(batches) == 1 and isinstance(batches[0], torch.Tensor) and batches[0].shape[0] >= 2:
        x = batches[0]
        cut = max(1, x.shape[0] - max(1, x.shape[0] // every))
        return [x[:cut]], [x[cut:]]
    return batches, []


"""Post-training calibration and freezing (the calibration layer, above ``qdsl.patch``).

* ``with calibrating(model): ...`` - every static activation quantizer *observes* and
  passes its input through; weights and biases pass through too, so the model computes
  in float (BN folding, if on, is already in effect: same function, folded form).  This
  is the standard PTQ choice (torch.ao does the same): statistics are those of the
  float network.  The model runs in eval mode inside the block (BatchNorm statistics
  and dropout are left alone) and gets its train/eval flags back afterwards.
* ``calibrate(model, batches, num_batches=None, progress=None, steps=None)`` runs
  batches under ``torch.no_grad()`` inside ``calibrating``.  A batch is a tensor, a
  tuple/list (positional inputs, then targets: ``(x, y)`` pairs call ``model(x)``,
  ``(x, h, c)`` calls ``model(x, h, c)`` when forward requires three) or a dict of
  keyword arguments; the rule and the ``inputs=`` selector that overrides it are in
  :mod:`qdsl.calibration.batches`.  A small progress bar goes to stderr when it is a terminal
  (``progress=True/False`` forces it).  Under ``torch.distributed`` the observer
  statistics of all ranks are merged (:mod:`qdsl.calibration.distributed`).  Then, if
  the spec enables them, learned rounding and bias correction run on the same batches:
  they plug in here as ``steps`` (:mod:`qdsl.ptq.pipeline`, which sits above this layer;
  ``qdsl.calibrate`` passes it).
* ``freeze(model)`` fixes every scale (buffers; observers stop), reporting *all*
  quantizers that never saw data in one error.  After it the state is FROZEN.

States: calibrating moves PREPARED (or CALIBRATING) to CALIBRATING; after calibration
and before freeze the model fake-quantizes with the scales its statistics give.
Calibrating a frozen model, freezing twice, or either on a model qdsl was not applied
to is a :class:`~qdsl.spec.diagnostics.QdslError`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from qdsl.calibration.batches import batch_call
from qdsl.patch.frozen import frozen_layer
from qdsl.patch.handle import State, get_handle
from qdsl.spec.diagnostics import QdslError

__all__ = ["calibrate", "calibrating", "freeze", "ProgressBar"]


class ProgressBar:
    """``label [#####.....] 12/100 1.2s`` on one stderr line, redrawn at most 10×/s."""

    def __init__(self, label: str, total: int | None, enabled: bool | None = None, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.label, self.total, self.n = label, total, 0
        self.t0 = time.monotonic()
        self._last = 0.0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or self.n == self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        if self.total:
            filled = int(20 * min(self.n, self.total) / self.total)
            bar = f"[{'#' * filled}{'.' * (20 - filled)}] {self.n}/{self.total}"
        else:
            bar = f"{self.n}"
        self.stream.write(f"\r{self.label} {bar} batches {now - self.t0:.1f}s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


def _activation_proxies(handle) -> list[Any]:
    return list(handle.container.quantizers.values())


@contextlib.contextmanager
def calibrating(model: nn.Module) -> Iterator[nn.Module]:
    """Observe statistics while the block runs (see the module docstring)."""
    handle = get_handle(model)
    if handle.state in (State.FROZEN, State.EXPORTED):
        raise QdslError(
            f"this model is {handle.state.value}: its scales are fixed; calibrate before qdsl.freeze(model)"
        )
    proxies = _activation_proxies(handle)
    if any(q.observing for q in proxies):
        raise QdslError("calibrating(model) is already active for this model")
    modes = {m: m.training for m in model.modules()}
    handle.state = State.CALIBRATING
    model.eval()
    for q in proxies:
        q.observing = True
    try:
        yield model
    finally:
        for q in proxies:
            q.observing = False
        for m, training in modes.items():
            m.training = training
        handle.state = State.CALIBRATING  # bump the generation: statistics changed
        for patch in handle.layers.values():
            patch.refresh_now()  # module.weight reads the quantized weight again


def _spec_steps(model: nn.Module) -> list[str]:
    # what the spec asks to run after the observers (qdsl.ptq.pipeline implements them)
    spec = get_handle(model).plan.spec
    names = [] if spec.learned_rounding in (None, "none") else [f"learned_rounding = '{spec.learned_rounding}'"]
    return names + (["bias_correction = true"] if spec.bias_correction else [])


def calibrate(model: nn.Module, batches: Iterable[Any], num_batches: int | None = None,
              progress: bool | None = None, *, steps: Any = None, inputs: Any = None) -> nn.Module:
    """Run ``batches`` (at most ``num_batches``) through the model while observing.

    ``inputs``: which part of a tuple/list batch is the model's input (None: the rule of
    :mod:`qdsl.calibration.batches`; ``"all"``; an int k: the first k elements; or a
    callable ``batch -> inputs``).  A batch that does not fit ``model.forward`` raises
    :class:`~qdsl.calibration.batches.BatchError` naming the batch and the forward.

    Under ``torch.distributed`` (initialised), the observer statistics of all ranks are
    merged afterwards (:func:`qdsl.calibration.distributed.sync_observers`), so every
    rank holds the same scales; the ``calibrating()`` context leaves that step to the caller.

    ``steps``: the post-observer PTQ steps, an object with ``ptq_steps(model) -> list``
    and ``finish_calibration(model, batches)`` (the module :mod:`qdsl.ptq.pipeline`;
    ``qdsl.calibrate`` passes it).  Without it, a spec that enables learned rounding or
    bias correction is an error rather than silently calibrated without them.
    """
    if num_batches is not None and num_batches < 1:
        raise QdslError(f"num_batches must be >= 1, got {num_batches}")
    total = num_batches
    if total is None and hasattr(batches, "__len__"):
        total = len(batches)  # type: ignore[arg-type]
    if steps is None:
        wanted = _spec_steps(model)
        if wanted:
            raise QdslError(f"the spec enables {' and '.join(wanted)}, which run in qdsl.calibrate; "
                            "call qdsl.calibrate(model, batches), or pass steps=qdsl.ptq.pipeline")
    # learned rounding / bias correction (spec) run after the observers, on the same batches
    kept: list[Any] | None = [] if steps is not None and steps.ptq_steps(model) else None
    bar = ProgressBar("calibrating", total, progress)
    seen = 0
    with calibrating(model), torch.no_grad():
        for batch in batches:
            if num_batches is not None and seen >= num_batches:
                break
            call = batch_call(model, batch, inputs, index=seen)
            model(*call.args, **call.kwargs)
            if kept is not None:
                kept.append(call)  # the PTQ steps re-run exactly these calls
            seen += 1
            bar.update()
    bar.close()
    if seen == 0:
        raise QdslError("calibrate got no batches: the iterable was empty")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # every rank saw its own shard: merge the observer statistics (a collective, so
        # every rank calls calibrate) so all ranks derive identical scales
        from qdsl.calibration.distributed import sync_observers

        sync_observers(model)
    if kept:
        steps.finish_calibration(model, kept)
    return model


def freeze(model: nn.Module) -> nn.Module:
    """Fix every scale; see the module docstring."""
    handle = get_handle(model)
    if handle.state in (State.FROZEN, State.EXPORTED):
        raise QdslError(f"this model is already {handle.state.value}; qdsl.freeze(model) runs once")
    missing = [q.name for q in handle.container.quantizers.values() if not q.calibrated and not q.derived]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise QdslError(
            f"{len(missing)} activation quantizer(s) never observed data: {shown}; "
            "run qdsl.calibrate(model, batches) (or use dynamic = true for them) before qdsl.freeze(model)"
        )
    lean = [fqn for fqn, p in handle.layers.items() if getattr(p.module, "_qdsl_lean", False)]
    if lean:  # qdsl.qat.lean: the float master lives in an optimizer, not on the module
        raise QdslError(f"layer(s) {', '.join(lean)} hold lean weights: "
                        "call finish() on the LeanOptimizer before qdsl.freeze(model)")
    for patch in handle.layers.values():
        patch.freeze()
    handle.state = State.FROZEN
    for patch in handle.layers.values():
        patch.refresh_now()
        frozen_layer(patch)  # the per-layer record export, int_tensors and lint read
    return model

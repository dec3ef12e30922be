"""Progress of a training loop for the long steps of a workflow (``qdsl demo``).

:class:`TrainProgress` is the ``progress`` callback of :func:`qdsl.zoo.train.train_float`
and :func:`qdsl.qat.fit` (called after every optimizer step with ``(epoch, step,
steps_per_epoch, loss)``).  On a terminal it redraws one bar line (at most 10 times a
second); otherwise (a log file, CI) it writes one line per epoch, so a slow, shared
machine shows it is working either way.  Both give the epoch, the mean loss so far in the
epoch and the elapsed time.
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["TrainProgress"]


class TrainProgress:
    """``label epoch 2/6 [#########...........] loss 0.412 3.1s``; see the module docstring."""

    def __init__(self, label: str, epochs: int, *, stream: Any = None, tty: bool | None = None,
                 indent: str = "      "):
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.tty = tty
        self.label, self.epochs, self.indent = label, epochs, indent
        self.steps = 0
        """Optimizer steps reported so far (0 after a cached result: nothing trained)."""
        self.t0 = time.monotonic()
        self._last = 0.0
        self._loss_sum = 0.0
        self._loss_n = 0

    def __call__(self, epoch: int, step: int, steps: int, loss: float) -> None:
        if step == 0:
            self._loss_sum, self._loss_n = 0.0, 0
        self.steps += 1
        self._loss_sum += float(loss)
        self._loss_n += 1
        end_of_epoch = step + 1 >= steps
        now = time.monotonic()
        if self.tty:
            if end_of_epoch or now - self._last >= 0.1:
                self._last = now
                self._write("\r" + self._line(epoch, (step + 1) / max(1, steps), now))
                if end_of_epoch and epoch + 1 >= self.epochs:
                    self._write("\n")
        elif end_of_epoch:
            self._write(self._line(epoch, None, now) + "\n")

    def _line(self, epoch: int, frac: float | None, now: float) -> str:
        bar = ""
        if frac is not None:
            filled = int(20 * min(1.0, frac))
            bar = f" [{'#' * filled}{'.' * (20 - filled)}]"
        loss = self._loss_sum / max(1, self._loss_n)
        return f"{self.indent}{self.label} epoch {epoch + 1}/{self.epochs}{bar} loss {loss:.3f} {now - self.t0:.1f}s"

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

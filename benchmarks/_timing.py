"""Timing shared by the runtime benchmarks (kernels.py, e2e.py)."""

from __future__ import annotations

import time

import numpy as np


def steady_median(fn, reps: int, warmup_s: float) -> float:
    """Median wall time (s) of `reps` consecutive calls of `fn`, after calling it for
    `warmup_s` seconds (at least once), so it is measured in its own steady state: after
    an idle period cores clock up again, and another library's pool may still be
    busy-waiting from its last call."""
    end = time.perf_counter() + warmup_s
    fn()
    while time.perf_counter() < end:
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def load_average() -> str:
    """The 1/5/15-minute load averages, for every benchmark's header and footer: figures
    taken while another process held a core are not comparable (docs in README, Speed)."""
    import os

    return " ".join(f"{v:.2f}" for v in os.getloadavg())

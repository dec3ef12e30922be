"""Timing shared by the runtime benchmarks (kernels.py, e2e.py, run_graph.py)."""

from __future__ import annotations

import os
import re
import tempfile
import time

import numpy as np

__all__ = ["add_timing_args", "interleaved", "load_average", "profile_lines", "span", "steady_median",
           "timing_args"]


def steady_median(fn, reps: int, warmup_s: float, clock=time.perf_counter) -> float:
    """Median time (s; wall time unless `clock` is another, e.g. time.process_time) of
    `reps` consecutive calls of `fn`, after calling it for `warmup_s` seconds of wall time
    (at least once), so it is measured in its own steady state: after an idle period cores
    clock up again, and another library's pool may still be busy-waiting from its last call."""
    end = time.perf_counter() + warmup_s
    fn()
    while time.perf_counter() < end:
        fn()
    times = []
    for _ in range(reps):
        t = clock()
        fn()
        times.append(clock() - t)
    return float(np.median(times))


_PROFILE_LINE = re.compile(r"qdsl op\s+(\d+) (\S+)\s+wall\s+([\d.]+) ms\s+cpu\s+([\d.]+) ms"
                           r"(?:\s+jobs (\d+)/(\d+) tasks (\d+) caller (\d+) tail ([\d.]+) ms)?")


def profile_lines(compiled, x, runs: int) -> list[tuple]:
    """The runtime's QDSL_PROFILE=1 lines (stderr; the library reads the variable once, so the
    calling script sets it before qdsl.runtime loads) of `runs` calls of ``compiled.run(x)``,
    parsed as (op index, op name, wall ms, cpu ms, parallel jobs, serial jobs, tasks, the
    caller's tasks, tail ms); the five pool fields are None in a line without them."""
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as f:
        os.dup2(f.fileno(), 2)
        try:
            for _ in range(runs):
                compiled.run(x)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        out = []
        for m in map(_PROFILE_LINE.match, f):
            if m:
                pool = (None,) * 5 if m[5] is None else (*map(int, m.groups()[4:8]), float(m[9]))
                out.append((int(m[1]), m[2], float(m[3]), float(m[4]), *pool))
        return out


def interleaved(fns: dict, rounds: int, reps: int, warmup_s: float, clock=time.perf_counter) -> dict[str, list[float]]:
    """Each function's steady median (s) once per round, the functions taken in turn within
    every round (A, B, C, A, B, C, ...), so a slow drift of the machine (another process
    starting, clocks) lands on every contender instead of on whichever ran last.  `clock`:
    as in `steady_median`.  Returns the per-round medians by name; report their median and
    range (`span`)."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            out[name].append(steady_median(fn, reps, warmup_s, clock))
    return out


def span(values, scale: float = 1.0, fmt: str = ".2f") -> str:
    """``median (min-max)`` of `values` times `scale`, the form every figure here is given in."""
    v = np.asarray(values, dtype=np.float64) * scale
    return f"{np.median(v):{fmt}} ({v.min():{fmt}}-{v.max():{fmt}})"


def add_timing_args(ap, *, rounds: int, reps: int, threads: str = "1,2") -> None:
    """The options every interleaved benchmark takes: --threads (comma list), --rounds, --reps,
    --quick (1 thread and at most 3 rounds unless given; each script drops more).  Call
    `timing_args` on the parsed namespace."""
    ap.add_argument("--threads", default=None, help=f"comma-separated thread counts (default {threads}; --quick: 1)")
    ap.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default {rounds}; --quick: 3)")
    ap.add_argument("--reps", type=int, default=reps, help=f"timed calls per contender per round (default {reps})")
    ap.add_argument("--quick", action="store_true", help="a short run: fewer rounds, threads, shapes or models")
    ap.set_defaults(timing_defaults=(rounds, threads))


def timing_args(args):
    """Fill in --threads (as a list of ints) and --rounds from the defaults and --quick."""
    rounds, threads = args.timing_defaults
    args.rounds = args.rounds or (min(rounds, 3) if args.quick else rounds)
    args.threads = [int(t) for t in (args.threads or ("1" if args.quick else threads)).split(",")]
    return args


def load_average() -> str:
    """The 1/5/15-minute load averages, for every benchmark's header and footer: figures
    taken while another process held a core are not comparable (docs in README, Speed)."""
    import os

    return " ".join(f"{v:.2f}" for v in os.getloadavg())

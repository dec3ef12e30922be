"""Per-op wall times of ResNet-18 at batch 1 (the model of benchmarks/threads.py) at 1 and
2 threads, from the runtime's QDSL_PROFILE=1 lines (issue 18: which ops lose the 2-thread
speedup).

    python benchmarks/thread_ops.py [--runs 20] [--rounds 3]

Each round runs the graph --runs times at 1 thread, then at 2, with the profile lines of
stderr captured in a temporary file; the table gives per op the median over all runs of
the wall time and of the process CPU time (std::clock: both threads, spinning included)
at each count, and the speedup.  Per-op figures add up to more than a plain run (the
profile's clock reads and prints); compare the columns, not the totals with threads.py.
"""

from __future__ import annotations

import os

os.environ["QDSL_PROFILE"] = "1"  # read once by the library, before it is loaded
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import re
import sys
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's qdsl

from _timing import load_average  # noqa: E402
from threads import _build  # noqa: E402

_LINE = re.compile(r"qdsl op\s+(\d+) (\S+)\s+wall\s+([\d.]+) ms\s+cpu\s+([\d.]+) ms")


def _profiled(compiled, x, runs: int) -> list[tuple[int, str, float, float]]:
    """The profile lines of `runs` runs, as (op index, name, wall ms, cpu ms)."""
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
        return [(int(m[1]), m[2], float(m[3]), float(m[4])) for m in map(_LINE.match, f) if m]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import qdsl.runtime as rt

    torch.set_num_threads(1)
    compiled, x = _build(1)
    print(f"load average before {load_average()}")
    per = {n: defaultdict(lambda: ([], [])) for n in (1, 2)}
    for _ in range(args.rounds):
        for n in (1, 2):
            rt.set_num_threads(n)
            _profiled(compiled, x, 3)  # warm-up
            for oi, name, wall, cpu in _profiled(compiled, x, args.runs):
                per[n][(oi, name)][0].append(wall)
                per[n][(oi, name)][1].append(cpu)
    print(f"{'op':34s} {'1 thr wall':>10s} {'cpu':>7s} {'2 thr wall':>10s} {'cpu':>7s} {'speedup':>7s}")
    tot = np.zeros(4)
    for key in sorted(per[1]):
        v = np.array([np.median(per[n][key][i]) for n in (1, 2) for i in (0, 1)])
        tot += v
        print(f"{key[0]:3d} {key[1]:30s} {v[0]:10.3f} {v[1]:7.3f} {v[2]:10.3f} {v[3]:7.3f} {v[0] / max(v[2], 1e-6):7.2f}")
    print(f"{'sum of medians':34s} {tot[0]:10.3f} {tot[1]:7.3f} {tot[2]:10.3f} {tot[3]:7.3f} {tot[0] / tot[2]:7.2f}")
    print(f"load average after {load_average()}")


if __name__ == "__main__":
    main()

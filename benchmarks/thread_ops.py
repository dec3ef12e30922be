"""Per-op wall times at batch 1 at 1 and 2 threads, from the runtime's QDSL_PROFILE=1 lines
(issue 18: which ops lose the 2-thread speedup).  Models: ResNet-18 (the model of
benchmarks/threads.py; ``resnet18-a7``: 7-bit activations), MobileNetV2 with 7-bit
activations, the MiniLM-shaped encoder of benchmarks/encoder.py (seq 128).

    python benchmarks/thread_ops.py [--model resnet18] [--runs 20] [--rounds 3]

Each round runs the graph --runs times at 1 thread, then at 2, with the profile lines of
stderr captured in a temporary file; the table gives per op the median over all runs of
the wall time and of the process CPU time (std::clock: both threads, spinning included)
at each count, and the speedup.  Per-op figures add up to more than a plain run (the
profile's clock reads and prints); compare the columns, not the totals with threads.py.
At 2 threads it also gives, per op and run, the pool's tasks (claims offered: a count near
the thread count leaves a thread slowed by another process holding the op's tail), the
share of them the calling thread ran, and the mean time per run it waited for tasks the
other thread held ("tail"; threads/thread_pool.h PoolStats).  On a loaded machine the
pool's SoloPolicy may run some jobs serially (jobs "par/ser" below 1/0): QDSL_POOL_ADAPT=0
shows how the ops are cut.
"""

from __future__ import annotations

import os

os.environ["QDSL_PROFILE"] = "1"  # read once by the library, before it is loaded
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's qdsl

from _timing import load_average, profile_lines  # noqa: E402
from threads import _build  # noqa: E402


def _model(name: str):
    """(CompiledGraph, input) of `name` at batch 1."""
    if name == "resnet18":
        return _build(1)
    import copy

    import qdsl
    import qdsl.runtime as rt

    g = torch.Generator().manual_seed(0)
    if name == "encoder":
        import encoder

        model = encoder._model()
        x = torch.randn(1, 128, 384, generator=g)
        _, compiled = encoder._qdsl_graph(model, 128)
        return compiled, x.numpy()
    from qdsl.zoo.mobilenet import mobilenet_v2
    from qdsl.zoo.resnet import resnet18

    model = {"resnet18-a7": resnet18, "mobilenet_v2-a7": mobilenet_v2}[name](seed=0).eval()
    calib = [torch.randn(2, 3, 224, 224, generator=g) for _ in range(2)]
    qmodel = copy.deepcopy(model)
    qdsl.apply(qmodel, qdsl.load_spec("specs/int8-default.qspec"), overrides=["input.bits=7", "output.bits=7"])
    with torch.no_grad():
        qdsl.calibrate(qmodel, calib, progress=False)
    qdsl.freeze(qmodel)
    return rt.CompiledGraph(qdsl.export(qmodel, calib[0][:1])), torch.randn(1, 3, 224, 224, generator=g).numpy()


def _profiled(compiled, x, runs: int) -> list[tuple]:
    """The profile lines of `runs` runs (_timing.profile_lines) that carry the pool fields."""
    return [line for line in profile_lines(compiled, x, runs) if line[4] is not None]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="resnet18", choices=["resnet18", "resnet18-a7", "mobilenet_v2-a7", "encoder"])
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import qdsl.runtime as rt

    torch.set_num_threads(1)
    compiled, x = _model(args.model)
    print(f"{args.model}, batch 1; load average before {load_average()}")
    per = {n: defaultdict(lambda: ([], [])) for n in (1, 2)}
    pool = defaultdict(list)  # 2 threads: (parallel jobs, serial jobs, tasks, caller's share, tail ms) per run
    for _ in range(args.rounds):
        for n in (1, 2):
            rt.set_num_threads(n)
            _profiled(compiled, x, 3)  # warm-up
            for oi, name, wall, cpu, pj, sj, tasks, mine, tail in _profiled(compiled, x, args.runs):
                per[n][(oi, name)][0].append(wall)
                per[n][(oi, name)][1].append(cpu)
                if n == 2:
                    pool[(oi, name)].append((pj, sj, tasks, mine / max(tasks, 1), tail))
    print(f"{'op':34s} {'1 thr wall':>10s} {'cpu':>7s} {'2 thr wall':>10s} {'cpu':>7s} {'speedup':>7s}"
          f"  {'jobs par/ser':>12s} {'tasks':>6s} {'caller':>6s} {'tail ms':>7s}")
    tot = np.zeros(5)
    for key in sorted(per[1]):
        v = np.array([np.median(per[n][key][i]) for n in (1, 2) for i in (0, 1)])
        q = np.median(np.array(pool[key]), axis=0)
        q[4] = np.mean(np.array(pool[key])[:, 4])  # tails are rare and long: their mean
        tot += np.append(v, q[4])
        print(f"{key[0]:3d} {key[1]:30s} {v[0]:10.3f} {v[1]:7.3f} {v[2]:10.3f} {v[3]:7.3f} {v[0] / max(v[2], 1e-6):7.2f}"
              f"  {q[0]:5.0f}/{q[1]:<6.0f} {q[2]:6.0f} {q[3]:6.2f} {q[4]:7.3f}")
    print(f"{'sum of medians':34s} {tot[0]:10.3f} {tot[1]:7.3f} {tot[2]:10.3f} {tot[3]:7.3f} {tot[0] / tot[2]:7.2f}"
          f"  {'':21s} {tot[4]:7.3f}")
    print(f"load average after {load_average()}")


if __name__ == "__main__":
    main()

"""``qdsl.run_graph(graph, x)`` vs ``CompiledGraph(graph).run(x)``: what the documented
one-call API costs over holding the compiled graph yourself.

run_graph keeps the compiled form on the graph object (qdsl/export/__init__.py), so from
the second call on it should cost what ``CompiledGraph.run`` does plus a fingerprint check;
``compile+run`` is what every run_graph call cost before that cache (weights packed per
call).  Models: the digits ResNet (1x8x8) and its CIFAR-sized version (width 32, 3x32x32),
specs/int8-default.qspec.  Each variant is timed in its own steady state
(benchmarks/_timing.py), the three variants interleaved over ``--rounds`` rounds; the figure
is the median over rounds.  Run: python benchmarks/run_graph.py [--threads 1] [--reps 30] [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import copy
import warnings

import numpy as np
import torch
from _timing import add_timing_args, interleaved, load_average, timing_args


def main() -> None:
    ap = argparse.ArgumentParser()
    add_timing_args(ap, rounds=3, reps=30, threads="1")
    args = timing_args(ap.parse_args())
    warnings.filterwarnings("ignore")
    import qdsl.runtime as rt

    if not rt.available():
        raise SystemExit(f"qdsl runtime unavailable: {rt.load_error()}")
    print(f"load average: {load_average()}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        rt.set_num_threads(threads)
        print(f"threads: {threads}")
        _table(args)
    print(f"load average after: {load_average()}")


def _table(args) -> None:
    import qdsl
    import qdsl.runtime as rt
    from qdsl.export import export
    from qdsl.zoo.models import DigitsResNet

    print(f"{'model':<22} {'batch':>5} | {'run_graph':>9} {'.run':>9} {'compile+run':>11} ms | run_graph/.run")
    for name, width, in_ch, size in [("digits ResNet 1x8x8", 16, 1, 8), ("ResNet w32 3x32x32", 32, 3, 32)]:
        torch.manual_seed(0)
        model = DigitsResNet(width=width, in_ch=in_ch).eval()
        calib = torch.randn(256, in_ch, size, size)
        qmodel = copy.deepcopy(model)
        qdsl.apply(qmodel, qdsl.load_spec("specs/int8-default.qspec"))
        qdsl.calibrate(qmodel, [calib[i:i + 64] for i in range(0, 256, 64)], progress=False)
        qdsl.freeze(qmodel)
        graph = export(qmodel, calib[:2])
        compiled = rt.CompiledGraph(graph)
        for batch in (1, 32):
            xn = torch.randn(batch, in_ch, size, size).numpy()
            assert np.array_equal(qdsl.run_graph(graph, xn), compiled.run(xn))
            fns = {"run_graph": lambda: qdsl.run_graph(graph, xn), "run": lambda: compiled.run(xn),
                   "compile+run": lambda: rt.CompiledGraph(graph).run(xn)}
            per_round = interleaved(fns, args.rounds, args.reps, warmup_s=0.3)
            t_rg, t_run, t_cr = (1e3 * float(np.median(v)) for v in per_round.values())
            print(f"{name:<22} {batch:>5} | {t_rg:9.3f} {t_run:9.3f} {t_cr:11.3f}    | {t_rg / t_run:.2f}")


if __name__ == "__main__":
    main()

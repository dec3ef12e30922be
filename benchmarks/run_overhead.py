"""What one ``CompiledGraph.run`` costs outside the graph's ops, on ResNet-18's input
(float32 3x224x224, batch 1 and 8), 1 thread, in process CPU time (``time.process_time``:
less sensitive to a loaded machine than wall time).

  python side   ``run`` with the library's ``qdsl_graph_run`` replaced by a no-op: input
                checks, pointer arrays, output allocation, the lock; what the Python layer
                adds to every run.
  whole run     a real run of a graph that only quantizes the input and takes its global
                average (QUANTIZE -> GLOBAL_AVGPOOL, 3 outputs): the above, plus the
                executor's setup, its copy of the input into its buffer and two cheap ops.
  input copy    ``np.copyto`` of the input's bytes: what that copy costs by itself.

Compare with a model's run time (e2e.py) to see what share of it this is.  Figures are the
median (range) over ``--rounds`` rounds of the median of ``--reps`` calls, the variants
interleaved round by round.  ``--graph g.qgraph`` (a saved model graph with a float
3x224x224 input, e.g. ResNet-18's) times the python side on that graph instead: its cost
grows with the number of ops where it handles per-op data.
Run: python benchmarks/run_overhead.py [--rounds 7] [--reps 200] [--graph g.qgraph]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's qdsl

__all__ = ["main"]


def _graph():
    from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Tensor
    from qdsl.graph.requant import make_rescale

    tensors = [Tensor("x", DType.F32, (-1, 3, 224, 224)), Tensor("q", DType.U8, (-1, 3, 224, 224)),
               Tensor("y", DType.U8, (-1, 3, 1, 1))]
    ops = [Op(OpType.QUANTIZE, "quantize", ["x"], ["q"],
              {"scale": 0.02, "zero_point": 128, "qmin": 0, "qmax": 255, "rounding": 1}),
           Op(OpType.GLOBAL_AVGPOOL, "pool", ["q"], ["y"],
              {"in_zp": 128, **OutputStage(make_rescale(1.0 / 50176), 128, 0, 255).attrs()})]
    return IntegerGraph(tensors, ["x"], ["y"], ops).validate()


class _NoRun:
    """The loaded library with ``qdsl_graph_run`` a no-op (status 0)."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def qdsl_graph_run(self, *args):
        return 0


def _cpu_median(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--graph", help="a saved graph (3x224x224 float input) for the python side")
    args = ap.parse_args(argv)
    import qdsl.runtime as rt

    if not rt.available():
        raise SystemExit(f"qdsl runtime unavailable: {rt.load_error()}")
    rt.set_num_threads(1)
    graph = _graph()
    real = rt.CompiledGraph(graph)
    if args.graph:
        from qdsl.graph.qgraph import load_graph

        stub = rt.CompiledGraph(load_graph(args.graph))
    else:
        stub = rt.CompiledGraph(graph)
    stub._lib = _NoRun(stub._lib)
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for batch in (int(b) for b in args.batches.split(",")):
        x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32)
        dst = np.empty_like(x)
        fns = {"python side": lambda: stub.run(x), "whole run": lambda: real.run(x),
               "input copy": lambda: np.copyto(dst, x)}
        res: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                res[k].append(_cpu_median(fn, args.reps))
        cells = [f"{k} {statistics.median(v) * 1e6:.1f} us ({min(v) * 1e6:.1f}-{max(v) * 1e6:.1f})"
                 for k, v in res.items()]
        print(f"batch {batch}: " + "; ".join(cells), flush=True)
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()

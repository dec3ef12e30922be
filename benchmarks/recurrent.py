"""A 2-layer LSTM: qdsl's C++ graph (static int8 LSTM ops, dynamic LSTM_DYNAMIC ops) vs
fp32 PyTorch vs torch.ao's ``quantize_dynamic`` (its dynamically quantized nn.LSTM).

Model: ``nn.LSTM(F, H, 2, batch_first=True)`` and a per-step ``Linear(H, 8)``, F = 64
features, H = 128 and 256, sequence 100 and 200, batch 1 and 8.  qdsl static: int8
per-channel weights, uint8 inputs, int8 hidden state, 16-bit cell, calibrated on random
sequences (the spec below); qdsl dynamic: specs/int8-dynamic.qspec (torch.ao's recipe).
``--ref`` adds qdsl static on the reference path (the scalar per-sample loop the optimized
paths replaced: the before figure).  Each contender is timed in its own steady state
(benchmarks/_timing.py), interleaved over ``--rounds`` rounds at 1 thread; figures are
medians (min-max over rounds) in ms, with the load average before and after.

Measured (2 cores shared with ~7 other jobs, load average 9-13: wall times are mostly the wait
for a core, so ``--cpu``, the calling thread's CPU time, 3 interleaved rounds; ms, median):

    H   T  N |  fp32  torch.ao  qdsl static  qdsl dynamic  qdsl static, reference path
  128 100  1 |   3.7     10.0       5.0          3.8          22.1
  128 100  8 |  12.3     22.2      33.4         23.5         207.5
  128 200  1 |   7.2     19.4       9.8          8.3          53.7
  128 200  8 |  24.6     44.2      66.2         62.0         395.1
  256 100  1 |  11.7     15.3      11.5         10.5          96.9
  256 100  8 |  30.6     28.4      69.9         66.9         658.1
  256 200  1 |  15.3     17.2      18.0         15.3         147.5
  256 200  8 |  64.5     65.3     147.5        126.3        1272.5

The optimized paths (the GEMM front door for the input products of all steps and the
hidden products per step) are 4.4-9.4x the scalar reference loop; at batch 1 qdsl is within
0.75-1.35x of fp32 and at or below torch.ao; at batch 8 it is 2-2.7x fp32 and 1.5-2.5x
torch.ao: the per-sample gate math (int64 fixed point, table sigmoid) is still scalar.

Run (from the repository root): PYTHONPATH=. python benchmarks/recurrent.py [--rounds 5] [--reps 5] [--ref] [--cpu]
[--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import copy
import warnings

import time

import numpy as np
import torch
from _timing import add_timing_args, interleaved, load_average, span, timing_args
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STATIC = """version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
quantizer s8 = int(bits=8, signed, symmetric, per_tensor, observer=minmax)
defaults {
  weight = w8
  input = a8
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
rule type:LSTM {
  hidden = s8
  cell = int(bits=16, signed, symmetric, per_tensor, observer=minmax)
}
"""


class Seq(nn.Module):
    """The LSTM and a small per-step head (a dynamic graph's output is the head's F32 result)."""

    def __init__(self, feats: int, hidden: int):
        super().__init__()
        self.rnn = nn.LSTM(feats, hidden, 2, batch_first=True)
        self.fc = nn.Linear(hidden, 8)

    def forward(self, x):
        return self.fc(self.rnn(x)[0])


def cpu_interleaved(fns: dict, rounds: int, reps: int) -> dict[str, list[float]]:
    """``interleaved`` on the calling thread's CPU time (time.thread_time) instead of wall
    time: on a machine where other jobs hold the cores, wall time mostly measures the wait
    for a core.  Fair at 1 thread only (torch and qdsl then compute on the calling thread)."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            times = []
            for _ in range(reps):
                t = time.thread_time()
                fn()
                times.append(time.thread_time() - t)
            out[name].append(float(np.median(times)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    add_timing_args(ap, rounds=5, reps=5, threads="1")
    ap.add_argument("--ref", action="store_true", help="also time qdsl static on the reference (scalar) path")
    ap.add_argument("--cpu", action="store_true", help="time the calling thread's CPU time, not wall time "
                    "(1 thread; for a machine shared with other jobs)")
    args = timing_args(ap.parse_args())
    warnings.filterwarnings("ignore")
    import qdsl
    import qdsl.runtime as rt
    from qdsl.parse import parse_text

    if not rt.available():
        raise SystemExit(f"qdsl runtime unavailable: {rt.load_error()}")
    feats = 64
    hiddens = [128] if args.quick else [128, 256]
    seqs = [100] if args.quick else [100, 200]
    batches = [1, 8]
    print(f"load average: {load_average()}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        rt.set_num_threads(threads)
        print(f"\nthreads {threads}, 2-layer LSTM, F = {feats}, ms per call ({'CPU' if args.cpu else 'wall'} time)")
        names = ["fp32", "ao", "static", "dynamic"] + (["static_ref"] if args.ref else [])
        print(f"{'H':>4} {'T':>4} {'N':>3} | " + " ".join(f"{n:>20}" for n in names))
        for hid in hiddens:
            torch.manual_seed(0)
            fp32 = Seq(feats, hid).eval()
            ao = torch.ao.quantization.quantize_dynamic(copy.deepcopy(fp32), {nn.LSTM, nn.Linear}, dtype=torch.qint8)
            st = copy.deepcopy(fp32)
            qdsl.apply(st, parse_text(STATIC, "bench.qspec"))
            qdsl.calibrate(st, [torch.randn(8, 50, feats) for _ in range(2)])
            qdsl.freeze(st)
            dy = copy.deepcopy(fp32)
            qdsl.apply(dy, os.path.join(ROOT, "specs", "int8-dynamic.qspec"))
            qdsl.calibrate(dy, [torch.randn(2, 10, feats)])
            qdsl.freeze(dy)
            for steps in seqs:
                g_st = rt.CompiledGraph(qdsl.export(st, torch.randn(1, steps, feats)))
                g_dy = rt.CompiledGraph(qdsl.export(dy, torch.randn(1, steps, feats)))
                for n in batches:
                    x = torch.randn(n, steps, feats)
                    xn = x.numpy()

                    def run_fp32():
                        with torch.no_grad():
                            fp32(x)

                    def run_ao():
                        with torch.no_grad():
                            ao(x)

                    fns = {"fp32": run_fp32, "ao": run_ao, "static": lambda: g_st.run(xn),
                           "dynamic": lambda: g_dy.run(xn)}
                    if args.ref:
                        fns["static_ref"] = lambda: g_st.run(xn, path="ref")
                    times = (cpu_interleaved(fns, args.rounds, args.reps) if args.cpu
                             else interleaved(fns, args.rounds, args.reps, warmup_s=0.1))
                    print(f"{hid:>4} {steps:>4} {n:>3} | " + " ".join(f"{span(times[k], 1e3):>20}" for k in names),
                          flush=True)
    print(f"\nload average: {load_average()}")


if __name__ == "__main__":
    main()

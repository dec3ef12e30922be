"""A 2-layer LSTM: qdsl's C++ graph (static int8 LSTM ops, dynamic LSTM_DYNAMIC ops) vs
fp32 PyTorch vs torch.ao's ``quantize_dynamic`` (its dynamically quantized nn.LSTM).

Model: ``nn.LSTM(F, H, 2, batch_first=True)`` returning its output sequence, F = 64
features, H = 128 and 256, sequence 100 and 200, batch 1 and 8.  qdsl static: int8
per-channel weights, uint8 inputs, int8 hidden state, 16-bit cell, calibrated on random
sequences (the spec below); qdsl dynamic: specs/int8-dynamic.qspec (torch.ao's recipe).
``--ref`` adds qdsl static on the reference path (the scalar per-sample loop the optimized
paths replaced: the before figure).  Each contender is timed in its own steady state
(benchmarks/_timing.py), interleaved over ``--rounds`` rounds at 1 thread; figures are
medians (min-max over rounds) in ms, with the load average before and after.

Run: python benchmarks/recurrent.py [--rounds 5] [--reps 5] [--ref] [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import copy
import warnings

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
    def __init__(self, feats: int, hidden: int):
        super().__init__()
        self.rnn = nn.LSTM(feats, hidden, 2, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    add_timing_args(ap, rounds=5, reps=5, threads="1")
    ap.add_argument("--ref", action="store_true", help="also time qdsl static on the reference (scalar) path")
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
        print(f"\nthreads {threads}, 2-layer LSTM, F = {feats}, ms per call")
        names = ["fp32", "ao", "static", "dynamic"] + (["static_ref"] if args.ref else [])
        print(f"{'H':>4} {'T':>4} {'N':>3} | " + " ".join(f"{n:>20}" for n in names))
        for hid in hiddens:
            torch.manual_seed(0)
            fp32 = Seq(feats, hid).eval()
            ao = torch.ao.quantization.quantize_dynamic(copy.deepcopy(fp32), {nn.LSTM}, dtype=torch.qint8)
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
                    times = interleaved(fns, args.rounds, args.reps, warmup_s=0.1)
                    print(f"{hid:>4} {steps:>4} {n:>3} | " + " ".join(f"{span(times[k], 1e3):>20}" for k in names),
                          flush=True)
    print(f"\nload average: {load_average()}")


if __name__ == "__main__":
    main()

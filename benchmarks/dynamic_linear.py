"""Dynamic int8 Linear stacks: qdsl's C++ graph (QUANTIZE_DYNAMIC + LINEAR_DYNAMIC) vs
torch.ao's ``quantize_dynamic`` vs fp32 PyTorch, on transformer-sized shapes.

Models: ``Linear(d, 4d) -> ReLU -> Linear(4d, d)`` blocks (a transformer FFN) repeated
``--blocks`` times, input ``(batch·seq, d)`` with d = 384 (MiniLM) and 768 (BERT-base),
rows 8 (batch 1, a few tokens), 128 (batch 1 x 128 tokens) and 1024 (batch 8 x 128).
The qdsl spec is specs/int8-dynamic.qspec (uint8 per-tensor asymmetric dynamic inputs,
int8 per-channel weights, float bias: torch.ao's default dynamic recipe).  Each
contender is timed in its own steady state (benchmarks/_timing.py), the three interleaved
over ``--rounds`` rounds at 1 thread by default; figures are medians (min-max over rounds)
in ms, with the load average before and after.  Also printed: the largest |difference|
of each quantized output from fp32, relative to fp32's largest |value|.

Measured (2 cores shared with other jobs, load average 8-10: noisy; two runs each), 1 thread,
2 blocks, ms, torch.ao / qdsl: d=384 rows 128: 13.1-13.4 / 15.8-19.0 (8-bit), 13.5-19.8 /
14.1-23.1 (7-bit); d=768 rows 128: 38.8-46.6 / 53.0-60.0 (8-bit), 36.6-58.1 / 28.6-55.7 (7-bit);
rows 8: qdsl faster at d=384, slower at d=768; fp32 is 1.7-2.3x torch.ao.  8-bit codes
against int8 weights make the AVX2 GEMM take its int16 kernel (a u8×s8 pair sum can
saturate vpmaddubsw); 7-bit codes (torch.ao's own x86 setting) take the vpmaddubsw one.
Error vs fp32 (max |diff| / max |fp32|): qdsl 8-bit ~0.018, torch.ao ~0.033, qdsl 7-bit ~0.035.
Where the 8-bit gap is (issue 19; load 8-9, 1 thread, d=384, 128 rows): per op (QDSL_PROFILE,
CPU time) LINEAR_DYNAMIC takes 1.9-2.2 ms per 75.5M MACs with 8-bit codes (int16 kernel) and
1.2-1.6 ms with 7-bit codes (vpmaddubsw), QUANTIZE_DYNAMIC 0.07-0.3 ms: it is the kernel, not
the dynamic ops.  Interleaved: 8-bit qdsl 67.2 ms vs torch.ao 48.1; 7-bit qdsl 62.3 vs 72.6.

Run: python benchmarks/dynamic_linear.py [--threads 1] [--rounds 5] [--reps 20] [--bits 8|7] [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import copy
import warnings

import numpy as np
import torch
from _timing import add_timing_args, interleaved, load_average, span, timing_args
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ffn_stack(d: int, blocks: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d)]
    return nn.Sequential(*layers).eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    add_timing_args(ap, rounds=5, reps=20, threads="1")
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--bits", type=int, default=8,
                    help="qdsl's dynamic input bits (7: uint8 codes in [0, 127], what torch.ao's x86 "
                         "reduce_range uses; lets the AVX2 GEMM use its exact vpmaddubsw kernel)")
    args = timing_args(ap.parse_args())
    warnings.filterwarnings("ignore")
    import qdsl
    import qdsl.runtime as rt

    if not rt.available():
        raise SystemExit(f"qdsl runtime unavailable: {rt.load_error()}")
    from qdsl.parse import parse_text

    text = open(os.path.join(ROOT, "specs", "int8-dynamic.qspec")).read()
    spec = parse_text(text.replace("d8 = int(bits=8", f"d8 = int(bits={args.bits}"), "int8-dynamic.qspec")
    dims = [384] if args.quick else [384, 768]
    rows_list = [8, 128] if args.quick else [8, 128, 1024]
    print(f"load average: {load_average()}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        rt.set_num_threads(threads)
        print(f"\nthreads {threads}, {args.blocks} FFN blocks (d -> 4d -> ReLU -> d), qdsl inputs {args.bits}-bit, "
              "ms per call")
        print(f"{'d':>5} {'rows':>5} | {'fp32 torch':>20} {'torch.ao dynamic':>20} {'qdsl C++ dynamic':>20} | "
              f"{'err ao':>8} {'err qdsl':>8}")
        for d in dims:
            torch.manual_seed(0)
            fp32 = ffn_stack(d, args.blocks)
            ao = torch.ao.quantization.quantize_dynamic(copy.deepcopy(fp32), {nn.Linear}, dtype=torch.qint8)
            fq = copy.deepcopy(fp32)
            qdsl.apply(fq, spec)
            qdsl.freeze(fq)
            for rows in rows_list:
                x = torch.randn(rows, d)
                graph = qdsl.export(fq, x) if rows == rows_list[0] else graph
                cg = rt.CompiledGraph(graph) if rows == rows_list[0] else cg
                xn = x.numpy()
                with torch.no_grad():
                    ref = fp32(x).numpy()
                    y_ao = ao(x).numpy()
                y_q = cg.run(xn)
                top = float(np.abs(ref).max())
                err_ao, err_q = float(np.abs(y_ao - ref).max()) / top, float(np.abs(y_q - ref).max()) / top

                def run_fp32():
                    with torch.no_grad():
                        fp32(x)

                def run_ao():
                    with torch.no_grad():
                        ao(x)

                times = interleaved({"fp32": run_fp32, "ao": run_ao, "qdsl": lambda: cg.run(xn)},
                                    args.rounds, args.reps, warmup_s=0.2)
                print(f"{d:>5} {rows:>5} | {span(times['fp32'], 1e3):>20} {span(times['ao'], 1e3):>20} "
                      f"{span(times['qdsl'], 1e3):>20} | {err_ao:>8.4f} {err_q:>8.4f}")
    print(f"\nload average: {load_average()}")


if __name__ == "__main__":
    main()

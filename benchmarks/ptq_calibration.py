"""Time of the whole low-bit PTQ of the test CNN (DigitsResNet) on 256 calibration images.

    python benchmarks/ptq_calibration.py [--repeats 5] [--bits 3]

For each option set: apply the spec, calibrate (observers: bit-aware range search; then
the spec's learned rounding / bias correction), freeze - timed together, median of
``--repeats`` runs (wall and process CPU time) - then the test accuracy.  Target: under
30 s on 2 cores for the full option set (range search + bias correction + GPTQ).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import qdsl  # noqa: E402
from qdsl.zoo.train import evaluate, trained_digits_resnet  # noqa: E402

SPEC = ROOT / "specs" / "low-bit.qspec"

OPTIONS = {
    "range search only": ["bias_correction=false"],
    "range search + bias correction": [],
    "range search + GPTQ + bias correction": ["learned_rounding=gptq"],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    args = ap.parse_args(argv)
    if args.threads:
        # on a shared, oversubscribed machine 1 thread is much faster for these tiny models
        torch.set_num_threads(args.threads)
    model, (xtr, _ytr, xte, yte) = trained_digits_resnet()
    xcal = xtr[torch.randperm(len(xtr), generator=torch.Generator().manual_seed(0))[:256]]
    batches = [xcal[i : i + 64] for i in range(0, 256, 64)]
    print(f"DigitsResNet, W{args.bits}A{args.bits}, 256 calibration images, torch threads {torch.get_num_threads()}, "
          f"float accuracy {100 * evaluate(model, xte, yte):.2f}%")
    print(f"| options | wall s (median of {args.repeats}) | CPU s | accuracy % |")
    print("|---|---|---|---|")
    for name, extra in OPTIONS.items():
        walls, cpus, acc = [], [], 0.0
        for _ in range(args.repeats):
            w0, c0 = time.perf_counter(), time.process_time()
            qdsl.apply(model, SPEC, overrides=[f"weight.bits={args.bits}", f"input.bits={args.bits}"] + extra)
            qdsl.calibrate(model, batches, progress=False)
            qdsl.freeze(model)
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
            acc = 100 * evaluate(model, xte, yte)
            qdsl.remove(model)
        print(f"| {name} | {statistics.median(walls):.2f} | {statistics.median(cpus):.2f} | {acc:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Low-bit PTQ out of the box: plain vs each step alone vs ``auto``, with time per quantize call.

    python benchmarks/ptq_lowbit.py [--models digits,keywords] [--bits 8,6,4,3,2] [--repeat 1] [--seeds 1]

For each of the repo's trained test models (``qdsl.zoo.trained``: the digits ResNet and
the keyword-spotting Conv1dNet), at W8A8..W2A2 (every conv/linear weight and input at
the stated bits, BN folded, int32 bias), prints the test accuracy (%) of:

* ``plain``: min/max observers, no PTQ step (``observer = minmax``, ``learned_rounding =
  none``, ``bias_correction = false``);
* ``range search``: the ``auto`` observers alone (bit-aware weight and activation range
  search), no step;
* ``bias correction`` / ``gptq``: that step alone on the plain spec;
* ``auto - bias corr.`` / ``auto - gptq``: ``auto`` with that one step turned off (so the
  difference to ``auto`` is what turning the step on does);
* ``auto``: the spec below as written - nothing set, ``auto`` picks per bit width.

The spec is the README's plain one: per-channel symmetric weights, per-tensor affine
(zero point) inputs, ``auto`` observers, residual block outputs quantized.  Calibration:
256 training inputs (seeded; `--seeds N`: N calibration sets, cells the mean (min-max)), batches of 64.  ``s/call`` is the wall time of one quantize
call (``qdsl.apply`` + ``qdsl.calibrate`` + ``qdsl.freeze``) at 1 thread: the median over
``--repeat`` runs (variants interleaved) of the slowest bit width, and the same in
process CPU seconds (less sensitive to other load on a shared machine).  Noise: one test
sample is ``100/n`` points; the binomial standard deviation of an accuracy ``p`` on
``n`` samples is ``100·sqrt(p(1-p)/n)`` points, printed at the float accuracy and at 90%.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import qdsl  # noqa: E402
from qdsl.parse import parse_text  # noqa: E402
from qdsl.zoo.train import evaluate, trained_conv1d_net, trained_digits_resnet  # noqa: E402

SPEC = """\
version 1
fold_bn

quantizer w = int(bits=8, signed, symmetric, per_channel)
quantizer a = int(bits=8, asymmetric, per_tensor)

defaults {
  weight = w
  input  = a
  bias   = int(bits=32, signed, symmetric, scale=input*weight)
}

rule type:BasicBlock optional { output = a }
"""

MINMAX = ["weight.observer=minmax", "input.observer=minmax", "output.observer=minmax"]
NO_STEPS = ["learned_rounding=none", "bias_correction=false"]
VARIANTS = {
    "plain": MINMAX + NO_STEPS,
    "range search": NO_STEPS,
    "bias correction": MINMAX + ["learned_rounding=none", "bias_correction=true"],
    "gptq": MINMAX + ["learned_rounding=gptq", "bias_correction=false"],
    "auto - bias corr.": ["bias_correction=false"],
    "auto - gptq": ["learned_rounding=none"],
    "auto": [],
    "auto adaround": ["learned_rounding=adaround"],
}
TASKS = {"digits": ("DigitsResNet / digits", trained_digits_resnet),
         "keywords": ("Conv1dNet / keywords", trained_conv1d_net)}


def quantize_and_score(model, spec, overrides, xcal, xte, yte) -> tuple[float, float, float]:
    """(test accuracy %, wall and CPU seconds of apply + calibrate + freeze)."""
    t0, c0 = time.perf_counter(), time.process_time()
    qdsl.apply(model, spec, overrides=overrides)
    try:
        qdsl.calibrate(model, [xcal[i : i + 64] for i in range(0, len(xcal), 64)], progress=False)
        qdsl.freeze(model)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        return 100 * evaluate(model, xte, yte), dt, dc
    finally:
        qdsl.remove(model)


def _cell(accs: list[float]) -> str:
    """One accuracy, or the mean over calibration seeds with its range."""
    if len(accs) == 1:
        return f"{accs[0]:.2f}"
    return f"{statistics.mean(accs):.2f} ({min(accs):.1f}-{max(accs):.1f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits,keywords")
    ap.add_argument("--bits", default="8,6,4,3,2")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--repeat", type=int, default=1, help="timing repeats per cell (accuracy is deterministic)")
    ap.add_argument("--seeds", type=int, default=1,
                    help="calibration sets drawn with seeds 0..N-1; a cell is then the mean accuracy (min-max)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    bits = [int(b) for b in args.bits.split(",")]
    variants = [v.strip() for v in args.variants.split(",")]
    spec = parse_text(SPEC, "ptq_lowbit.qspec")
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print("| model | variant | float | " + " | ".join(f"W{b}A{b}" for b in bits) + " | s/call | cpu s/call |")
    print("|---|---|---|" + "---|" * len(bits) + "---|---|")
    noise = []
    t_all = time.perf_counter()
    for key in args.models.split(","):
        label, factory = TASKS[key]
        model, (xtr, _ytr, xte, yte) = factory()
        model.eval()
        xcals = [xtr[torch.randperm(len(xtr), generator=torch.Generator().manual_seed(seed))[:256]]
                 for seed in range(max(1, args.seeds))]
        fp = 100 * evaluate(model, xte, yte)
        acc = {v: {b: [] for b in bits} for v in variants}
        times = {v: {b: [] for b in bits} for v in variants}
        cpu = {v: {b: [] for b in bits} for v in variants}
        for rep in range(max(1, args.repeat)):
            for xcal in xcals if rep == 0 else xcals[:1]:  # timing repeats reuse the first set
                for b in bits:
                    for v in variants:  # interleaved, so load drifts hit every variant alike
                        a, dt, dc = quantize_and_score(model, spec, [f"weight.bits={b}", f"input.bits={b}",
                                                                 f"output.bits={b}", *VARIANTS[v]], xcal, xte, yte)
                        if rep == 0:
                            acc[v][b].append(a)
                        times[v][b].append(dt)
                        cpu[v][b].append(dc)
        for v in variants:
            slowest = max(statistics.median(times[v][b]) for b in bits)
            slowest_cpu = max(statistics.median(cpu[v][b]) for b in bits)
            print(f"| {label} | {v} | {fp:.2f} | " + " | ".join(_cell(acc[v][b]) for b in bits)
                  + f" | {slowest:.2f} | {slowest_cpu:.2f} |", flush=True)
        n = len(yte)
        p = fp / 100
        noise.append(f"{label}: n = {n} test samples, one sample = {100 / n:.2f} points, binomial std "
                     f"{100 * math.sqrt(p * (1 - p) / n):.2f} points at the float accuracy, "
                     f"{100 * math.sqrt(0.09 / n):.2f} at 90%")
    print("\nnoise: " + "\n       ".join(noise))
    print(f"({time.perf_counter() - t_all:.0f} s in all; 1 thread; load average after: "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

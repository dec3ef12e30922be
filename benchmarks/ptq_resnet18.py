"""Time of 4-bit weight PTQ (apply + calibrate) of a torchvision-shaped ResNet-18.

    python benchmarks/ptq_resnet18.py [--repeats 3] [--threads 1] [--bits 4]

Spec: ``defaults { weight = int(bits=4, signed, narrow, symmetric, per_channel) }``,
observer left to ``auto`` (below 8 bits: the per-channel bit-aware range search over
11.7M weights).  Calibration: 4 batches of 4 random 3×224×224 images.  Prints the
median (and range) over ``--repeats`` fresh models of apply, calibrate and their sum,
plus the time of one ``range_search.mse_range`` call over all weights layer by layer.
Target (issue 24): apply + calibrate < 10 s on one thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qdsl  # noqa: E402
from qdsl.parse import parse_text  # noqa: E402
from qdsl.quantizers import range_search as RS  # noqa: E402
from qdsl.zoo.resnet import resnet18  # noqa: E402
from _timing import load_average  # noqa: E402

SPEC = "version 1\ndefaults {{ weight = int(bits={bits}, signed, narrow, symmetric, per_channel) }}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bits", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = parse_text(SPEC.format(bits=args.bits), "w4.qspec")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 3, 224, 224, generator=g) for _ in range(4)]
    t_apply, t_cal, t_total = [], [], []
    for _ in range(args.repeats):
        model = resnet18(seed=0)
        t0 = time.perf_counter()
        qdsl.apply(model, spec)
        t1 = time.perf_counter()
        qdsl.calibrate(model, batches, progress=False)
        t2 = time.perf_counter()
        t_apply.append(t1 - t0)
        t_cal.append(t2 - t1)
        t_total.append(t2 - t0)
    model = resnet18(seed=0)
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    t0 = time.perf_counter()
    for w in weights:
        RS.mse_range(w.reshape(w.shape[0], -1), -(2 ** (args.bits - 1)) + 1, 2 ** (args.bits - 1) - 1,
                     symmetric=True, axis=0)
    t_search = time.perf_counter() - t0

    def fmt(ts):
        return f"{statistics.median(ts):7.2f} s  (range {min(ts):.2f}-{max(ts):.2f})"

    n = sum(w.numel() for w in weights)
    print(f"ResNet-18 ({n / 1e6:.1f}M weights), W{args.bits} per-channel auto observer, "
          f"4 batches of 4x3x224x224, {torch.get_num_threads()} thread(s), {args.repeats} repeats")
    print(f"  apply              {fmt(t_apply)}")
    print(f"  calibrate          {fmt(t_cal)}")
    print(f"  apply + calibrate  {fmt(t_total)}   target < 10 s")
    print(f"  mse_range alone over all weights: {t_search:.2f} s")
    print(f"  load average: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

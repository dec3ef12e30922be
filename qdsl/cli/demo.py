"""``qdsl demo``: the end-to-end pipeline on real data (see qdsl/workflows/demo.py)."""

from __future__ import annotations

import os
import time

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="train, quantize (PTQ sweep + binary QAT), export, run in C++ and lint a digits CNN",
        description="The whole qdsl pipeline on scikit-learn's bundled digits, in a few minutes on 2 cores.",
    )
    p.add_argument("--spec", help="use this spec for the PTQ sweep and the export instead of the bundled ones")
    p.add_argument("--hw", default="pot-asic-24bit-acc", help="hardware profile for the lint step")
    p.add_argument("--quick", action="store_true", help="fewer sweep points and QAT epochs")
    # one thread by default: the digits models' layers are too small to gain from more,
    # and on a shared machine a second thread made a training step 17x slower (measured:
    # 41 vs 716 ms per DigitsResNet step at load 6.5 on 2 cores; OpenMP waits at barriers)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1; 0 = torch's default, all cores)")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from qdsl.workflows.demo import run_demo

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    result = run_demo(args.spec, quick=args.quick, profile=args.hw)
    print()
    n = torch.get_num_threads()
    print(f"qdsl demo summary ({time.perf_counter() - t0:.0f} s on {n} thread{'s' if n != 1 else ''})")
    print(result.table())
    return 0 if result.ok else 1

"""Output stage (requantization) figures per kernel path: elements per ns of
``kernels.requantize`` on a [rows][cols] int32 block (default 64 x 1024, the size the
conv runtime stages per task), for each rescale kind, per-tensor (as the conv runtime
calls it) and per-channel parameters, int8 outputs.

Each sample times ``--calls`` back-to-back calls; the figure is the median of ``--reps``
samples.  ``net`` subtracts the per-call cost of the Python/ctypes entry (measured on a
1 x 1 block), so it estimates the kernel alone.  No assertions.
Run: python benchmarks/requant.py [--rows 64] [--cols 1024] [--reps 15] [--calls 20]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

KINDS = {0: "FIXED", 1: "POT", 2: "FIXED_SINGLE"}


def median_per_call(fn, reps: int, calls: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return float(np.median(times))


def stage_for(K, kind: int, channels: int, rng) -> object:
    if kind == 1:
        mult, shift = np.ones(channels), rng.integers(4, 12, channels)
    else:
        mult, shift = rng.integers(1 << 30, 1 << 31, channels), rng.integers(0, 12, channels)
    # rounding 0 (HALF_AWAY) is what the exporter writes for every kind
    return K.OutputStage(mult, shift, zero_point=3, qmin=-128, qmax=127, kind=kind, rounding=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()

    import qdsl.runtime as rt
    from qdsl.runtime import kernels as K

    if not rt.available():
        raise SystemExit(f"qdsl runtime unavailable: {rt.load_error()}")
    paths = [p for p in ("ref", "portable", "avx2", "avx512") if p in K.paths()["cpu"]]
    rng = np.random.default_rng(0)
    acc = rng.integers(-(1 << 20), 1 << 20, (args.rows, args.cols)).astype(np.int32)
    n = acc.size
    tiny = acc[:1, :1].copy()
    print(f"output stage, {args.rows} x {args.cols} int32 -> int8, median of {args.reps} x {args.calls} calls; "
          f"elements/ns (net of the per-call entry cost)")
    print(f"{'kind':>13} {'params':>11} | " + " ".join(f"{p:>16}" for p in paths) +
          (" | avx512/avx2" if {"avx2", "avx512"} <= set(paths) else ""))
    for kind, name in KINDS.items():
        for per_channel in (False, True):
            stage = stage_for(K, kind, args.cols if per_channel else 1, rng)
            cells, net = [], {}
            for p in paths:
                t = median_per_call(lambda: K.requantize(acc, stage, np.int8, path=p), args.reps, args.calls)
                tiny_stage = stage if not per_channel else stage_for(K, kind, 1, rng)
                t0 = median_per_call(lambda: K.requantize(tiny, tiny_stage, np.int8, path=p), args.reps, args.calls)
                net[p] = n / max((t - t0) * 1e9, 1e-9)
                cells.append(f"{n / (t * 1e9):6.2f} ({net[p]:6.2f})")
            ratio = f" | {net['avx512'] / net['avx2']:10.2f}x" if "avx512" in net and "avx2" in net else ""
            print(f"{name:>13} {'per-channel' if per_channel else 'per-tensor':>11} | " + " ".join(cells) + ratio)
    print(f"entry cost per call (1 x 1 block): {t0 * 1e6:.2f} us")


if __name__ == "__main__":
    main()

"""Block reconstruction (``learned_rounding = adaround``) vs plain rounding and GPTQ at
W4A4/W3A3/W2A2 on the repo's trained test models: accuracy and seconds per quantize call.

Models: the trained DigitsResNet (sklearn digits) and Conv1dNet (synthetic keywords), the
models of ``tests/ptq/test_accuracy.py``, with the same spec (``specs/low-bit.qspec``),
calibration set (256 training samples, seed 0, batches of 64) and test sets.

Variants (``--set`` overrides on the spec; weight and input bits set to the width):

* plain        - observers only (``bias_correction=false``, no learned rounding)
* plain+bc     - the spec as written (bias correction on)
* gptq+bc      - ``learned_rounding=gptq``
* adaround     - ``learned_rounding=adaround``, ``bias_correction=false``
* adaround+bc  - ``learned_rounding=adaround``

Time: one quantize call = ``qdsl.apply`` + ``qdsl.calibrate`` (observers and the PTQ
steps) + ``qdsl.freeze`` at ``torch.set_num_threads(1)``, as wall clock and as the
process's CPU time (the better figure on a loaded machine: wall time there includes
waiting for a core); the variants are interleaved over ``--rounds`` rounds and medians are
printed with the load average (the machine is shared: expect noise).  Accuracy is deterministic (seeded), the same every
round.  Run: ``python benchmarks/ptq_reconstruct.py [--rounds 3] [--bits 4,3,2]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import load_average  # noqa: E402

SPEC = ROOT / "specs" / "low-bit.qspec"
VARIANTS = {
    "plain": ["bias_correction=false", "learned_rounding=none"],
    "plain+bc": ["learned_rounding=none"],
    "gptq+bc": ["learned_rounding=gptq"],
    "adaround": ["bias_correction=false", "learned_rounding=adaround"],
    "adaround+bc": ["learned_rounding=adaround"],
}


def _quantize(model, batches, overrides):
    """``(wall s, process CPU s)`` of one quantize call."""
    import qdsl

    t, c = time.perf_counter(), time.process_time()
    qdsl.apply(model, str(SPEC), overrides=overrides)
    qdsl.calibrate(model, batches, progress=False)
    qdsl.freeze(model)
    return time.perf_counter() - t, time.process_time() - c


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median printed)")
    ap.add_argument("--bits", default="4,3,2", help="comma-separated bit widths (W = A)")
    ap.add_argument("--models", default="digits,keywords")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    import qdsl
    from qdsl.zoo.train import evaluate, trained_conv1d_net, trained_digits_resnet

    factories = {"digits": trained_digits_resnet, "keywords": trained_conv1d_net}
    bits = [int(b) for b in args.bits.split(",")]
    print(f"load average before: {load_average()}", file=sys.stderr)
    rows = []
    for name in args.models.split(","):
        model, (xtr, _ytr, xte, yte) = factories[name]()
        model.eval()
        xc = xtr[torch.randperm(len(xtr), generator=torch.Generator().manual_seed(0))[:256]]
        batches = [xc[i : i + 64] for i in range(0, len(xc), 64)]
        fp = 100 * evaluate(model, xte, yte)
        for b in bits:
            acc: dict[str, float] = {}
            times: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
            for r in range(args.rounds):
                for v, extra in VARIANTS.items():
                    overrides = [f"weight.bits={b}", f"input.bits={b}"] + extra
                    times[v].append(_quantize(model, batches, overrides))
                    if r == 0:
                        acc[v] = 100 * evaluate(model, xte, yte)
                    qdsl.remove(model)
            med = {v: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
                   for v, t in times.items()}
            rows.append((name, b, fp, acc, med))
            print(f"  {name} W{b}A{b}: " + ", ".join(f"{v} {acc[v]:.2f}% {med[v][0]:.2f}s ({med[v][1]:.2f}s cpu)"
                                                    for v in VARIANTS), file=sys.stderr)
    print(f"load average after: {load_average()}", file=sys.stderr)
    names = list(VARIANTS)
    print("accuracy % (median seconds per quantize call: wall / CPU)")
    print("| model | bits | float | " + " | ".join(names) + " |")
    print("|---|---|---:|" + "---:|" * len(names))
    for name, b, fp, acc, med in rows:
        cells = " | ".join(f"{acc[v]:.2f} ({med[v][0]:.2f} / {med[v][1]:.2f} s)" for v in names)
        print(f"| {name} | W{b}A{b} | {fp:.2f} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

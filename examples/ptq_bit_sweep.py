"""PTQ bit sweep: the accuracy-vs-bits table for a ResNet-style CNN on real data.

What it shows: one spec (``specs/w4a8-per-channel.qspec``) swept from W8A8 down to W2A2
with ``overrides`` only (no file edits), for three quantizer choices side by side:

* per-tensor weights, min/max observers        (what naive PTQ does)
* per-channel weights, min/max observers
* per-channel weights, qdsl's bit-aware search (``auto``: MSE clip search for weights,
  bit-aware histogram search for activations below 8 bits; min/max at 8 bits)

The model is DigitsResNet (residual blocks, BN folded) trained on scikit-learn's bundled
digits; nothing is downloaded.  Run: ``python examples/ptq_bit_sweep.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "w4a8-per-channel.qspec"

# observers only: the PTQ steps ``auto`` would add below 8 bits (learned rounding, bias
# correction; benchmarks/ptq_lowbit.py measures them) are off in every column
_NO_STEPS = {"learned_rounding": "none", "bias_correction": "false"}
CONFIGS = {
    "per-tensor minmax": {"weight.granularity": "tensor", "weight.observer": "minmax", "input.observer": "minmax",
                          **_NO_STEPS},
    "per-channel minmax": {"weight.granularity": "channel", "weight.observer": "minmax", "input.observer": "minmax",
                           **_NO_STEPS},
    "per-channel search": {"weight.granularity": "channel", "weight.observer": "auto", "input.observer": "auto",
                           **_NO_STEPS},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three bit widths only (smoke test)")
    parser.add_argument("--bits", default="8,6,4,3,2", help="comma-separated bit widths (W = A)")
    args = parser.parse_args(argv)

    from qdsl.zoo.train import evaluate, trained_digits_resnet
    from qdsl.workflows.sweep import run_point

    bits = [8, 4, 2] if args.quick else [int(b) for b in args.bits.split(",")]
    model, data = trained_digits_resnet()
    float_acc = evaluate(model, data[2], data[3])
    print(f"float DigitsResNet: {float_acc * 100:.2f}% on {len(data[2])} digits test images", file=sys.stderr)

    table: dict[int, dict[str, float]] = {}
    for b in bits:
        for name, cfg in CONFIGS.items():
            setting = [(k, v) for k, v in cfg.items()] + [("weight.bits", str(b)), ("input.bits", str(b))]
            acc, _, _ = run_point(model, str(SPEC), data, setting)
            table.setdefault(b, {})[name] = acc
            print(f"  W{b}A{b} {name:20s} {acc * 100:6.2f}%", file=sys.stderr)

    names = list(CONFIGS)
    print(f"| bits | {' | '.join(names)} |")
    print("|---:|" + "---:|" * len(names))
    print(f"| float | {' | '.join(f'{float_acc * 100:.2f}%' for _ in names)} |")
    for b in bits:
        print(f"| W{b}A{b} | {' | '.join(f'{table[b][n] * 100:.2f}%' for n in names)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

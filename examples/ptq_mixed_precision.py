"""Mixed precision from a sensitivity report, beside uniform 3-bit and 4-bit PTQ.

What it does, on DigitsResNet trained on scikit-learn's digits (nothing downloaded):

1. ``qdsl.workflows.sensitivity``: quantize one layer at a time (and all but one) at 3 bits
   with the low-bit PTQ spec (bit-aware range search + bias correction) and rank the
   layers by accuracy drop;
2. ``qdsl.workflows.sensitivity.emit_mixed_precision``: keep the most sensitive layers at 4 bits within a
   3.5 average weight-bits budget (weight-count weighted) and print the emitted spec;
3. print test accuracy and cross-entropy of uniform W3A3, the mixed spec and uniform W4A4
   (the float model is near 100% on digits, so accuracy moves by single samples; the
   test loss is the finer measure of how much each setting costs).

The same from the command line::

    qdsl sensitivity specs/low-bit.qspec --model qdsl.zoo.trained:digits_resnet \\
        --data qdsl.zoo.trained:digits --bits 3 --emit mixed.qspec --budget 3.5

Run: ``python examples/ptq_mixed_precision.py [--budget 3.5]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "low-bit.qspec"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=3.5, help="average weight bits of the mixed spec")
    args = parser.parse_args(argv)

    import torch

    import qdsl
    from qdsl.workflows.sensitivity import emit_mixed_precision, mixed_average_bits, ptq_metric, sensitivity
    from qdsl.zoo.train import evaluate, predict, trained_digits_resnet

    model, (xtr, _ytr, xte, yte) = trained_digits_resnet()
    xcal = xtr[torch.randperm(len(xtr), generator=torch.Generator().manual_seed(0))[:256]]
    report = sensitivity(model, SPEC, (xcal, xte, yte), "accuracy", 3)
    print(report.format(), end="\n\n")
    mixed = emit_mixed_precision(report, args.budget)
    high = {r.targets[0].pattern for r in mixed.rules if r.priority and any(t.bits == 4 for t in r.body.roles.values())}
    print(qdsl.format_spec(mixed))
    both = ["accuracy", "loss"]  # one PTQ run each; "loss" is reported negated (larger = better)
    float_loss = float(torch.nn.functional.cross_entropy(predict(model, xte), yte))
    rows = [
        ("float", [100 * evaluate(model, xte, yte), -float_loss], 32.0),
        ("uniform W3A3", ptq_metric(model, SPEC, xcal, xte, yte, both, overrides=["weight.bits=3", "input.bits=3"]),
         3.0),
        (f"mixed 3/4 (budget {args.budget})", ptq_metric(model, mixed, xcal, xte, yte, both),
         mixed_average_bits(report, high, 4)),
        ("uniform W4A4", ptq_metric(model, SPEC, xcal, xte, yte, both, overrides=["weight.bits=4", "input.bits=4"]),
         4.0),
    ]
    print("| setting | avg weight bits | accuracy % | test loss |\n|---|---|---|---|")
    for name, (acc, neg_loss), avg in rows:
        print(f"| {name} | {avg:.2f} | {acc:.2f} | {-neg_loss:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

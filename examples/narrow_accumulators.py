"""Narrow accumulators on an integer accelerator: naive wrap vs saturate vs ``constrain=true``.

For people whose hardware accumulates in 12-24 bits (photonic, ASIC): the digits CNN
(``qdsl.zoo``'s DigitsResNet) at W8A8 (``specs/int8-default.qspec``) with its accumulator set to
P bits::

    accumulator(bits=P, overflow=wrap)                    # what most silicon does
    accumulator(bits=P, overflow=saturate)
    accumulator(bits=P, overflow=wrap, constrain=true)    # weights that cannot overflow

For each it prints the fake-quant accuracy, the exported integer graph's accuracy (C++
runtime when built, else the reference executor), their top-1 agreement (the fake-quant
model simulates the same wrap/saturate on the same integer sums, qdsl.patch.accumulate)
and the graph's overflow count on the test set (what ``qdsl run --overflow`` reports).
With ``constrain=true`` the overflow count is 0 by construction (qdsl.patch.constrain
checks the exact bound at freeze); the last column is the smallest fraction of a layer's
integer L1 norm the constraint kept.

Run: ``python examples/narrow_accumulators.py [--bits 16 14 12] [--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

SPEC = Path(__file__).resolve().parent.parent / "specs" / "int8-default.qspec"
MODES = (("wrap", "overflow=wrap"), ("saturate", "overflow=saturate"),
         ("constrain", "overflow=wrap, constrain=true"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[16, 14, 12])
    parser.add_argument("--quick", action="store_true", help="16 bits only (smoke test)")
    args = parser.parse_args(argv)
    bits_list = [16] if args.quick else args.bits

    import numpy as np
    import torch

    import qdsl
    import qdsl.runtime as rt
    from qdsl.graph import execute
    from qdsl.parse import parse_text
    from qdsl.patch.constrain import constraint_report
    from qdsl.zoo.train import evaluate, predict, trained_digits_resnet

    base = SPEC.read_text()
    anchor = "  bias = int(bits=32, signed, symmetric, scale=input*weight)\n"
    model, (x_train, _, x_test, y_test) = trained_digits_resnet()
    print(f"float accuracy {evaluate(model, x_test, y_test) * 100:.2f}% on {len(x_test)} test digits\n")
    print("| accumulator | overflow | fake-quant | integer graph | top-1 agreement | graph overflows | L1 kept (min) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for bits in bits_list:
        for name, args_text in MODES:
            text = base.replace(anchor, anchor + f"  accumulator(bits={bits}, {args_text})\n")
            q = copy.deepcopy(model)
            qdsl.apply(q, parse_text(text, f"int8-acc{bits}.qspec"))
            qdsl.calibrate(q, [x_train[:256]], progress=False)
            qdsl.freeze(q)
            graph = qdsl.export(q, x_test[:1])
            fq = predict(q, x_test).argmax(1)
            ref = execute(graph, x_test.numpy())
            out = rt.CompiledGraph(graph).run(x_test.numpy()) if rt.available() else ref.outputs[0]
            gq = torch.from_numpy(np.asarray(out, dtype=np.float32)).argmax(1)
            costs = constraint_report(q)
            kept = f"{min(c.l1_kept for c in costs) * 100:.1f}%" if costs else "-"
            print(f"| {bits} | {name} | {float((fq == y_test).float().mean()) * 100:.2f}% "
                  f"| {float((gq == y_test).float().mean()) * 100:.2f}% | {float((fq == gq).float().mean()) * 100:.2f}% "
                  f"| {sum(ref.overflow.values())} | {kept} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

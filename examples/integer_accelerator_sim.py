"""Simulate an integer-only accelerator: int8 weights, int32 biases, a noisy dot product.

What it shows, for people modelling analog/photonic/approximate MAC hardware:

1. ``qdsl.int_tensors(model)`` hands you the exact integers the quantized model uses:
   int8 weight codes with per-channel scales, int32 biases with scale = input × weight.
2. ``qdsl.workflows.intsim.simulate(model, accumulate=hook)`` runs every quantized
   conv/linear as an explicit integer dot product (int64 accumulation) and passes each
   accumulator tensor through YOUR hook before rescaling — here Gaussian noise whose
   σ is a fraction of each layer's RMS accumulator (a signal-to-noise error model).
3. The accuracy drop is reported per noise level; with no noise the simulation matches
   the fake-quant model (bit-exact for power-of-two scales).

Run: ``python examples/integer_accelerator_sim.py [--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

SPEC = Path(__file__).resolve().parent.parent / "specs" / "int8-default.qspec"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two noise levels only (smoke test)")
    parser.add_argument("--spec", default=str(SPEC))
    args = parser.parse_args(argv)

    import torch

    import qdsl
    from qdsl.zoo.train import evaluate, predict, trained_digits_resnet
    from qdsl.workflows.intsim import gaussian_noise, simulate

    model, (x_train, _, x_test, y_test) = trained_digits_resnet()
    qmodel = copy.deepcopy(model)
    qdsl.apply(qmodel, args.spec)
    qdsl.calibrate(qmodel, [x_train[:256]], progress=False)
    qdsl.freeze(qmodel)

    ints = qdsl.int_tensors(qmodel)
    print(f"{'layer':22s} {'weight':>16s} {'w dtype':>8s} {'bias':>8s} {'b dtype':>8s}  scale(s)")
    for fqn, layer in ints.items():
        bias = "-" if layer.bias is None else str(tuple(layer.bias.shape))
        bdt = "-" if layer.bias is None else str(layer.bias.dtype).replace("torch.", "")
        n_scales = "-" if layer.weight_scale is None else f"{layer.weight_scale.numel()} per-channel" if layer.weight_scale.numel() > 1 else "1 per-tensor"
        print(f"{fqn:22s} {str(tuple(layer.weight.shape)):>16s} {str(layer.weight.dtype).replace('torch.', ''):>8s} "
              f"{bias:>8s} {bdt:>8s}  {n_scales}")

    float_acc = evaluate(model, x_test, y_test)
    fq_acc = evaluate(qmodel, x_test, y_test)
    fq_logits = predict(qmodel, x_test)
    with simulate(qmodel):
        exact_logits = predict(qmodel, x_test)
    agree = float((exact_logits.argmax(1) == fq_logits.argmax(1)).float().mean())
    print(f"\nfloat {float_acc * 100:.2f}%   fake-quant int8 {fq_acc * 100:.2f}%   "
          f"integer simulation (no noise) agrees on {agree * 100:.2f}% of top-1, "
          f"max |Δ logit| {float((exact_logits - fq_logits).abs().max()):.2e}")

    levels = [0.01, 0.1] if args.quick else [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5]
    print("\n| accumulator noise σ (fraction of RMS) | accuracy | drop vs int8 |")
    print("|---:|---:|---:|")
    for sigma in levels:
        with simulate(qmodel, accumulate=gaussian_noise(sigma, seed=0, relative=True)):
            acc = evaluate(qmodel, x_test, y_test)
        print(f"| {sigma:g} | {acc * 100:.2f}% | {(fq_acc - acc) * 100:+.2f} pts |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""xnor-binary on unmodified ReLU CNNs (sklearn digits): with and without learned thresholds.

Issue 23, item 4: a signed binary activation after a ReLU is sign(x) = +1 everywhere, so
the old xnor spec trained ReLU networks to chance.  The bundled spec now binarises at a
learned per-channel threshold (threshold = learned).  For each model this script trains
the float network (``qdsl.zoo.train.train_float``, 20 epochs, cached), applies
``specs/xnor-binary.qspec`` as shipped and with ``--set input.threshold=none``, calibrates
on 512 images, runs ``qdsl.qat.fit`` (Adam, one-cycle, lr 1e-3, batch 64) and prints the
test accuracy after each epoch and once frozen, and the wall time (1 thread).

* ``ConvBnReluNet``   qdsl.zoo.models.conv_bn_relu_net(in_ch=1): (conv-BN-ReLU) x3, GAP, linear
* ``TvStyleNet``      qdsl.zoo.models.tv_style_net(): conv-BN-ReLU(inplace=True), max pool,
                      two more conv-BN-ReLU(inplace=True), GAP, linear

    python benchmarks/binary_threshold_digits.py [--epochs 15] [--models conv,tv]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch

import qdsl
from qdsl.qat import fit
from qdsl.zoo.data import digits
from qdsl.zoo.models import conv_bn_relu_net, tv_style_net
from qdsl.zoo.train import evaluate, train_float

SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "specs", "xnor-binary.qspec")


MODELS = {"conv": lambda: conv_bn_relu_net(in_ch=1), "tv": tv_style_net}


def run(make, threshold: bool, epochs: int, data, verbose: bool = True) -> float:
    """Frozen test accuracy of ``make()`` under xnor-binary after ``epochs`` of QAT."""
    xtr, ytr, xte, yte = data
    model = train_float(make(), xtr, ytr, epochs=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without a threshold apply warns (W319): expected here
        qdsl.apply(model, SPEC, overrides=None if threshold else ["input.threshold=none"])
    qdsl.calibrate(model, [xtr[i:i + 256] for i in range(0, 512, 256)])

    def progress(epoch, step, per_epoch, loss):
        if verbose and step == per_epoch - 1:
            print(f"    epoch {epoch + 1:2d}  test acc {evaluate(model, xte, yte):.3f}", flush=True)
            model.train()

    fit(model, xtr, ytr, epochs=epochs, lr=1e-3, progress=progress)
    qdsl.freeze(model)
    return evaluate(model, xte, yte)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--models", default="conv,tv")
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = digits()
    for name in args.models.split(","):
        for threshold in (True, False):
            t0 = time.perf_counter()
            print(f"{name}: xnor-binary, threshold={'learned' if threshold else 'none'}", flush=True)
            acc = run(MODELS[name], threshold, args.epochs, data)
            print(f"  frozen test accuracy {acc:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print("load average:", " ".join(f"{v:.2f}" for v in os.getloadavg()))


if __name__ == "__main__":
    main()

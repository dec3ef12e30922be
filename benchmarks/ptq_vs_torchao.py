"""qdsl low-bit PTQ vs torch.ao's FakeQuantize flow on the same trained models and data.

    python benchmarks/ptq_vs_torchao.py [--models digits,keywords] [--bits 8,6,4,3,2]

Prints a markdown table of test accuracy (%) at each bit width (weights and activations
at the same width).  Both sides calibrate on the same 256 training inputs (seeded):

* **qdsl**: ``specs/low-bit.qspec`` with ``--set weight.bits=B input.bits=B``
  (auto observer: bit-aware range search below 8 bits; bias correction; BN folded;
  int32 bias) and the same with ``learned_rounding = "gptq"``.
* **torch.ao**: ``prepare_fx`` (BN folded) with ``FakeQuantize`` everywhere:
  activations ``HistogramObserver`` (quint8, ``quant_min/quant_max`` restricted to B
  bits), weights ``PerChannelMinMaxObserver`` (per-channel symmetric, restricted to B
  bits); observers run on the calibration data with fake quantization off, then the
  model is evaluated with fake quantization on.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qdsl.workflows.sensitivity import ptq_metric  # noqa: E402
from qdsl.zoo.train import evaluate, trained_conv1d_net, trained_digits_resnet  # noqa: E402

SPEC = ROOT / "specs" / "low-bit.qspec"


def torchao_ptq(model, bits, xcal, xte, yte):
    from torch.ao.quantization import FakeQuantize, HistogramObserver, PerChannelMinMaxObserver, QConfig, QConfigMapping
    from torch.ao.quantization import disable_fake_quant, disable_observer, enable_fake_quant, enable_observer
    from torch.ao.quantization.quantize_fx import prepare_fx

    act = FakeQuantize.with_args(observer=HistogramObserver, quant_min=0, quant_max=2**bits - 1,
                                 dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False)
    wgt = FakeQuantize.with_args(observer=PerChannelMinMaxObserver, quant_min=-(2 ** (bits - 1)),
                                 quant_max=2 ** (bits - 1) - 1, dtype=torch.qint8,
                                 qscheme=torch.per_channel_symmetric, ch_axis=0)
    mapping = QConfigMapping().set_global(QConfig(activation=act, weight=wgt))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = prepare_fx(copy.deepcopy(model).eval(), mapping, (xcal[:1],))
    m.apply(enable_observer)
    m.apply(disable_fake_quant)
    with torch.no_grad():
        for i in range(0, len(xcal), 64):
            m(xcal[i : i + 64])
    m.apply(disable_observer)
    m.apply(enable_fake_quant)
    return 100 * evaluate(m, xte, yte)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits,keywords")
    ap.add_argument("--bits", default="8,6,4,3,2")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    args = ap.parse_args(argv)
    if args.threads:
        # on a shared, oversubscribed machine 1 thread is much faster for these tiny models
        torch.set_num_threads(args.threads)
    bits = [int(b) for b in args.bits.split(",")]
    tasks = {"digits": ("DigitsResNet / digits", trained_digits_resnet),
             "keywords": ("Conv1dNet / synthetic keywords", trained_conv1d_net)}
    g = torch.Generator().manual_seed(0)
    print(f"| model | method | float | " + " | ".join(f"W{b}A{b}" for b in bits) + " |")
    print("|---|---|---|" + "---|" * len(bits))
    t0 = time.perf_counter()
    for key in args.models.split(","):
        label, factory = tasks[key]
        model, (xtr, _ytr, xte, yte) = factory()
        xcal = xtr[torch.randperm(len(xtr), generator=g.manual_seed(0))[:256]]
        fp = 100 * evaluate(model, xte, yte)
        rows = {
            "torch.ao FakeQuantize (HistogramObserver, per-channel minmax)":
                [torchao_ptq(model, b, xcal, xte, yte) for b in bits],
            "qdsl (range search + bias correction)":
                [ptq_metric(model, SPEC, xcal, xte, yte,
                            overrides=[f"weight.bits={b}", f"input.bits={b}", "learned_rounding=none"])
                 for b in bits],
            "qdsl (+ GPTQ learned rounding)":
                [ptq_metric(model, SPEC, xcal, xte, yte,
                            overrides=[f"weight.bits={b}", f"input.bits={b}", "learned_rounding=gptq"])
                 for b in bits],
        }
        for name, accs in rows.items():
            print(f"| {label} | {name} | {fp:.2f} | " + " | ".join(f"{a:.2f}" for a in accs) + " |", flush=True)
    print(f"\n({time.perf_counter() - t0:.0f} s; 256 calibration inputs; accuracy in % on the held-out test set)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Eval-time overhead of a frozen PTQ fake-quant model over its float model.

ConvBnReluNet (conv-bn-relu ×3, GAP, linear; 3×32×32 input) at batch 64 with 2 intra-op
threads, under ``torch.no_grad()``.  Prints, side by side from one process:

* qdsl: ``specs/int8-default.qspec`` (BN folded, int8 per-channel weights, uint8
  asymmetric activations, int32 bias) applied, calibrated and frozen;
* torch.ao: the same network prepared with ``prepare_qat`` and the default QAT qconfig
  (FakeQuantize modules), calibrated, then observers disabled (frozen, like qdsl) and
  eval mode - the eager-mode comparison point (BN not folded: eager prepare_qat keeps it);

each as the median over interleaved repeats of (fake-quant time / float time), so load
on the machine hits both sides alike.  Target for qdsl: <= 1.5x.

The frozen qdsl path costs four vectorized in-place passes per quantized activation
(multiply by 1/s, round, clamp, multiply by s) and nothing per weight (cached).  On an
oversubscribed machine every multi-threaded elementwise op waits for both threads, so
qdsl runs those passes on one thread by default (``TensorQuantizer.fast_path_threads``);
the second qdsl line shows them on all threads.  The load average is printed because
the 2-thread figures depend on it; ``--threads 1`` shows the arithmetic cost alone.

    python benchmarks/ptq_overhead.py [--repeats 15] [--batch 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings
from pathlib import Path

import torch

import qdsl
from qdsl.zoo.models import conv_bn_relu_net

SPEC = Path(__file__).resolve().parent.parent / "specs" / "int8-default.qspec"


def _time(model, x, inner: int) -> float:
    with torch.no_grad():
        t0 = time.perf_counter()
        for _ in range(inner):
            model(x)
        return (time.perf_counter() - t0) / inner


def _torch_ao(model, batches):
    from torch.ao.quantization import disable_observer, get_default_qat_qconfig, prepare_qat

    m = copy.deepcopy(model).train()
    m.qconfig = get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = prepare_qat(m)
    with torch.no_grad():
        for b in batches:
            m(b)
    # the equivalent of qdsl.freeze: observers off, fake quantization on
    m.apply(disable_observer)
    return m.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    float_model = conv_bn_relu_net()
    batches = [torch.randn(args.batch, 3, 32, 32) for _ in range(4)]
    x = torch.randn(args.batch, 3, 32, 32)

    q_model = copy.deepcopy(float_model)
    qdsl.apply(q_model, str(SPEC))
    qdsl.calibrate(q_model, batches, progress=False)
    qdsl.freeze(q_model)
    ao_model = _torch_ao(float_model, batches)

    for m in (float_model, q_model, ao_model):  # warm up (allocator, oneDNN primitives)
        _time(m, x, 2)
    from qdsl.quantizers.proxy import TensorQuantizer

    default_threads = TensorQuantizer.fast_path_threads
    qdsl_ratios, all_ratios, ao_ratios, floats = [], [], [], []
    for _ in range(args.repeats):
        t_float = _time(float_model, x, args.inner)
        t_q = _time(q_model, x, args.inner)
        TensorQuantizer.fast_path_threads = None  # fake-quant passes on all threads
        t_all = _time(q_model, x, args.inner)
        TensorQuantizer.fast_path_threads = default_threads
        t_ao = _time(ao_model, x, args.inner)
        floats.append(t_float)
        qdsl_ratios.append(t_q / t_float)
        all_ratios.append(t_all / t_float)
        ao_ratios.append(t_ao / t_float)

    med_q, med_ao = statistics.median(qdsl_ratios), statistics.median(ao_ratios)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"ConvBnReluNet 3x32x32, batch {args.batch}, {args.threads} threads, "
          f"{args.repeats} repeats x {args.inner} calls, float median {statistics.median(floats) * 1e3:.2f} ms, "
          f"load average {load:.1f} on {os.cpu_count()} cpus")
    print(f"  qdsl   fake-quant / float: {med_q:.2f}x  (target <= 1.5x: {'ok' if med_q <= 1.5 else 'MISSED'})")
    print(f"  qdsl   with fast_path_threads=None (fake-quant passes on all threads): "
          f"{statistics.median(all_ratios):.2f}x")
    print(f"  torch.ao FakeQuantize / float: {med_ao:.2f}x")


if __name__ == "__main__":
    main()

"""End-to-end latency of the small test CNNs (e2e.py times the ImageNet-sized models):
qdsl C++ runtime vs torch fp32 eager vs torch.ao's converted int8 model (FX mode, x86
engine), at batch 1 and 32.

Models: the digits ResNet (1x8x8, as in the tests) and a wider version of the same
architecture on 3x32x32 inputs (CIFAR-sized), both quantized with specs/int8-default.qspec,
and again with 7-bit activations (``input.bits=7 output.bits=7``), the precision of torch.ao's
x86 qconfig (``reduce_range=True``), which lets AVX2 run int8 weights on the exact vpmaddubsw
kernel.
Times are medians of repeats measured side by side in one process (each after a warm-up), float32 input to
float32 output for all three.  Run: python benchmarks/e2e_toy.py [--threads 1] [--reps 30]
"""

from __future__ import annotations

import os

# numpy's OpenBLAS is never measured here, but after each call (the Python reference
# executor, data preparation) its idle threads busy-wait for a while and take a core
# from whatever is timed next; one BLAS thread removes that noise for every contender.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import copy
import warnings

import numpy as np
import torch
from _timing import load_average, steady_median


def median_ms(fns, reps: int) -> list[float]:
    """Median wall time (ms) of each function over `reps` consecutive runs, each function
    measured in its own steady state: it first runs for 0.3 s, so it does not pay for the
    previous contender (idle cores clocking up again; torch's OpenMP workers, which
    busy-wait after each call: interleaved call by call on two cores, qdsl ran 4x slower
    and torch 1.3-1.4x slower here, and deployments do not interleave two runtimes)."""
    return [1e3 * steady_median(fn, reps, warmup_s=0.3) for fn in fns]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import qdsl
    import qdsl.runtime as rt
    from qdsl.export import export
    from qdsl.graph import execute
    from qdsl.zoo.models import DigitsResNet
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    if not rt.available():
        raise SystemExit(f"qdsl runtime unavailable: {rt.load_error()}")
    torch.set_num_threads(args.threads)
    rt.set_num_threads(args.threads)
    torch.backends.quantized.engine = "x86"
    print(f"threads: {args.threads} (qdsl and torch); load average: {load_average()}")
    print(f"{'model':<26} {'batch':>5} | {'qdsl':>8} {'qdsl a7':>8} {'fp32':>8} {'ao int8':>8} ms | "
          f"fp32/qdsl ao/qdsl ao/qdsl-a7")
    for name, width, in_ch, size in [("digits ResNet 1x8x8", 16, 1, 8), ("ResNet w32 3x32x32", 32, 3, 32)]:
        torch.manual_seed(0)
        model = DigitsResNet(width=width, in_ch=in_ch).eval()
        calib = torch.randn(256, in_ch, size, size)
        fp32 = copy.deepcopy(model)
        graphs = []
        for overrides in ([], ["input.bits=7", "output.bits=7"]):
            qmodel = copy.deepcopy(model)
            qdsl.apply(qmodel, qdsl.load_spec("specs/int8-default.qspec"), overrides=overrides)
            qdsl.calibrate(qmodel, [calib[i:i + 64] for i in range(0, 256, 64)], progress=False)
            qdsl.freeze(qmodel)
            graphs.append(export(qmodel, calib[:2]))
        compiled, compiled7 = (rt.CompiledGraph(g) for g in graphs)
        ao = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (calib[:2],))
        with torch.no_grad():
            ao(calib)
        ao = convert_fx(ao)
        for batch in (1, 32):
            x = torch.randn(batch, in_ch, size, size)
            xn = x.numpy()
            for g, c in zip(graphs, (compiled, compiled7)):
                assert np.array_equal(c.run(xn), execute(g, xn).outputs[0])
            with torch.no_grad():
                t_q, t_7, t_f, t_a = median_ms(
                    [lambda: compiled.run(xn), lambda: compiled7.run(xn), lambda: fp32(x), lambda: ao(x)], args.reps)
            print(f"{name:<26} {batch:>5} | {t_q:8.3f} {t_7:8.3f} {t_f:8.3f} {t_a:8.3f}    | {t_f / t_q:9.2f} "
                  f"{t_a / t_q:7.2f} {t_a / t_7:11.2f}")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()

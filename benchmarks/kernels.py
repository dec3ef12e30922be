"""GEMM kernel figures: qdsl int8 / int4 / binary vs torch (fbgemm x86 quantized linear, fp32
matmul) and onnxruntime MatMulInteger (u8u8: exact; u8s8) when installed, 1 and 2 threads.

Like with like, each way qdsl is timed:
  int32 out (no requant)  qdsl ``gemm`` -> int32; ort MatMulInteger -> int32; torch
                          ``linear_with_input_q_dq_qweight_dq_output_fp32`` (fbgemm, float out:
                          the accumulators times one scale; it also quantizes its float input).
  uint8 out (requant)     qdsl ``gemm`` with an OutputStage; torch ``quantized.linear``.
8-bit activations (codes 0..255, zero point 128): exact peers are ort u8u8 only; torch and
ort u8s8 saturate int16 pair sums on AVX2 without VNNI.  7-bit activations (0..127, torch.ao's
x86 ``reduce_range``): every peer is exact and qdsl runs its ``vpmaddubsw`` kernel.  With
AVX512-VNNI or AVX-VNNI (see the CPU line) every u8 x s8 peer is exact and qdsl runs vpdpbusd
for both, so ``ort u8s8/qdsl i32`` is the like-with-like 8-bit pair there.  The exactness
section at the end measures which results are exact on this CPU.

Figures are GOP/s (2*M*K*N / time) from medians over ``--rounds`` interleaved rounds
(benchmarks/_timing.py); ratios are peer time / qdsl time (>= 1: qdsl faster), taken round by
round, as median (range).  ``--clock cpu`` times with the process's CPU time instead of wall
time: on a loaded machine (another process on our cores) it leaves out the time we wait for a
core; with 2 threads it sums both threads (and any spinning), so it is no latency there.
No assertions: the targets are in the issues and the README.
The requantized rows use the exporter's default rescale (``--rescale single``: FIXED_SINGLE,
one rounding, half to even as torch rounds; qdsl.export's ``requant="single"``), or
gemmlowp's two-rounding FIXED (``--rescale gemmlowp``, ``requant="gemmlowp"``).
Run: python benchmarks/kernels.py [--quick] [--threads 1,2] [--rounds 5] [--reps 7]
     [--shapes default|minilm|issue18|MxKxN,...] [--clock wall|cpu] [--rescale single|gemmlowp]
     [--tables int8,low]
"""

from __future__ import annotations

import os

# numpy's OpenBLAS is never measured here, but after each call (data preparation) its idle
# threads busy-wait for a while and take a core from whatever is timed next.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's qdsl

import _ort  # noqa: E402
from _timing import add_timing_args, interleaved, load_average, span, timing_args  # noqa: E402

SHAPES = [(64, 576, 64), (256, 1152, 128), (128, 768, 768), (128, 3072, 768), (1, 768, 768), (1024, 1024, 1024)]
QUICK_SHAPES = [(64, 576, 64), (128, 768, 768), (1, 768, 768)]
# all-MiniLM-L6-v2's linears at sequence 128: M = 128 tokens (batch 1) or 1024 (batch 8),
# K -> N = 384 -> 384 (q, k, v, attention output), 384 -> 1536 and 1536 -> 384 (the MLP)
MINILM_SHAPES = [(m, k, n) for m in (128, 1024) for k, n in ((384, 384), (384, 1536), (1536, 384))]
# issue #18's int GEMM criterion: M from GEMV-like to large at K = N = 768, BERT-base's linears at
# sequence 128 (attention 768 -> 768, MLP 768 -> 3072 and 3072 -> 768) and 1024^3
ISSUE18_SHAPES = ([(m, 768, 768) for m in (1, 8, 64, 128, 512, 1024)]
                  + [(128, 3072, 768), (128, 768, 3072), (1024, 1024, 1024)])
# torch's activation scale, a power of two: float inputs are exactly (code - zero point) * S_IN,
# and fp32 outputs / S_IN are the accumulators exactly (below 2^24)
S_IN = 1.0 / 16


def _operands(rng, m: int, k: int, n: int, torch, K, rescale: str = "single") -> dict:
    from qdsl.graph.requant import quantize_multiplier

    w8 = rng.integers(-127, 128, (n, k)).astype(np.int8)
    a8 = rng.integers(0, 256, (m, k)).astype(np.uint8)
    a7 = rng.integers(0, 128, (m, k)).astype(np.uint8)
    # requant (FIXED, gemmlowp's form): about +-3 accumulator standard deviations over the uint8 range
    std = 128.0 * 73.0 * k ** 0.5  # std of (a - 128) * w for uniform codes
    # FIXED_SINGLE (kind 2) rounding half to even (1), or gemmlowp's FIXED (kind 0, half away)
    kind, rounding = (2, 1) if rescale == "single" else (0, 0)
    stage = K.OutputStage(*quantize_multiplier(127.0 / (3 * std)), zero_point=128, qmin=0, qmax=255, kind=kind,
                          rounding=rounding)
    packed_t = torch.ops.quantized.linear_prepack(
        torch.quantize_per_tensor(torch.tensor(w8.astype(np.float32)), 1.0, 0, torch.qint8), None)
    ops = {"w8": w8, "a8": a8, "a7": a7, "p8": K.pack_weights(w8), "stage": stage, "packed_t": packed_t,
           "x8": torch.tensor((a8.astype(np.float32) - 128) * S_IN),
           "x7": torch.tensor((a7.astype(np.float32) - 64) * S_IN),
           "out_scale": 3 * std * S_IN / 127.0}
    ops["qx8"] = torch.quantize_per_tensor(ops["x8"], S_IN, 128, torch.quint8)
    ops["qx7"] = torch.quantize_per_tensor(ops["x7"], S_IN, 64, torch.quint8)
    return ops


def _ort_sessions(o, threads: int) -> dict:
    if _ort.modules() is None:
        return {}
    w_t = np.ascontiguousarray(o["w8"].T)
    mk = lambda a, b, az, bz: _ort.session(_ort.matmul_integer(a.shape, b, az, bz), threads)  # noqa: E731
    return {"ort u8u8": (mk(o["a8"], (w_t.astype(np.int16) + 128).astype(np.uint8), 128, 128), o["a8"]),
            "ort u8s8": (mk(o["a8"], w_t, 128, 0), o["a8"]),
            "ort u8s8 a7": (mk(o["a7"], w_t, 64, 0), o["a7"])}


def int8_tables(rng, args, torch, K, rt) -> dict:
    """Per thread count and shape: 8-bit and 7-bit activations, int32 and uint8 outputs,
    every contender interleaved.  Returns the per-round times for the scaling summary."""
    q = torch.ops.quantized
    all_times = {}
    for threads in args.threads:
        rt.set_num_threads(threads)
        torch.set_num_threads(threads)
        print(f"\n== int8 GEMM, {threads} thread(s): GOP/s ({args.clock} time), median (range) over {args.rounds} "
              f"rounds; qdsl u8 rescale {args.rescale}; load average {load_average()} ==")
        for m, k, n in args.shapes:
            o = _operands(rng, m, k, n, torch, K, args.rescale)
            sess = _ort_sessions(o, threads)
            fns = {
                "qdsl i32": lambda: K.gemm(o["a8"], o["p8"], a_zero_point=128),
                "qdsl u8": lambda: K.gemm(o["a8"], o["p8"], a_zero_point=128, stage=o["stage"], out_dtype=np.uint8),
                "torch f32": lambda: q.linear_with_input_q_dq_qweight_dq_output_fp32(o["x8"], S_IN, 128, o["packed_t"]),
                "torch u8": lambda: q.linear(o["qx8"], o["packed_t"], o["out_scale"], 128),
                "qdsl a7 i32": lambda: K.gemm(o["a7"], o["p8"], a_zero_point=64, a_max_code=127),
                "qdsl a7 u8": lambda: K.gemm(o["a7"], o["p8"], a_zero_point=64, a_max_code=127, stage=o["stage"],
                                             out_dtype=np.uint8),
                "torch a7 f32": lambda: q.linear_with_input_q_dq_qweight_dq_output_fp32(o["x7"], S_IN, 64,
                                                                                       o["packed_t"]),
                "torch a7 u8": lambda: q.linear(o["qx7"], o["packed_t"], o["out_scale"], 128),
            }
            for name, (s, a) in sess.items():
                fns[name] = (lambda s, a: lambda: s.run(None, {"A": a}))(s, a)
            times = interleaved(fns, args.rounds, args.reps, warmup_s=0.1, clock=args.clock_fn)
            del sess
            all_times[(threads, (m, k, n))] = times
            gops = lambda name: span([2.0 * m * k * n / t_ / 1e9 for t_ in times[name]], fmt=".0f")  # noqa: E731
            ratio = lambda peer, ours: span(np.asarray(times[peer]) / np.asarray(times[ours]))  # noqa: E731
            print(f"{str((m, k, n)):>16} 8-bit acts | " + "  ".join(
                f"{name} {gops(name)}" for name in ("qdsl i32", "qdsl u8", "ort u8u8", "ort u8s8", "torch f32",
                                                     "torch u8") if name in times))
            print(f"{'':>16} 7-bit acts | " + "  ".join(
                f"{name} {gops(name)}" for name in ("qdsl a7 i32", "qdsl a7 u8", "ort u8s8 a7", "torch a7 f32",
                                                     "torch a7 u8") if name in times))
            pairs = [("ort u8u8", "qdsl i32", "exact 8-bit, i32"), ("ort u8s8", "qdsl i32", "8-bit u8s8, i32"),
                     ("torch u8", "qdsl u8", "requant, torch inexact"),
                     ("torch f32", "qdsl i32", "no requant, torch inexact"),
                     ("ort u8s8 a7", "qdsl a7 i32", "7-bit, i32"), ("torch a7 u8", "qdsl a7 u8", "7-bit, requant"),
                     ("torch a7 f32", "qdsl a7 i32", "7-bit, no requant")]
            print(f"{'':>16} peer/qdsl  | " + "  ".join(f"{p}/{ours} {ratio(p, ours)}" for p, ours, _ in pairs
                                                          if p in times))
    return all_times


def low_bit_table(rng, args, torch, K, rt) -> dict:
    """int4 and binary GEMM beside int8 and fp32 (the old table's other columns)."""
    all_times = {}
    for threads in args.threads:
        rt.set_num_threads(threads)
        torch.set_num_threads(threads)
        print(f"\n== int4 / binary, {threads} thread(s): GOP/s ({args.clock} time), median (range); "
              f"load average {load_average()} ==")
        for m, k, n in args.shapes:
            a = rng.integers(0, 256, (m, k)).astype(np.uint8)
            p8 = K.pack_weights(rng.integers(-127, 128, (n, k)).astype(np.int8))
            p4 = K.pack_weights(rng.integers(-8, 8, (n, k)).astype(np.int8), bits=4)
            pb = K.pack_weights(np.where(rng.random((n, k)) < 0.5, 1, -1).astype(np.int8), bits=1)
            abits = K.bitpack(np.where(rng.random((m, k)) < 0.5, 1, -1).astype(np.int8))
            x, wf = torch.randn(m, k), torch.randn(n, k)
            times = interleaved({"int8": lambda: K.gemm(a, p8, a_zero_point=128),
                                 "int4": lambda: K.gemm(a, p4, a_zero_point=128),
                                 "binary": lambda: K.binary_gemm(abits, pb),
                                 "fp32": lambda: x @ wf.t()}, args.rounds, args.reps, warmup_s=0.1,
                                clock=args.clock_fn)
            all_times[(threads, (m, k, n))] = times
            g = {name: span([2.0 * m * k * n / t / 1e9 for t in ts], fmt=".0f") for name, ts in times.items()}
            r = lambda a_, b_: span(np.asarray(times[a_]) / np.asarray(times[b_]))  # noqa: E731
            print(f"{str((m, k, n)):>16} | " + "  ".join(f"{k_} {v}" for k_, v in g.items())
                  + f" | int4 vs int8 {r('int8', 'int4')}x  binary vs fp32 {r('fp32', 'binary')}x")
    return all_times


def scaling(all_times: dict, args) -> None:
    if 1 not in args.threads or 2 not in args.threads:
        return
    print("\n== 2 threads vs 1 (ratio of the medians above) ==")
    names = ("qdsl i32", "qdsl a7 i32", "ort u8u8", "torch u8", "binary", "fp32")
    for shape in args.shapes:
        t1, t2 = all_times[(1, shape)], all_times[(2, shape)]
        print(f"{str(shape):>16}  " + "  ".join(f"{name} {np.median(t1[name]) / np.median(t2[name]):.2f}x"
                                                for name in names if name in t1))


def torch_mismatch(rng, torch, a_max: int, m: int = 64, k: int = 768, n: int = 256) -> float:
    """Fraction of torch's x86 quantized linear (fbgemm, fp32 out: the accumulators times
    S_IN, exact in float) that differ from the exact product, activation codes 0..a_max."""
    a = rng.integers(0, a_max + 1, (m, k))
    w8 = rng.integers(-127, 128, (n, k))
    zp = (a_max + 1) // 2
    packed = torch.ops.quantized.linear_prepack(
        torch.quantize_per_tensor(torch.tensor(w8, dtype=torch.float32), 1.0, 0, torch.qint8), None)
    x = torch.tensor((a - zp) * S_IN, dtype=torch.float32)
    y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, S_IN, zp, packed).numpy() / S_IN
    return float(np.mean(y != (a - zp) @ w8.T))


def exactness(rng, torch) -> None:
    """Which int8 results are exact on this CPU?  Without VNNI, u8 x s8 kernels built on
    vpmaddubsw saturate pairs of products at int16 (255 * 127 * 2 > 32767)."""
    from qdsl.runtime import kernels as K

    m, k, n = 128, 768, 768
    print(f"\n== exactness of the int8 results, {(m, k, n)}, random full-range data as above ==")
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    w8 = rng.integers(-127, 128, (n, k)).astype(np.int8)
    exact = (a.astype(np.int64) - 128) @ w8.astype(np.int64).T
    q = K.gemm(a, K.pack_weights(w8), a_zero_point=128).astype(np.int64)
    print(f"qdsl gemm:                   {np.mean(q != exact):.3%} of outputs differ from the exact product")
    if _ort.modules() is not None:
        _ort.exactness_report(("MatMulInteger",))
    # torch: weights exactly w8 (scale 1), activations exactly a - 128 (scale S_IN)
    packed = torch.ops.quantized.linear_prepack(
        torch.quantize_per_tensor(torch.tensor(w8.astype(np.float32)), 1.0, 0, torch.qint8), None)
    x = torch.tensor((a.astype(np.float32) - 128) * S_IN)
    for bits in (8, 7):
        print(f"torch fp32-out linear, {bits}-bit acts: {torch_mismatch(rng, torch, 2 ** bits - 1):.3%} of outputs "
              "differ from the exact product")
    s_out = float(np.abs(exact).max()) * S_IN / 100.0  # outputs in [-100, 100] steps: no clipping
    yq = torch.ops.quantized.linear(torch.quantize_per_tensor(x, S_IN, 128, torch.quint8), packed, s_out, 128)
    err = np.abs(yq.dequantize().numpy().astype(np.float64) - exact * S_IN).max() / s_out
    print(f"torch quantized linear:      max |error| {err:.1f} output steps (exact rounding: <= 0.5)")


def cpu_summary() -> str:
    """The CPU's model and its int8 dot-product extensions (Linux /proc/cpuinfo): with
    AVX512-VNNI or AVX-VNNI the peers' u8 x s8 kernels use vpdpbusd and are exact (the
    exactness section checks), and their u8 x u8 path may use wider registers."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    ext = [f for f in ("avx2", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return f"{model} ({' '.join(ext) or 'no AVX2'})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(ap, rounds=5, reps=7)
    ap.add_argument("--shapes", default="default",
                    help="default (QUICK_SHAPES with --quick), minilm (MiniLM's linears at sequence 128), issue18 "
                         "(M 1..1024 at 768 x 768, BERT-base's linears, 1024^3) or "
                         "a comma list of MxKxN")
    ap.add_argument("--rescale", choices=("single", "gemmlowp"), default="single",
                    help="qdsl's requantized rows: FIXED_SINGLE half-even (the exporter's default) or gemmlowp FIXED")
    ap.add_argument("--tables", default="int8,low",
                    help="comma list: int8 (the int8 tables), low (int4 / binary); the exactness section always runs")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time each call by wall time (default) or by the process's CPU time (a loaded machine)")
    args = timing_args(ap.parse_args(argv))
    args.clock_fn = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.shapes == "minilm":
        args.shapes = MINILM_SHAPES
    elif args.shapes == "issue18":
        args.shapes = ISSUE18_SHAPES
    elif args.shapes == "default":
        args.shapes = QUICK_SHAPES if args.quick else SHAPES
    else:
        args.shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    import torch

    import qdsl.runtime as rt
    from qdsl.runtime import kernels as K

    if not rt.available():
        raise SystemExit(f"qdsl runtime unavailable: {rt.load_error()}")
    warnings.filterwarnings("ignore")
    torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "fbgemm"
    print(f"CPU: {cpu_summary()}\nqdsl paths: {K.paths()['enabled']}  torch quantized engine: "
          f"{torch.backends.quantized.engine}  load average: {load_average()}")
    if _ort.modules() is None:
        print("note: onnx/onnxruntime not installed (pip install .[bench]): the onnxruntime columns are skipped")
    rng = np.random.default_rng(0)
    with torch.no_grad():
        tables = set(args.tables.split(","))
        times = int8_tables(rng, args, torch, K, rt) if "int8" in tables else {}
        low = low_bit_table(rng, args, torch, K, rt) if "low" in tables else {}
        if times and low:
            scaling({key: {**times[key], **low[key]} for key in times}, args)
        rt.set_num_threads(0)
        exactness(rng, torch)
    print(f"\nload average at the end: {load_average()}")


if __name__ == "__main__":
    main()

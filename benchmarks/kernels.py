"""GEMM kernel figures: qdsl int8 / int4 / binary vs torch (fbgemm/x86 quantized linear,
fp32 matmul) and onnxruntime MatMulInteger when installed, with 1 and 2 threads.

Prints GOP/s (2*M*K*N / time) and ratios, all measured side by side in one process,
medians of repeats, then int8 weights with 7-bit activations (a bounded activation code
lets AVX2 run the exact vpmaddubsw kernel), then whether each int8 result is exact on
this CPU.  No assertions: the targets are in issue 6 and the report.
Run: python benchmarks/kernels.py [--reps 7]
"""

from __future__ import annotations

import os

# numpy's OpenBLAS is never measured here, but after each call (the Python reference
# executor, data preparation) its idle threads busy-wait for a while and take a core
# from whatever is timed next; one BLAS thread removes that noise for every contender.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import warnings

import numpy as np
from _timing import load_average, steady_median

SHAPES = [(64, 576, 64), (256, 1152, 128), (128, 768, 768), (128, 3072, 768), (1, 768, 768), (1024, 1024, 1024)]


def median_time(fn, reps: int) -> float:
    return steady_median(fn, reps, warmup_s=0.1)


def _ort_matmul_integer(a, w_t):
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return None
    node = helper.make_node("MatMulInteger", ["A", "B"], ["Y"])
    graph = helper.make_graph([node], "mmi", [helper.make_tensor_value_info("A", TensorProto.UINT8, a.shape)],
                              [helper.make_tensor_value_info("Y", TensorProto.INT32, (a.shape[0], w_t.shape[1]))],
                              [helper.make_tensor("B", TensorProto.INT8, w_t.shape, w_t.tobytes(), raw=True)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # onnxruntime reads older IR versions than onnx writes
    return ort, model.SerializeToString()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    import torch

    import qdsl.runtime as rt
    from qdsl.runtime import kernels as K

    if not rt.available():
        raise SystemExit(f"qdsl runtime unavailable: {rt.load_error()}")
    warnings.filterwarnings("ignore")
    torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "fbgemm"
    print(f"qdsl paths: {K.paths()['enabled']}  torch quantized engine: {torch.backends.quantized.engine}  "
          f"load average: {load_average()}")
    rng = np.random.default_rng(0)
    header = (f"{'M,K,N':>16} thr | {'int8':>6} {'torchq':>6} {'ort':>6} {'int4':>6} {'bin':>6} {'fp32':>6} GOP/s | "
              f"int8/torchq int8/ort int4/int8 bin/fp32")
    for threads in (1, 2):
        rt.set_num_threads(threads)
        torch.set_num_threads(threads)
        print(f"\n== {threads} thread(s) ==\n{header}")
        for m, k, n in SHAPES:
            ops = 2.0 * m * k * n
            a = rng.integers(0, 256, (m, k)).astype(np.uint8)
            w8 = rng.integers(-127, 128, (n, k)).astype(np.int8)
            w4 = rng.integers(-8, 8, (n, k)).astype(np.int8)
            p8, p4 = K.pack_weights(w8), K.pack_weights(w4, bits=4)
            sa = np.where(rng.random((m, k)) < 0.5, 1, -1).astype(np.int8)
            pb = K.pack_weights(np.where(rng.random((n, k)) < 0.5, 1, -1).astype(np.int8), bits=1)
            abits = K.bitpack(sa)
            t8 = median_time(lambda: K.gemm(a, p8, a_zero_point=128), args.reps)
            t4 = median_time(lambda: K.gemm(a, p4, a_zero_point=128), args.reps)
            tb = median_time(lambda: K.binary_gemm(abits, pb), args.reps)
            x, wf = torch.randn(m, k), torch.randn(n, k)
            tf = median_time(lambda: x @ wf.t(), args.reps)
            qx = torch.quantize_per_tensor(x, 0.05, 128, torch.quint8)
            packed = torch.ops.quantized.linear_prepack(torch.quantize_per_tensor(wf, 0.02, 0, torch.qint8), None)
            tq = median_time(lambda: torch.ops.quantized.linear(qx, packed, 0.1, 128), args.reps)
            to = float("nan")
            ort_model = _ort_matmul_integer(a, np.ascontiguousarray(w8.T))
            if ort_model is not None:
                ort, blob = ort_model
                so = ort.SessionOptions()
                so.intra_op_num_threads = threads
                sess = ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])
                to = median_time(lambda: sess.run(None, {"A": a}), args.reps)
                del sess  # its spinning pool threads would compete with the next measurement
            g = lambda t: ops / t / 1e9  # noqa: E731
            print(f"{str((m, k, n)):>16} {threads:>3} | {g(t8):6.0f} {g(tq):6.0f} {g(to):6.0f} {g(t4):6.0f} {g(tb):6.0f} "
                  f"{g(tf):6.0f}       | {tq / t8:11.2f} {to / t8:8.2f} {t8 / t4:9.2f} {tf / tb:8.2f}")
    # thread scaling, side by side
    print("\n== 2 threads vs 1 (int8, binary) ==")
    for m, k, n in SHAPES:
        a = rng.integers(0, 256, (m, k)).astype(np.uint8)
        p8 = K.pack_weights(rng.integers(-127, 128, (n, k)).astype(np.int8))
        pb = K.pack_weights(np.where(rng.random((n, k)) < 0.5, 1, -1).astype(np.int8), bits=1)
        abits = K.bitpack(np.where(rng.random((m, k)) < 0.5, 1, -1).astype(np.int8))
        res = {}
        for threads in (1, 2):
            rt.set_num_threads(threads)
            res[threads] = (median_time(lambda: K.gemm(a, p8, a_zero_point=128), args.reps),
                            median_time(lambda: K.binary_gemm(abits, pb), args.reps))
        print(f"{str((m, k, n)):>16}  int8 {res[1][0] / res[2][0]:.2f}x  binary {res[1][1] / res[2][1]:.2f}x")
    reduced_range(rng, args.reps)
    rt.set_num_threads(0)
    exactness(rng, torch)


def reduced_range(rng, reps: int) -> None:
    """int8 weights with 7-bit activations (torch.ao's reduce_range on x86): the code bound
    lets AVX2 run the exact vpmaddubsw kernel; figures beside 8-bit activations, 1 thread."""
    import qdsl.runtime as rt
    from qdsl.runtime import kernels as K

    rt.set_num_threads(1)
    print("\n== int8 weights, 8- vs 7-bit activations (a_max_code=127), 1 thread, GOP/s ==")
    for m, k, n in SHAPES:
        ops = 2.0 * m * k * n
        p8 = K.pack_weights(rng.integers(-127, 128, (n, k)).astype(np.int8))
        a8 = rng.integers(0, 256, (m, k)).astype(np.uint8)
        a7 = rng.integers(0, 128, (m, k)).astype(np.uint8)
        t8 = median_time(lambda: K.gemm(a8, p8, a_zero_point=128), reps)
        t7 = median_time(lambda: K.gemm(a7, p8, a_zero_point=64, a_max_code=127), reps)
        print(f"{str((m, k, n)):>16}  u8 {ops / t8 / 1e9:6.0f}  u7 {ops / t7 / 1e9:6.0f}  ({t8 / t7:.2f}x)")


def exactness(rng, torch) -> None:
    """Are the int8 peers exact on this CPU?  Without VNNI, u8 x s8 kernels built on
    vpmaddubsw saturate pairs of products at int16 (255 * 127 * 2 > 32767)."""
    from qdsl.runtime import kernels as K

    m, k, n = 128, 768, 768
    print(f"\n== exactness of the int8 results, {(m, k, n)}, random data as above ==")
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    w8 = rng.integers(-127, 128, (n, k)).astype(np.int8)
    exact = (a.astype(np.int64) - 128) @ w8.astype(np.int64).T
    q = K.gemm(a, K.pack_weights(w8), a_zero_point=128).astype(np.int64)
    print(f"qdsl gemm:                   {np.mean(q != exact):.3%} of outputs differ from the exact product")
    ort_model = _ort_matmul_integer(a, np.ascontiguousarray(w8.T))
    if ort_model is not None:
        ort, blob = ort_model
        y = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"A": a})[0].astype(np.int64)
        ref = a.astype(np.int64) @ w8.astype(np.int64).T
        print(f"onnxruntime MatMulInteger:   {np.mean(y != ref):.3%} of outputs differ, max |error| "
              f"{np.abs(y - ref).max() / np.abs(ref).max():.1%} of max |y|")
    # torch quantized linear: weights exactly w8 (scale 1), activations exactly a - 128 (scale s)
    s_in = 0.05
    qx = torch.quantize_per_tensor(torch.tensor((a.astype(np.float32) - 128) * s_in), s_in, 128, torch.quint8)
    qw = torch.quantize_per_tensor(torch.tensor(w8.astype(np.float32)), 1.0, 0, torch.qint8)
    s_out = float(np.abs(exact).max()) * s_in / 100.0  # outputs in [-100, 100] steps: no clipping
    yq = torch.ops.quantized.linear(qx, torch.ops.quantized.linear_prepack(qw, None), s_out, 128)
    err = np.abs(yq.dequantize().numpy().astype(np.float64) - exact * s_in).max() / s_out
    print(f"torch quantized linear:      max |error| {err:.1f} output steps (exact rounding: <= 0.5)")


if __name__ == "__main__":
    main()

"""A MiniLM-shaped transformer encoder, int8, batch 1 and 8, sequence 128 (issue 19's latency
target measured on a model that exports today): qdsl's C++ runtime vs torch.ao
``quantize_dynamic`` vs onnxruntime's dynamic int8 model vs torch fp32.

Model: ``Linear(384, 384)`` (the input projection: the first residual add must read a quantized
value) then 6 ``nn.TransformerEncoderLayer(d_model=384, nhead=12, dim_feedforward=1536,
activation="gelu", batch_first=True, norm_first=False)``: all-MiniLM-L6-v2's layer shapes,
seeded untrained weights, float32 input ``(batch, seq, 384)`` and output.

Contenders:
  torch fp32     the eager module (torch's fused encoder fast path where it applies).
  torch.ao dyn   ``quantize_dynamic(model, {nn.Linear}, qint8)``: the FFN and out_proj Linears in
                 int8 with activations quantized per call (7-bit codes on x86); the attention's
                 in-projection is a parameter of ``nn.MultiheadAttention``, not a Linear, and stays
                 float (as it does for every user of this module).
  ort dyn int8   ``torch.onnx.export`` (TorchScript exporter) then
                 ``onnxruntime.quantization.quantize_dynamic`` (QInt8 weights), as
                 benchmarks/minilm.py builds it; ORT_ENABLE_ALL.  Its u8 x s8 kernels are inexact
                 on AVX2 without VNNI (benchmarks/_ort.py).
  qdsl int8      specs/transformer-int8.qspec (+ the last LayerNorm's output at 8 bits), apply,
                 calibrate on 8 random batches, freeze, export; ``qdsl.runtime.CompiledGraph``:
                 every op integer (LINEAR, MATMUL, SOFTMAX, LAYERNORM, GELU table, ADD), exact.

Timing (benchmarks/_timing.py): each contender in its own steady state, taken in turn round
after round; a figure is the median over rounds with the range, a ratio is taken round by
round.  Each row also prints the cosine of its output to fp32's.  ``--profile`` prints qdsl's
per-op-type time instead (QDSL_PROFILE lines, summed over the ops of each type).

    python benchmarks/encoder.py [--quick] [--batches 1,8] [--threads 1,2] [--rounds 5] [--reps 3]
    python benchmarks/encoder.py --profile [--batches 1] [--threads 1]

Measured (AMD EPYC, AVX2 without VNNI, 2 cores shared with other jobs, load average 8-8.5:
noisy), 1 thread, 4 rounds, qdsl / contender per round, median (range): batch 1: qdsl 74.8 ms,
/ ORT dyn int8 1.22 (1.02-1.67), / torch.ao 0.88 (0.57-1.08), / fp32 0.76; batch 8: qdsl
758 ms, / ORT 1.12 (1.09-1.39), / torch.ao 0.97 (0.73-1.12), / fp32 0.71.  Cosine to fp32:
qdsl 0.9992, torch.ao 0.9997, ORT 0.983 (batch 1) / 0.993 (batch 8; its u8 x s8 kernels
saturate here).  qdsl's CPU time per op type at batch 1 (QDSL_PROFILE): LINEAR ~70% (the
exact int16 GEMM: on this CPU ~0.8x the throughput of the saturating u8 x s8 pattern the
peers use, benchmarks/int8_ceiling.py), MATMUL, SOFTMAX, LAYERNORM ~4-9% each.
"""

from __future__ import annotations

import os
import sys

if "--profile" in sys.argv:
    os.environ["QDSL_PROFILE"] = "1"  # read once by the library, before it is loaded
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import copy
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's qdsl, not an installed one

import _ort  # noqa: E402
from _timing import add_timing_args, interleaved, load_average, profile_lines, span, timing_args  # noqa: E402

D, HEADS, FF, LAYERS = 384, 12, 1536, 6


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=False) for _ in range(LAYERS))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _model() -> Encoder:
    torch.manual_seed(0)
    return Encoder().eval()


def _qdsl_graph(model: Encoder, seq: int):
    import qdsl
    import qdsl.runtime as rt
    from qdsl.parse import parse_text

    if not rt.available():
        return "qdsl native runtime not built"
    spec = (ROOT / "specs" / "transformer-int8.qspec").read_text()
    spec += f"\nrule layers.{LAYERS - 1}.norm2 {{ output = a8 }}\n"  # the graph's output, 8-bit
    m = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qdsl.apply(m, parse_text(spec, "transformer-int8.qspec"))
        g = torch.Generator().manual_seed(1)
        qdsl.calibrate(m, [torch.randn(4, seq, D, generator=g) for _ in range(8)], progress=False)
        qdsl.freeze(m)
        graph = qdsl.export(m, torch.randn(1, seq, D))
    return graph, rt.CompiledGraph(graph)


def _onnx_int8(model: Encoder, seq: int, tmp: Path):
    if _ort.modules() is None:
        return "onnx/onnxruntime not installed"
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fp32, int8 = tmp / "encoder.onnx", tmp / "encoder-int8.onnx"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (torch.randn(1, seq, D),), str(fp32), input_names=["x"], output_names=["y"],
                              opset_version=17, dynamo=False, dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
        quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
    except Exception as exc:  # a benchmark peer: report and go on
        return f"ONNX export/quantization failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return int8


def _profile(qg, graph_types, x, runs: int) -> dict[str, float]:
    """Per op type, the sum over its ops of each op's median wall time (ms) over `runs` runs."""
    per = defaultdict(list)
    for line in profile_lines(qg, x, runs):
        per[line[0]].append(line[2])
    out = defaultdict(float)
    for oi, walls in per.items():
        out[graph_types[oi]] += float(np.median(walls))
    return dict(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="qdsl's per-op-type times (QDSL_PROFILE)")
    add_timing_args(ap, rounds=5, reps=3, threads="1,2")
    args = timing_args(ap.parse_args(argv))
    if args.quick:
        args.batches = "1"
    import qdsl.runtime as rt

    warnings.filterwarnings("ignore")  # torch.ao's deprecation notices
    import logging

    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization's pre-processing advice
    print(f"load average {load_average()}; torch {torch.__version__}")
    model = _model()
    qg = _qdsl_graph(model, args.seq)
    types = []
    if not isinstance(qg, str):
        types = [op.type.name for op in qg[0].ops]
        qg = qg[1]
    if args.profile:
        if isinstance(qg, str):
            print(f"error: {qg}", file=sys.stderr)
            return 2
        for threads in args.threads:
            rt.set_num_threads(threads)
            for batch in (int(b) for b in args.batches.split(",")):
                x = torch.randn(batch, args.seq, D).numpy()
                prof = [_profile(qg, types, x, 2 + args.reps) for _ in range(args.rounds)]
                total = [sum(p.values()) for p in prof]
                print(f"\nqdsl per op type, batch {batch}, {threads} thread(s), ms (median over ops' medians, "
                      f"range over {args.rounds} rounds); load average {load_average()}")
                for t in sorted(prof[0], key=lambda t: -prof[0][t]):
                    print(f"  {t:18s} {span([p[t] for p in prof], 1, '.2f'):>22s}")
                print(f"  {'sum':18s} {span(total, 1, '.2f'):>22s}")
        return 0
    dyn_module = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)

    def dyn(x):
        # torch's fused encoder fast path reads `linear1.weight` as a tensor; on the quantized
        # Linears it is a method, so the layer must take its ordinary path
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            return dyn_module(x)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)

    skipped = {}
    if isinstance(qg, str):
        skipped["qdsl int8"] = qg
    with tempfile.TemporaryDirectory() as tmpdir:
        onnx_path = _onnx_int8(model, args.seq, Path(tmpdir))
        if isinstance(onnx_path, str):
            skipped["ort dyn int8"] = onnx_path
        for threads in args.threads:
            torch.set_num_threads(threads)
            if not isinstance(qg, str):
                rt.set_num_threads(threads)
            sess = None if isinstance(onnx_path, str) else _ort.session(str(onnx_path), threads)
            for batch in (int(b) for b in args.batches.split(",")):
                x = torch.randn(batch, args.seq, D, generator=torch.Generator().manual_seed(batch))
                xn = x.numpy()
                fns = {"torch fp32": lambda: model(x), "torch.ao dyn": lambda: dyn(x)}
                if sess is not None:
                    fns["ort dyn int8"] = lambda: sess.run(None, {"x": xn})
                if not isinstance(qg, str):
                    fns["qdsl int8"] = lambda: qg.run(xn)
                with torch.no_grad():
                    times = interleaved(fns, args.rounds, args.reps, 0.5)
                    want = model(x).numpy().ravel().astype(np.float64)
                    outs = {"torch fp32": want, "torch.ao dyn": dyn(x).numpy()}
                if sess is not None:
                    outs["ort dyn int8"] = sess.run(None, {"x": xn})[0]
                if not isinstance(qg, str):
                    outs["qdsl int8"] = np.asarray(qg.run(xn))
                print(f"\nbatch {batch}, seq {args.seq}, {threads} thread(s): ms per call, median (range) over "
                      f"{args.rounds} rounds; load average {load_average()}")
                ref = times.get("qdsl int8")
                for name, t in times.items():
                    got = np.asarray(outs[name], np.float64).ravel()
                    cos = float(got @ want / np.linalg.norm(got) / np.linalg.norm(want))
                    rel = "" if ref is None else f"   qdsl / this {span(np.asarray(ref) / np.asarray(t), 1, '.2f')}"
                    print(f"  {name:14s} {span(t, 1e3, '.1f'):>24s}   cosine to fp32 {cos:.4f}{rel}")
    for name, why in skipped.items():
        print(f"  {name:14s} not timed: {why}")
    print(f"load average {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

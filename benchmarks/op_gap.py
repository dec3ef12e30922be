"""Per-op gap table: qdsl's C++ runtime vs onnxruntime's QDQ model, layer by layer, on the
graphs benchmarks/e2e.py times (the same builders: e2e.export_qdsl / e2e.build_ort, the
same seeded calibration images and input).

qdsl's side is its per-op profile (QDSL_PROFILE=1, parsed by _timing.profile_lines: wall and
process CPU time per op); onnxruntime's is its node profile (SessionOptions.enable_profiling,
the JSON's ``*_kernel_time`` events: wall time per node), both with the same thread count.
Each round runs qdsl ``--runs`` times, then onnxruntime ``--runs`` times (interleaved
rounds), after a warm-up; a figure is the median (``--quantile``) over every run of every
round, so one slow run on a loaded machine moves no row (with load 8-10 on two cores,
``--quantile 10`` repeated within ~1% where medians moved by 10-30%).  Both profilers add a little per op; the op
sums are therefore a bit above the e2e latencies (compare ratios).

Rows are matched by the module path each op came from (qdsl: the exported op's name;
onnxruntime: the scope in its node name, /features/features.1/conv/conv.0/... ->
features.1.conv.0): convs by their module (ORT's QLinearConv carries the conv's scope,
qdsl's CONV the conv's path, so ReLU/BN folded into either side land on it), the rest by
(module, op kind, occurrence).  Then a per-block table (features.N, layerK.J, the stem,
the head): qdsl's fused ops (a 1x1 conv computed inside the depthwise after it, row bands)
and ORT's (a ReLU fused into the conv) differ per op but not per block.

    python benchmarks/op_gap.py                      # MobileNetV2, batch 1, 7-bit acts, 1 thread
    python benchmarks/op_gap.py --model resnet18 --batch 8 --bits 8 --rounds 5 --runs 10
    python benchmarks/op_gap.py --cache /tmp/gap     # keep (and reuse) the exported graphs

7-bit activations compare with ``ort u8s8 a7`` (e2e's exact 7-bit peer), 8-bit with
``ort u8u8`` (onnxruntime's exact 8-bit path).  The load average is printed before and
after: on a loaded machine compare ratios, not milliseconds.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# torch only builds the graphs here: one thread, as its OpenMP barriers crawl on a loaded machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["QDSL_PROFILE"] = "1"  # read once, when the runtime library loads

import argparse
import collections
import json
import logging
import re
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402  (puts this checkout's root first on sys.path)
import _ort  # noqa: E402
from _timing import load_average, profile_lines  # noqa: E402

PEER = {7: "ort u8s8 a7", 8: "ort u8u8"}


def scope_path(node_name: str) -> str:
    """The module path of a torch.onnx (TorchScript exporter) node name:
    ``/features/features.1/conv/conv.0/Conv_quant`` -> ``features.1.conv.0`` (each scope
    component repeats its parent's name before a Sequential index)."""
    parts = [p for p in node_name.split("/") if p][:-1]
    path: list[str] = []
    prev = ""
    for p in parts:
        if prev and p.startswith(prev + "."):
            path.append(p[len(prev) + 1:])
        else:
            path.append(p)
        prev = p
    return ".".join(path)


def block_of(path: str) -> str:
    """features.3.conv.1 -> features.3, layer2.0.conv1 -> layer2.0, conv1 -> conv1."""
    parts = path.split(".") if path else ["(graph)"]
    if len(parts) >= 2 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0]


def qdsl_kinds(graph) -> list[tuple[str, str]]:
    """(module path, op kind) of each op of an IntegerGraph, in run order."""
    return [(op.name, op.type.name) for op in graph.ops]


def ort_profile(path: str, threads: int, prefix: str):
    ort, _ = _ort.modules()
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.enable_profiling = True
    so.profile_file_prefix = prefix
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def parse_ort_profile(file: str) -> tuple[list[tuple[str, str]], list[list[float]]]:
    """(node name, op kind) in run order and, per model run, each node's kernel ms."""
    with open(file) as f:
        events = json.load(f)
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("cat") == "Session" and e.get("name") == "model_run")
    nodes = sorted((e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")),
                   key=lambda e: e["ts"])
    per_run: list[list] = [[] for _ in runs]
    starts = [r[0] for r in runs]
    for e in nodes:
        i = int(np.searchsorted(starts, e["ts"], side="right")) - 1
        if 0 <= i < len(runs) and e["ts"] <= runs[i][1]:
            per_run[i].append((e["name"][: -len("_kernel_time")], e["args"].get("op_name", "?"), e["dur"] / 1e3))
    per_run = [r for r in per_run if r]
    order = [(n, k) for n, k, _ in per_run[-1]]
    times = [[t for _, _, t in r] for r in per_run if [(n, k) for n, k, _ in r] == order]
    return order, times


# op kinds of both sides under one name (ORT's after its QDQ fusion)
_KINDS = {"QLINEARADD": "ADD", "QLINEARGLOBALAVERAGEPOOL": "POOL", "GLOBAL_AVGPOOL": "POOL", "GLOBALAVERAGEPOOL": "POOL",
          "QGEMM": "LINEAR", "QLINEARMATMUL": "LINEAR", "MATMULINTEGER": "LINEAR", "QUANTIZELINEAR": "QUANTIZE",
          "DEQUANTIZELINEAR": "DEQUANTIZE", "FLATTEN": "RESHAPE", "QLINEARCONV": "conv", "CONV2D": "conv",
          "CONV1D": "conv", "MAXPOOL2D": "MAXPOOL", "MAXPOOL": "MAXPOOL"}
# the graph's ends, where the two sides name ops differently: by kind
_ENDS = {"QUANTIZE": "(input)", "DEQUANTIZE": "(output)", "POOL": "(head)", "RESHAPE": "(head)"}


def keyed(items: list[tuple[str, str]]) -> list[tuple]:
    """Match keys (module path, kind, occurrence): convs as 'conv' on either side (a ReLU or
    BN folded in either side's conv lands on it), the input QUANTIZE, output DEQUANTIZE and
    the head's pool/flatten by kind alone."""
    seen: collections.Counter = collections.Counter()
    out = []
    for path, kind in items:
        k = _KINDS.get(kind.upper(), kind.upper())
        if k in _ENDS and (not path or path.startswith("<") or path.endswith(":input")):
            path = _ENDS[k]
        path = path or "(graph)"
        out.append((path, k, seen[(path, k)]))
        seen[(path, k)] += 1
    return out


def build(args, workdir: str):
    """(IntegerGraph, ORT model path, input) for --model/--bits, exported or read from --cache."""
    from qdsl.graph.qgraph import load_graph, save_graph

    name = args.model
    model = e2e.factories(args.small)[name]()
    g, calib = e2e.calibration(args.size, args.calib_batches, args.calib_batch)
    tag = f"{name}{'_small' if args.small else ''}_{args.size}"
    qpath = os.path.join(workdir, f"{tag}_a{args.bits}.qgraph")
    if os.path.exists(qpath):
        graph = load_graph(qpath)
    else:
        graph = e2e.export_qdsl(model, calib, args.bits == 7)
        save_graph(graph, qpath)
    peer = PEER[args.bits]
    opath = os.path.join(workdir, tag, e2e.ORT_SYSTEMS[peer] + ".onnx")
    if not os.path.exists(opath):
        os.makedirs(os.path.dirname(opath), exist_ok=True)
        e2e.build_ort(model, calib, os.path.dirname(opath), {peer})
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g).numpy()
    return graph, opath, x


def table(rows: list[tuple], title: str) -> None:
    print(f"\n{title}")
    print(f"  {'':<34} {'qdsl ms':>9} {'ORT ms':>9} {'qdsl/ORT':>9} {'qdsl-ORT':>9}")
    for label, q, o in rows:
        ratio = f"{q / o:9.2f}" if q and o else f"{'-':>9}"
        diff = q - o
        print(f"  {label:<34} {q:9.3f} {o:9.3f} {ratio} {diff:+9.3f}")


def main(argv=None) -> list[tuple]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2", choices=list(e2e.factories(False)))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--bits", type=int, default=7, choices=[7, 8], help="qdsl activation bits (peer: 7 -> ort "
                    "u8s8 a7, 8 -> ort u8u8)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--runs", type=int, default=10, help="profiled runs per system per round")
    ap.add_argument("--warmup", type=int, default=5, help="untimed runs per system before the rounds")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--small", action="store_true", help="test-width models (smoke runs)")
    ap.add_argument("--calib-batches", type=int, default=4)
    ap.add_argument("--calib-batch", type=int, default=4)
    ap.add_argument("--cache", default=None, help="directory keeping the exported graphs between runs")
    ap.add_argument("--quantile", type=float, default=50, help="per-op statistic over all runs (50: the median; "
                    "on a loaded machine a low one, e.g. 10, is the least disturbed)")
    ap.add_argument("--top", type=int, default=0, help="also list the N largest per-op gaps")
    args = ap.parse_args(argv)

    import qdsl.runtime as rt

    if not rt.available():
        raise SystemExit(f"qdsl runtime unavailable: {rt.load_error()}")
    if _ort.modules() is None:
        raise SystemExit("onnx/onnxruntime not installed (pip install .[bench])")
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    print(f"{args.model}, batch {args.batch}, {args.bits}-bit activations vs {PEER[args.bits]}, {args.threads} "
          f"thread(s), {args.rounds} rounds x {args.runs} runs; load average: {load_average()}")
    tmp = tempfile.TemporaryDirectory()
    workdir = args.cache or tmp.name
    os.makedirs(workdir, exist_ok=True)
    graph, opath, x = build(args, workdir)
    qkeys = keyed(qdsl_kinds(graph))

    rt.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    compiled = rt.CompiledGraph(graph)
    sess = ort_profile(opath, args.threads, os.path.join(tmp.name, "ort"))
    feed = {sess.get_inputs()[0].name: x}
    profile_lines(compiled, x, args.warmup)
    for _ in range(args.warmup):
        sess.run(None, feed)
    n_ops = len(graph.ops)
    q_wall: list[np.ndarray] = []
    q_cpu: list[np.ndarray] = []
    for _ in range(args.rounds):
        lines = profile_lines(compiled, x, args.runs)
        for r in range(len(lines) // n_ops):
            run = lines[r * n_ops:(r + 1) * n_ops]
            q_wall.append(np.array([ln[2] for ln in run]))
            q_cpu.append(np.array([ln[3] for ln in run]))
        for _ in range(args.runs):
            sess.run(None, feed)
    order, o_times = parse_ort_profile(sess.end_profiling())
    o_times = o_times[args.warmup:] or o_times  # (the warm-up runs are profiled too)
    load_after = load_average()
    q_wall_m = np.percentile(np.stack(q_wall), args.quantile, axis=0)
    q_cpu_m = np.percentile(np.stack(q_cpu), args.quantile, axis=0)
    o_m = np.percentile(np.array(o_times), args.quantile, axis=0)
    okeys = keyed([(scope_path(n), k) for n, k in order])

    print(f"qdsl: {n_ops} ops, {len(q_wall)} profiled runs; onnxruntime: {len(order)} nodes, {len(o_times)} runs")
    print(f"run sums (median over runs of each run's op sum): qdsl wall {np.median([w.sum() for w in q_wall]):.3f} ms "
          f"(cpu {np.median([c.sum() for c in q_cpu]):.3f}), ORT {np.median([sum(t) for t in o_times]):.3f} ms "
          "(on a loaded machine nearly every whole run is preempted somewhere; the per-op figures below drop that)")
    stat = "median" if args.quantile == 50 else f"{args.quantile:g}th percentile"
    q_by = {k: i for i, k in enumerate(qkeys)}
    o_by = {k: i for i, k in enumerate(okeys)}
    rows = []
    for k in dict.fromkeys(qkeys + okeys):
        q = float(q_wall_m[q_by[k]]) if k in q_by else 0.0
        o = float(o_m[o_by[k]]) if k in o_by else 0.0
        label = f"{k[0]} {k[1]}{'' if k[2] == 0 else f'#{k[2]}'}"
        label += "" if k in q_by else " [ORT only]" if k in o_by else ""
        label += "" if k in o_by else " [qdsl only]"
        rows.append((k, label, q, o))
    table([(lbl, q, o) for _, lbl, q, o in rows], f"per op ({stat} over runs, wall ms; matched by module path and kind; qdsl 0.000: computed inside "
          "another op, e.g. a twin conv, a fused ADD, a row-band producer)")

    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    blocks: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for k, _, q, o in rows:
        kinds[k[1]][0] += q
        kinds[k[1]][1] += o
        blocks[block_of(k[0])][0] += q
        blocks[block_of(k[0])][1] += o
    table([(b, q, o) for b, (q, o) in blocks.items()], "per block (sums of the matched rows)")
    table([(b, q, o) for b, (q, o) in sorted(kinds.items(), key=lambda kv: -kv[1][0])], "per op kind (sums)")
    tq, to = sum(v[0] for v in kinds.values()), sum(v[1] for v in kinds.values())
    print(f"\nop sums: qdsl {tq:.3f} ms, ORT {to:.3f} ms, qdsl/ORT {tq / to:.3f} "
          f"(sum of the per-op {stat}s; qdsl cpu {q_cpu_m.sum():.3f} ms)")
    if args.top:
        top = sorted(rows, key=lambda r: -(r[2] - r[3]))[: args.top]
        table([(lbl, q, o) for _, lbl, q, o in top], f"largest {args.top} gaps (qdsl - ORT; a depthwise conv that computes "
              "its 1x1 producer's rows (row bands) holds that conv's time too: see the blocks)")
    print(f"load average before: see header; after: {load_after} (a loaded machine moves milliseconds, compare "
          "ratios)")
    return [(k, q, o) for k, _, q, o in rows]


if __name__ == "__main__":
    main()

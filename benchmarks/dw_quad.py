"""Per-op CPU-time A/B of the NHWC depthwise conv's vpmaddubsw kernel (ConvParams::dwq,
csrc/kernels/x86/dwconv_nhwc_u8s8_avx2.cc) against the int16 kernel it replaces, in one build:
QDSL_DW_QUAD=1 vs 0 (read once per process), on a saved graph (e.g. MobileNetV2 with 7-bit
activations, as cpu_ab.py builds it; save one with qdsl.graph.qgraph.save_graph).

Each variant runs in its own child process at 1 thread with QDSL_PROFILE=1; per round each
child is started afresh and times --runs calls (per-op median of the profiled CPU times), the
variants taken in turn (A, B, then B, A).  A figure is the median over rounds; the depthwise
rows are summed for the ops stored NHWC (where the kernel runs).  On a machine shared with
other work, CPU time is less sensitive to neighbours than wall time, but not immune: the load
average is printed.

    python benchmarks/dw_quad.py GRAPH.qg [--batch 1] [--runs 10] [--rounds 6] [--size 224]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["main"]

_CHILD = r"""
import json, os, statistics, sys
os.environ["QDSL_PROFILE"] = "1"
sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r})
import numpy as np
import qdsl.runtime as rt
from qdsl.graph.qgraph import load_graph
from _timing import profile_lines
rt.set_num_threads(1)
cg = rt.CompiledGraph(load_graph({graph!r}))
x = np.random.default_rng(0).standard_normal(({batch}, 3, {size}, {size})).astype(np.float32)
profile_lines(cg, x, 3)
by = {{}}
for (i, name, wall, cpu, *_r) in profile_lines(cg, x, {runs}):
    by.setdefault(i, [name, []])[1].append(cpu)
plan = cg.plan()
print(json.dumps({{i: [n, statistics.median(v), plan[i]["nhwc_output"], plan[i].get("depthwise_maddubs", False)]
                  for i, (n, v) in by.items()}}))
"""


def _round(args, quad: str) -> dict:
    code = _CHILD.format(root=str(ROOT), bench=str(ROOT / "benchmarks"), graph=args.graph, batch=args.batch,
                         size=args.size, runs=args.runs)
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "QDSL_DW_QUAD": quad},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graph")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    before = " ".join(f"{v:.2f}" for v in os.getloadavg())
    res: dict[str, list[dict]] = {"0": [], "1": []}
    for r in range(args.rounds):
        for quad in ("0", "1") if r % 2 == 0 else ("1", "0"):
            res[quad].append(_round(args, quad))
    after = " ".join(f"{v:.2f}" for v in os.getloadavg())
    first = res["1"][0]
    dw_old = dw_new = 0.0
    print(f"{'op':36s} {'int16 ms':>9s} {'maddubs ms':>10s}  ratio")
    for i, (name, _, nhwc, quad) in first.items():
        old = statistics.median(d[i][1] for d in res["0"])
        new = statistics.median(d[i][1] for d in res["1"])
        if quad and nhwc:
            dw_old, dw_new = dw_old + old, dw_new + new
        if quad:
            print(f"{i:>3s} {name[:32]:32s} {old:9.3f} {new:10.3f}  {new / old:.3f}{'' if nhwc else '  (NCHW: plane kernel)'}")
    tot = {q: [sum(v[1] for v in d.values()) for d in res[q]] for q in res}
    print(f"NHWC depthwise convs on the vpmaddubsw kernel: {dw_old:.3f} -> {dw_new:.3f} ms ({dw_new / max(dw_old, 1e-9):.3f}x)")
    print(f"sum of all ops: {statistics.median(tot['0']):.3f} -> {statistics.median(tot['1']):.3f} ms; "
          f"load {before} -> {after}")


if __name__ == "__main__":
    main()

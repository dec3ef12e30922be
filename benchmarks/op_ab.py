"""Per-op CPU-time A/B of two builds of the runtime (or one build under two environments) on a
saved graph, e.g. the MobileNetV2 / ResNet-18 graphs that ``op_gap.py --cache DIR`` keeps.

Each contender is a child process at 1 thread with QDSL_PROFILE=1 that loads the graph once:
``base`` is this checkout's Python package with the library given by ``--base`` (a copy of an
older ``_qdsl_native*.so``) or this checkout's library with ``--base-env VAR=VALUE`` set, ``new``
this checkout as built (``--new-env VAR=VALUE``: with that variable set).  Per round each child
profiles ``--runs`` calls and reports each op's median CPU ms; the children are taken in turn
(A, B, then B, A).  A figure is the median over rounds, a ratio the median (and range) of the
per-round new / base ratios.  Ops are matched by index, so both contenders must plan the same
op list (a row-band producer or a twin reads 0.000: its time is inside another op).  Only ops
with a base or new median of at least ``--min-ms`` are listed; the sum covers all of them.
CPU time is less sensitive to other processes than wall time, not immune: the load average is
printed before and after.

    python benchmarks/op_ab.py GRAPH.qgraph (--base OLD.so | --base-env VAR=VALUE) [--new-env VAR=VALUE]
                               [--batch 1] [--rounds 8] [--runs 10] [--match NAME_PART]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["main"]


def _worker(root: str, graph: str, batch: int, size: int) -> None:
    """Child process: per line of stdin (a call count) print a JSON {index: [name, median cpu ms]}."""
    sys.path.insert(0, root)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import numpy as np
    import qdsl.runtime as rt
    from _timing import profile_lines
    from qdsl.graph.qgraph import load_graph

    rt.set_num_threads(1)
    cg = rt.CompiledGraph(load_graph(graph))
    x = np.random.default_rng(0).standard_normal((batch, 3, size, size)).astype(np.float32)
    profile_lines(cg, x, 3)
    print("ready", flush=True)
    for line in sys.stdin:
        by: dict[int, list] = {}
        for i, name, _wall, cpu, *_ in profile_lines(cg, x, int(line)):
            by.setdefault(i, [name, []])[1].append(cpu)
        print(json.dumps({i: [n, statistics.median(v)] for i, (n, v) in by.items()}), flush=True)


def _env(arg: str | None) -> dict[str, str]:
    if not arg:
        return {}
    var, _, value = arg.partition("=")
    return {var: value}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graph")
    ap.add_argument("--base", help="the older _qdsl_native*.so to compare against")
    ap.add_argument("--base-env", help="VAR=VALUE: the base is this library run with that variable set")
    ap.add_argument("--new-env", help="VAR=VALUE: the new contender runs with that variable set")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--runs", type=int, default=10, help="profiled calls per contender per round (median)")
    ap.add_argument("--min-ms", type=float, default=0.01, help="list ops at least this long (either side)")
    ap.add_argument("--match", default="", help="list only ops whose name contains this")
    args = ap.parse_args(argv)
    if (args.base is None) == (args.base_env is None):
        raise SystemExit("give one of --base and --base-env")
    native = next((ROOT / "qdsl" / "runtime").glob("_qdsl_native*.so"), None)
    if native is None:
        raise SystemExit("this checkout's runtime is not built (python setup.py build_ext --inplace)")
    env = {**os.environ, "QDSL_PROFILE": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as work:
        base_root = str(ROOT)
        if args.base:
            base_root = os.path.join(work, "base")
            shutil.copytree(ROOT / "qdsl", os.path.join(base_root, "qdsl"),
                            ignore=shutil.ignore_patterns("__pycache__", "_qdsl_native*.so"))
            shutil.copy(args.base, os.path.join(base_root, "qdsl", "runtime", native.name))
        spec = {"base": (base_root, _env(args.base_env)), "new": (str(ROOT), _env(args.new_env))}
        before = " ".join(f"{v:.2f}" for v in os.getloadavg())
        procs = {k: subprocess.Popen([sys.executable, __file__, "--worker", root, args.graph, str(args.batch),
                                      str(args.size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**env, **extra})
                 for k, (root, extra) in spec.items()}
        try:
            for p in procs.values():
                if p.stdout.readline().strip() != "ready":
                    raise SystemExit("a contender failed to start")
            res: dict[str, list[dict]] = {k: [] for k in procs}
            for r in range(args.rounds):
                for k in list(procs) if r % 2 == 0 else list(procs)[::-1]:
                    procs[k].stdin.write(f"{args.runs}\n")
                    procs[k].stdin.flush()
                    res[k].append(json.loads(procs[k].stdout.readline()))
        finally:
            for p in procs.values():
                p.stdin.close()
                p.wait()
    after = " ".join(f"{v:.2f}" for v in os.getloadavg())
    ops = res["new"][0]
    if set(ops) != set(res["base"][0]):
        raise SystemExit("the two contenders profile different op lists")
    print(f"{Path(args.graph).name} batch {args.batch}, 1 thread, {args.rounds} rounds x {args.runs} runs; "
          f"per-op CPU ms (medians over rounds)")
    print(f"{'op':>4s} {'name':36s} {'base':>8s} {'new':>8s}  new/base (range)")
    tb = [sum(v[1] for v in d.values()) for d in res["base"]]
    tn = [sum(v[1] for v in d.values()) for d in res["new"]]
    for i, (name, _) in ops.items():
        b = [d[i][1] for d in res["base"]]
        n = [d[i][1] for d in res["new"]]
        mb, mn = statistics.median(b), statistics.median(n)
        if max(mb, mn) < args.min_ms or args.match not in name:
            continue
        rs = [y / x for x, y in zip(b, n) if x > 0]
        ratio = f"{statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f})" if rs else "-"
        print(f"{i:>4s} {name[:36]:36s} {mb:8.3f} {mn:8.3f}  {ratio}")
    rs = [y / x for x, y in zip(tb, tn)]
    print(f"sum of all ops: {statistics.median(tb):.3f} -> {statistics.median(tn):.3f} ms, new/base "
          f"{statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f}); load {before} -> {after}")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()

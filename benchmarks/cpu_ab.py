"""CPU-time A/B of two builds of the runtime on ResNet-18 / MobileNetV2 at 3x224x224 (7-bit
activations, as ``qdsl a7`` in e2e.py), with onnxruntime's u8s8 QDQ model on 7-bit data
(``ort u8s8 a7``) as the peer, 1 thread.

On a machine shared with other work, wall times measure the neighbours; the CPU time a
process spends on a run (``time.process_time``) is much less sensitive to them, though cache
and frequency effects remain, so figures still come with their ranges.  Each contender runs
in its own child process (one native library per process): ``base`` is this checkout's
Python package with the library given by ``--base`` (a copy of an older
``_qdsl_native*.so``), ``new`` this checkout as built, ``ort`` an onnxruntime session with
``intra_op_num_threads`` = 1.  Per round each child times ``--runs`` calls (median), the
children taken in turn (A, B, C, then C, B, A); a ratio is taken round by round and given as
its median and range over ``--rounds``.  The load average is printed before and after.

    python benchmarks/cpu_ab.py --base /path/to/old/_qdsl_native.so [--models resnet18,mobilenet_v2]
                                [--batches 1,8] [--rounds 15] [--runs 4] [--no-ort] [--cache DIR]

``--bits 8``: the exact 8-bit graphs (``qdsl a8``) with onnxruntime's exact ``ort u8u8`` as the
peer.  ``--base-env VAR=VALUE`` (instead of ``--base``): ``base`` is this checkout's own library
run with that environment variable set, e.g. ``QDSL_EVEX_VNNI=0`` to time a runtime switch.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import copy
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["main"]


def _worker(kind: str, root: str, model: str, batch: int) -> None:
    """Child process: load one contender, then per line of stdin (a call count) print the
    median CPU ms of that many calls."""
    import numpy as np

    x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    if kind == "ort":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import _ort

        sess = _ort.session(model, 1)
        fn = lambda: sess.run(None, {"x": x})  # noqa: E731
    else:
        sys.path.insert(0, root)
        import qdsl.runtime as rt
        from qdsl.graph.qgraph import load_graph

        rt.set_num_threads(1)
        compiled = rt.CompiledGraph(load_graph(model))
        fn = lambda: compiled.run(x)  # noqa: E731
    for _ in range(3):
        fn()
    print("ready", flush=True)
    for line in sys.stdin:
        ts = []
        for _ in range(int(line)):
            t = time.process_time()
            fn()
            ts.append(time.process_time() - t)
        print(statistics.median(ts) * 1e3, flush=True)


def _build(name: str, workdir: str, with_ort: bool, bits: int = 7) -> tuple[str, str | None]:
    """The model's qdsl a7 (bits 8: a8) graph and (with_ort) its ort u8s8 a7 (u8u8) model, as
    e2e.py builds them."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import qdsl
    from e2e import build_ort, factories
    from qdsl.graph.qgraph import save_graph

    torch.manual_seed(0)
    model = factories(False)[name]().eval()
    g = torch.Generator().manual_seed(0)
    calib = [torch.randn(4, 3, 224, 224, generator=g) for _ in range(4)]
    qm = copy.deepcopy(model)
    overrides = ["input.bits=7", "output.bits=7"] if bits == 7 else []
    qdsl.apply(qm, qdsl.load_spec(str(ROOT / "specs" / "int8-default.qspec")), overrides=overrides)
    qdsl.calibrate(qm, calib, progress=False)
    qdsl.freeze(qm)
    graph = os.path.join(workdir, f"{name}.qg")
    save_graph(qdsl.export(qm, calib[0][:2]), graph)
    peer = "ort u8s8 a7" if bits == 7 else "ort u8u8"
    onnx = build_ort(model, calib, workdir, {peer})[peer] if with_ort else None
    return graph, onnx


def _cached(cache: str, name: str, bits: int) -> tuple[str | None, str | None]:
    """The graph and ORT model `op_gap.py --cache` saved for the model at 224 (None, None when
    either is missing)."""
    graph = os.path.join(cache, f"{name}_224_a{bits}.qgraph")
    onnx = os.path.join(cache, f"{name}_224", "u8s8a7.onnx" if bits == 7 else "u8u8.onnx")
    return (graph, onnx) if os.path.exists(graph) and os.path.exists(onnx) else (None, None)


def _ab(spec: dict, batch: int, rounds: int, runs: int) -> dict[str, list[float]]:
    procs = {k: subprocess.Popen([sys.executable, __file__, "--worker", kind, root, model, str(batch)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, **(extra[0] if extra else {})})
             for k, (kind, root, model, *extra) in spec.items()}
    try:
        for p in procs.values():
            if p.stdout.readline().strip() != "ready":
                raise SystemExit("a contender failed to start")
        res: dict[str, list[float]] = {k: [] for k in procs}
        for i in range(rounds):
            for k in list(procs) if i % 2 == 0 else list(procs)[::-1]:
                procs[k].stdin.write(f"{runs}\n")
                procs[k].stdin.flush()
                res[k].append(float(procs[k].stdout.readline()))
        return res
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait()


def _ratio(res, num: str, den: str) -> str:
    r = [a / b for a, b in zip(res[num], res[den])]
    return f"{num}/{den} {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the older _qdsl_native*.so to compare against")
    ap.add_argument("--base-env", help="VAR=VALUE: the base is this library run with that variable set")
    ap.add_argument("--bits", type=int, choices=(7, 8), default=7, help="activation bits (8: vs ort u8u8)")
    ap.add_argument("--models", default="resnet18,mobilenet_v2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--runs", type=int, default=4, help="timed calls per contender per round (median)")
    ap.add_argument("--no-ort", action="store_true", help="leave out the onnxruntime peer")
    ap.add_argument("--cache", help="op_gap.py's --cache directory: take the graphs exported there, if present "
                                    "(op_gap's calibration, not this script's)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    if (args.base is None) == (args.base_env is None):
        raise SystemExit("give one of --base and --base-env")
    native = next((ROOT / "qdsl" / "runtime").glob("_qdsl_native*.so"), None)
    if native is None:
        raise SystemExit("this checkout's runtime is not built (python setup.py build_ext --inplace)")
    with tempfile.TemporaryDirectory() as work:
        base_env = {}
        if args.base:
            base_root = os.path.join(work, "base")
            shutil.copytree(ROOT / "qdsl", os.path.join(base_root, "qdsl"),
                            ignore=shutil.ignore_patterns("__pycache__", "_qdsl_native*.so"))
            shutil.copy(args.base, os.path.join(base_root, "qdsl", "runtime", native.name))
        else:
            base_root = str(ROOT)
            var, _, value = args.base_env.partition("=")
            base_env = {var: value}
        for name in args.models.split(","):
            graph, onnx = _cached(args.cache, name, args.bits) if args.cache else (None, None)
            if graph is None:
                graph, onnx = _build(name, work, not args.no_ort, args.bits)
            if args.no_ort:
                onnx = None
            spec = {"base": ("qdsl", base_root, graph, base_env), "new": ("qdsl", str(ROOT), graph)}
            if onnx:
                spec["ort"] = ("ort", "-", onnx)
            for batch in (int(b) for b in args.batches.split(",")):
                before = " ".join(f"{v:.2f}" for v in os.getloadavg())
                res = _ab(spec, batch, args.rounds, args.runs)
                after = " ".join(f"{v:.2f}" for v in os.getloadavg())
                cpu = ", ".join(f"{k} {statistics.median(v):.2f} ms" for k, v in res.items())
                ratios = [_ratio(res, "new", "base")] + ([_ratio(res, k, "ort") for k in ("base", "new")] if onnx else [])
                print(f"{name} b{batch}: CPU {cpu}; {'; '.join(ratios)}; load {before} -> {after}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()

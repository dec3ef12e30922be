"""Whole-model A/B of the AVX2 implicit-GEMM NHWC convs (csrc/runtime/ops/conv_igemm.cc):
``CompiledGraph.run`` of ResNet-18 / MobileNetV2 (qdsl.zoo, 3x224x224) with QDSL_IGEMM on
and off, in the same build.

The models are quantized with specs/int8-default.qspec (exact 8-bit activations: the int16
kernel kind; --bits 7: 7-bit activations, the vpmaddubsw kind), calibrated on generated
images, exported once and saved; then each variant runs in its own child process (QDSL_IGEMM
is read once per process), children taken in turn round after round (on, off, on, off, ...).
A figure is the median over rounds of each child's fastest per-call CPU time (process time at
1 thread: less sensitive to the other processes of a shared machine than wall time).  Ratio:
on / off (< 1: the implicit-GEMM convs make the model faster).

    python benchmarks/igemm_models.py [--models resnet18,mobilenet_v2] [--batch 1] [--bits 8]
                                      [--rounds 5] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, time
sys.path.insert(0, {root!r})
import numpy as np
import qdsl.runtime as rt
from qdsl.graph.qgraph import load_graph
rt.set_num_threads(1)
cg = rt.CompiledGraph(load_graph({path!r}))
x = np.random.default_rng(0).standard_normal(({batch}, 3, {size}, {size})).astype(np.float32)
for _ in range(2):
    cg.run(x)
times = []
for _ in range({reps}):
    t = time.process_time()
    cg.run(x)
    times.append(time.process_time() - t)
plan = cg.plan()
print(json.dumps({{"t": min(times), "int16": sum(bool(p.get("implicit_gemm_int16")) for p in plan),
                  "u8s8": sum(p.get("implicit_gemm_int16") is False for p in plan),
                  "convs": sum("implicit_gemm" in p for p in plan)}}))
"""


def _export(name: str, bits: int, size: int, path: str) -> None:
    import torch

    import qdsl
    from qdsl.graph.qgraph import save_graph
    from qdsl.zoo.mobilenet import mobilenet_v2
    from qdsl.zoo.resnet import resnet18

    model = {"resnet18": resnet18, "mobilenet_v2": mobilenet_v2}[name]().eval()
    g = torch.Generator().manual_seed(0)
    calib = [torch.randn(4, 3, size, size, generator=g) for _ in range(2)]
    overrides = ["input.bits=7", "output.bits=7"] if bits == 7 else []
    qdsl.apply(model, qdsl.load_spec(str(ROOT / "specs" / "int8-default.qspec")), overrides=overrides)
    qdsl.calibrate(model, calib, progress=False)
    qdsl.freeze(model)
    save_graph(qdsl.export(model, calib[0][:2]), path)


def _child(path: str, igemm: bool, batch: int, size: int, reps: int) -> dict:
    env = dict(os.environ, QDSL_IGEMM="1" if igemm else "0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    code = _CHILD.format(root=str(ROOT), path=path, batch=batch, size=size, reps=reps)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,mobilenet_v2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--bits", type=int, choices=[7, 8], default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"load average: {load}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = str(Path(tmp) / f"{name}.qgraph")
            _export(name, args.bits, args.size, path)
            t = {True: [], False: []}
            info = {}
            for _ in range(args.rounds):
                for on in (True, False):
                    r = _child(path, on, args.batch, args.size, args.reps)
                    t[on].append(r["t"])
                    if on:
                        info = r
            ratios = np.array(t[True]) / np.array(t[False])
            print(f"{name}, batch {args.batch}, {args.bits}-bit acts: implicit-GEMM convs {info['int16']} int16 + "
                  f"{info['u8s8']} vpmaddubsw of {info['convs']} int convs/linears; "
                  f"on {np.median(t[True]) * 1e3:.1f} ms, off {np.median(t[False]) * 1e3:.1f} ms (CPU time), "
                  f"on/off {np.median(ratios):.2f} ({ratios.min():.2f}-{ratios.max():.2f})")
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"load average: {load}")


if __name__ == "__main__":
    main()

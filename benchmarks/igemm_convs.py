"""Single-conv GMAC/s of the AVX2 implicit-GEMM NHWC conv (csrc/runtime/ops/conv_igemm.cc)
against the gathered-panel conv it replaces, on ResNet-18 / MobileNetV2 shapes, batch 1, with
7-bit activations (a CLAMP to 0..127 in front, so int8 weights run the vpmaddubsw kernels) or,
with --bits 8, full-range 8-bit ones (the exact int16 kernels on both sides).

The two convs are the same build: QDSL_IGEMM=0 (read once per process) turns the implicit-GEMM
path off, so each variant runs in its own child process; the children are taken in turn round
after round (A, B, A, B, ...).  A figure is the median over rounds of each child's fastest
per-call CPU time (process time, 1 thread: less sensitive to other processes on a shared
machine than wall time).  The graph's input and output are NCHW, so the implicit-GEMM figure
includes its NCHW -> NHWC copy and its NCHW output transpose (inside a graph, neighbouring
NHWC ops avoid both).  Ratios: implicit / gathered time (< 1: implicit faster).

    python benchmarks/igemm_convs.py [--rounds 5] [--reps 20] [--bits 7|8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# (name, C, O, k, stride, H=W of the input); per-channel FIXED_SINGLE output stages as exported
SHAPES = [("r18 layer1 3x3", 64, 64, 3, 1, 56), ("r18 layer2 3x3", 128, 128, 3, 1, 28),
          ("r18 layer3 3x3", 256, 256, 3, 1, 14), ("r18 layer4 3x3", 512, 512, 3, 1, 7),
          ("r18 layer2.0 3x3/2", 64, 128, 3, 2, 56), ("r18 downsample 1x1/2", 128, 256, 1, 2, 28),
          ("mnv2 1x1 576->96", 576, 96, 1, 1, 14), ("mnv2 1x1 960->160", 960, 160, 1, 1, 7),
          ("mnv2 1x1 320->1280", 320, 1280, 1, 1, 7)]

_CHILD = r"""
import json, sys, time
sys.path.insert(0, {root!r})
import numpy as np
import qdsl.runtime as rt
from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Tensor
from qdsl.graph.requant import make_rescale
rt.set_num_threads(1)
out = {{}}
for name, c, o, k, s, hw in {shapes!r}:
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (o, c, k, k)).astype(np.int8)
    ohw = (hw + 2 * (k // 2) - k) // s + 1
    attrs = {{"stride": [s, s], "padding": [k // 2] * 2, "dilation": [1, 1], "groups": 1, "in_zp": 0, "w_zp": [0],
             "acc_bits": 32, "overflow": 0}}
    rescale = make_rescale(rng.uniform(5e-4, 2e-3, o), allow_pot=False, single=True)
    attrs.update(OutputStage(rescale, 0, 0, {top}).attrs())
    ts = [Tensor("x", DType.U8, (-1, c, hw, hw)), Tensor("xc", DType.U8, (-1, c, hw, hw)),
          Tensor("w", DType.I8, w.shape, w), Tensor("y", DType.U8, (-1, o, ohw, ohw))]
    g = IntegerGraph(ts, ["x"], ["y"], [Op(OpType.CLAMP, "clamp", ["x"], ["xc"], {{"out_min": 0, "out_max": {top}}}),
                                          Op(OpType.CONV2D, "conv", ["xc", "w"], ["y"], attrs)]).validate()
    cg = rt.CompiledGraph(g)
    x = rng.integers(0, {top} + 1, (1, c, hw, hw)).astype(np.uint8)
    for _ in range(3):
        cg.run(x)
    best = []
    for _ in range({reps}):
        t = time.process_time()
        for _ in range(4):
            cg.run(x)
        best.append((time.process_time() - t) / 4)
    out[name] = min(best)
print(json.dumps(out))
"""


def _child(igemm: bool, reps: int, bits: int) -> dict[str, float]:
    env = dict(os.environ, QDSL_IGEMM="1" if igemm else "0", OPENBLAS_NUM_THREADS="1")
    code = _CHILD.format(root=str(ROOT), shapes=SHAPES, reps=reps, top=2**bits - 1)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bits", type=int, choices=[7, 8], default=7, help="activation bits (8: exact int16 kernels)")
    args = ap.parse_args(argv)
    print(f"load average: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    times: dict[str, dict[str, list[float]]] = {"implicit": {}, "gathered": {}}
    for _ in range(args.rounds):
        for variant, on in (("implicit", True), ("gathered", False)):
            for name, t in _child(on, args.reps, args.bits).items():
                times[variant].setdefault(name, []).append(t)
    print(f"{f'conv (batch 1, {args.bits}-bit acts)':<24} {'MMAC':>6}  {'gathered GMAC/s':>16}  {'implicit GMAC/s':>16}  ratio")
    for name, c, o, k, s, hw in SHAPES:
        ohw = (hw + 2 * (k // 2) - k) // s + 1
        macs = c * o * k * k * ohw * ohw
        g, i = np.median(times["gathered"][name]), np.median(times["implicit"][name])
        ratios = np.array(times["implicit"][name]) / np.array(times["gathered"][name])
        print(f"{name:<24} {macs / 1e6:6.1f}  {macs / g / 1e9:16.1f}  {macs / i / 1e9:16.1f}  "
              f"{np.median(ratios):.2f} ({ratios.min():.2f}-{ratios.max():.2f})")
    print(f"load average: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()

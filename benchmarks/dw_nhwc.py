"""Per-op wall time of MobileNetV2's depthwise convs (3x3, U8 activations, per-channel
FIXED_SINGLE stage with a ReLU6-style clamp, batch 1, 1 thread) between NCHW tensors and
between NHWC tensors (conv_dw_nhwc.cc), from QDSL_PROFILE.  Between NCHW tensors the
runtime takes the plane path (conv_dw.cc), except on output planes of at most 8 x 8, which
go channels-last with transposes in and out (conv_exec.cc): there the NCHW column is that.

Each shape runs as the middle conv of a chain dw -> dw(shape) -> dw: with the two inner
tensors NHWC (PlanNhwc keeps them between depthwise convs) the middle conv reads and
writes NHWC; with them also graph outputs everything stays NCHW.  The two variants are
taken in turn round after round; a figure is the median over rounds of the per-round
medians of the middle op, with the range over rounds.

    python benchmarks/dw_nhwc.py [--rounds 5] [--runs 30]
"""

from __future__ import annotations

import os

os.environ["QDSL_PROFILE"] = "1"  # read once by the library, before it is loaded
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's qdsl

from _timing import load_average, profile_lines, span  # noqa: E402

__all__ = ["main"]

# (channels, input size, stride) of MobileNetV2's depthwise convs at 224 x 224
SHAPES = [(32, 112, 1), (96, 112, 2), (144, 56, 1), (144, 56, 2), (192, 28, 1), (192, 28, 2), (384, 14, 1),
          (576, 14, 1), (576, 14, 2), (960, 7, 1)]


def _chain(rng, c: int, hw: int, stride: int, nchw: bool):
    from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Tensor
    from qdsl.graph.requant import make_rescale

    tensors, ops, src, h = [Tensor("x", DType.U8, (-1, c, hw, hw))], [], "x", hw
    for i, s in enumerate((1, stride, 1)):
        oh = (h + 2 - 3) // s + 1
        w = rng.integers(-127, 128, (c, 1, 3, 3))
        stage = OutputStage(make_rescale(rng.uniform(1e-3, 4e-3, c), 1, allow_pot=False, single=True), 0, 0, 127)
        attrs = {"stride": [s, s], "padding": [1, 1], "dilation": [1, 1], "groups": c, "in_zp": 0, "w_zp": [0],
                 "acc_bits": 32, "overflow": 0, **stage.attrs()}
        name = f"t{i}"
        tensors += [Tensor(f"w{i}", DType.I8, w.shape, w), Tensor(f"b{i}", DType.I32, (c,), rng.integers(-9000, 9000, c)),
                    Tensor(name, DType.U8, (-1, c, oh, oh))]
        ops.append(Op(OpType.CONV2D, f"dw{i}", [src, f"w{i}", f"b{i}"], [name], attrs))
        src, h = name, oh
    outputs = ["t0", "t1", "t2"] if nchw else ["t2"]
    return IntegerGraph(tensors, ["x"], outputs, ops).validate()


def _middle_ms(compiled, x, runs: int) -> float:
    """Median wall time (ms) of op 1 over `runs` runs, from the profile lines."""
    return float(np.median([line[2] for line in profile_lines(compiled, x, runs) if line[0] == 1]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args(argv)
    import qdsl.runtime as rt

    rt.set_num_threads(1)
    print(f"load average before {load_average()}")
    print(f"{'C':>4s} {'HxW':>7s} {'s':>2s} {'NCHW tensors ms':>20s} {'NHWC tensors ms':>20s} {'NHWC/NCHW':>10s}")
    for c, hw, stride in SHAPES:
        rng = np.random.default_rng(0)
        x = rng.integers(0, 128, (1, c, hw, hw)).astype(np.uint8)  # 7-bit codes, as in MobileNetV2 a7
        graphs = {k: rt.CompiledGraph(_chain(np.random.default_rng(1), c, hw, stride, k == "nchw"))
                  for k in ("nchw", "nhwc")}
        times = {k: [] for k in graphs}
        for _ in range(args.rounds):
            for k, cg in graphs.items():
                _middle_ms(cg, x, 3)  # warm-up
                times[k].append(_middle_ms(cg, x, args.runs))
        ratio = [b / a for a, b in zip(times["nchw"], times["nhwc"])]
        a, b = span(times["nchw"], 1.0, ".3f"), span(times["nhwc"], 1.0, ".3f")
        print(f"{c:4d} {hw:4d}^2 {stride:2d} {a:>20s} {b:>20s} "
              f"{np.median(ratio):10.2f}")
    print(f"load average after {load_average()}")


if __name__ == "__main__":
    main()

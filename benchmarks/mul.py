"""MUL (squeeze-excitation's ``scale * x`` and a same-shape product) on the C++ runtime:
the scalar rule (path ref) against the AVX2 row kernel, at 1 and 2 threads, with torch's
float ``a * b`` for scale.  Interleaved variants, medians; prints the load average (another
process holding a core makes figures incomparable).

    PYTHONPATH=. python benchmarks/mul.py
"""

from __future__ import annotations

import numpy as np
import torch

import qdsl.runtime as rt
from qdsl.graph.ir import DType, IntegerGraph, Op, OpType, OutputStage, Tensor
from qdsl.graph.requant import make_rescale

from _timing import load_average, steady_median

CASES = {  # name: (shape of x0, shape of x1), batch 8
    "SE 96x14x14 * 96x1x1": ((-1, 96, 14, 14), (-1, 96, 1, 1)),
    "SE 576x7x7 * 576x1x1": ((-1, 576, 7, 7), (-1, 576, 1, 1)),
    "same 64x28x28": ((-1, 64, 28, 28), (-1, 64, 28, 28)),
}


def _graph(s0, s1) -> IntegerGraph:
    out = tuple(max(a, b) if i else a for i, (a, b) in enumerate(zip(s0, s1)))
    stage = OutputStage(make_rescale(0.013 * 0.0041 / 0.02, 1, single=True), 3, 0, 255)
    return IntegerGraph([Tensor("a", DType.U8, s0), Tensor("b", DType.U8, s1), Tensor("y", DType.U8, out)], ["a", "b"],
                        ["y"], [Op(OpType.MUL, "se", ["a", "b"], ["y"], {"in_zp": [5, 0], **stage.attrs()})]).validate()


def main() -> None:
    print(f"load average: {load_average()}")
    paths = [p for p in ("ref", "avx2") if p in rt.kernels.paths()["cpu"]]
    rng = np.random.default_rng(0)
    for name, (s0, s1) in CASES.items():
        cg = rt.CompiledGraph(_graph(s0, s1))
        a = rng.integers(0, 256, (8, *s0[1:])).astype(np.uint8)
        b = rng.integers(0, 256, (8, *s1[1:])).astype(np.uint8)
        ta, tb = torch.from_numpy(a).float(), torch.from_numpy(b).float()
        row = []
        for threads in (1, 2):
            rt.set_num_threads(threads)
            torch.set_num_threads(threads)
            times = {p: [] for p in paths} | {"torch f32": []}
            for _ in range(5):  # interleaved rounds
                for p in paths:
                    times[p].append(steady_median(lambda: cg.run(a, b, path=p), 20, 0.05))
                times["torch f32"].append(steady_median(lambda: ta * tb, 20, 0.05))
            row.append(", ".join(f"{k} {np.median(v) * 1e6:.0f} us" for k, v in times.items()))
        print(f"{name} (batch 8): 1 thread: {row[0]} | 2 threads: {row[1]}")
    print(f"load average: {load_average()}")


if __name__ == "__main__":
    main()

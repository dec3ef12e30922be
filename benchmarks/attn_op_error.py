"""Error of the integer SOFTMAX and LAYERNORM ops (docs/qgraph.md §4.4) against float and
against the fake-quant model (the float op on the dequantized input, then the output
quantizer), on random rows.  Prints figures; asserts nothing.

    python benchmarks/attn_op_error.py
"""

from __future__ import annotations

import numpy as np
import torch

from qdsl.export.lower_attn import layernorm_pending, softmax_pending
from qdsl.export.values import Builder, QVal, Target
from qdsl.graph.ir import DType, Rounding
from qdsl.graph.ops.layernorm import layernorm
from qdsl.graph.ops.softmax import softmax


def _quantize(x: np.ndarray, scale: float, zp: int, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(x / scale) + zp, lo, hi).astype(np.int64)


def _attrs(pending, t: Target) -> dict:
    b = Builder(single_rounding=True)
    pending.emit(b, t, -np.inf, np.inf)
    return b.ops[-1].attrs


def softmax_error(rows: int = 4096, n: int = 128, spread: float = 3.0, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, spread, (rows, n)).astype(np.float32)
    s_in = float(np.abs(x).max()) / 127
    q = _quantize(x, s_in, 0, -128, 127)
    for name, t in (("u8 scale 1/256", Target(1 / 256, 0, 0, 255, DType.U8, Rounding.HALF_EVEN, "out")),
                    ("u8 scale 1/255 (minmax of [0, 1])", Target(1 / 255, 0, 0, 255, DType.U8, Rounding.HALF_EVEN, "out")),
                    ("i8 scale 1/256 zp -128 (TFLite)", Target(1 / 256, -128, -128, 127, DType.I8, Rounding.HALF_EVEN, "out"))):
        v = QVal("x", s_in, 0, -128, 127, DType.I8, (-1, n))
        y = softmax(q, _attrs(softmax_pending("sm", v, -1, (-1, n)), t))
        deq = torch.from_numpy((q * s_in).astype(np.float32))
        fq_float = torch.softmax(deq, -1).numpy()
        fq = _quantize(fq_float, t.scale, t.zp, t.qmin, t.qmax)
        p_float = torch.softmax(torch.from_numpy(x), -1).numpy()
        real = (y - t.zp) * t.scale
        d = np.abs(y - fq)
        print(f"softmax {n} wide, input i8 (scale {s_in:.4f}), output {name}: vs fake-quant codes equal "
              f"{np.mean(d == 0):.5f}, max {d.max()} LSB; |p - p_float| max {np.abs(real - p_float).max():.5f} "
              f"mean {np.abs(real - p_float).mean():.2e} (fake-quant: max {np.abs((fq - t.zp) * t.scale - p_float).max():.5f})")


def layernorm_error(rows: int = 4096, n: int = 384, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.normal(0, 1, (rows, n)) * rng.uniform(0.2, 3, (rows, 1)) + rng.normal(0, 1, (rows, 1))).astype(np.float32)
    gamma = rng.uniform(0.3, 2.0, n)
    beta = rng.normal(0, 0.5, n)
    lo, hi = float(x.min()), float(x.max())
    s_in = (hi - lo) / 255
    zp = int(np.clip(round(-lo / s_in), 0, 255))
    q = _quantize(x, s_in, zp, 0, 255)
    ln = torch.nn.LayerNorm(n)
    with torch.no_grad():
        ln.weight.copy_(torch.from_numpy(gamma))
        ln.bias.copy_(torch.from_numpy(beta))
        fq_float = ln(torch.from_numpy(((q - zp) * s_in).astype(np.float32))).numpy()
        y_float = ln(torch.from_numpy(x)).numpy()
    o_lo, o_hi = float(fq_float.min()), float(fq_float.max())
    s_out = max(abs(o_lo), abs(o_hi)) / 127
    t = Target(s_out, 0, -128, 127, DType.I8, Rounding.HALF_EVEN, "out")
    v = QVal("x", s_in, zp, 0, 255, DType.U8, (-1, n))
    y = layernorm(q, _attrs(layernorm_pending("ln", v, (n,), gamma, beta, 1e-5, (-1, n)), t))
    fq = _quantize(fq_float, s_out, 0, -128, 127)
    d = np.abs(y - fq)
    real = y * s_out
    print(f"layernorm {n} wide, input u8 (scale {s_in:.4f}), output i8 (scale {s_out:.4f}): vs fake-quant codes "
          f"equal {np.mean(d == 0):.5f}, max {d.max()} LSB; vs float max {np.abs(real - y_float).max():.4f} "
          f"({np.abs(real - y_float).max() / s_out:.2f} LSB; fake-quant {np.abs(fq * s_out - y_float).max() / s_out:.2f} LSB)")


if __name__ == "__main__":
    for n in (16, 128, 512):
        softmax_error(n=n)
    for n in (32, 384, 768):
        layernorm_error(n=n)

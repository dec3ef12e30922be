"""Why exact int8 trails the saturating int8 peers on AVX2 CPUs without VNNI.

Compiles and runs ``benchmarks/native/int8_ceiling.cc``: three 4x16 register-tile
micro-kernels over K = 256 with every operand in L1, so each figure is the throughput of
the instruction mix alone, and each kernel's output is checked against the exact product:

* saturating: vpmaddubsw + vpmaddwd(1) + vpaddd, the u8 x s8 pattern of onnxruntime's
  MatMulInteger and fbgemm on AVX2 (3 vector ops per 32 MACs).  A pair of u8 x s8 products
  reaches 255 * 128 * 2 = 65280 and vpmaddubsw saturates it at 32767, so its outputs are
  wrong on full-range data;
* int16: vpmaddwd + vpaddd on operands widened to int16, the exact kernel qdsl runs for
  full-range int8 weights (4 ops per 32 MACs);
* sign: vpsignb + vpmaddubsw + vpmaddwd(1) + vpaddd on |a - 128| and sign(a - 128) * w,
  exact for narrow-range weights (4 ops per 32 MACs).

On Zen 3 the multiplies issue on two of the four vector pipes and an add consuming a
multiply's result does not always find a free pipe, so the 4-op patterns run at ~0.7x the
3-op one: that ratio bounds exact full-range int8 against the saturating peers on such
CPUs (qdsl's int4/int2 weights, and int8 weights within +-64, take the 3-op pattern
exactly; see csrc/kernels/x86/gemm_u8s8_6x16_avx2.cc).  No assertions.
Run: python benchmarks/int8_ceiling.py [--seconds 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "native" / "int8_ceiling.cc"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1.0, help="time per variant (best of 5 slices)")
    args = ap.parse_args()
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        sys.exit("int8_ceiling: no C++ compiler found")
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    if "avx2" not in flags:
        sys.exit("int8_ceiling: this CPU has no AVX2")
    vnni = {"avx_vnni", "avx512_vnni"} & set(flags)
    print("CPU VNNI:", "yes (the peers are exact and faster there)" if vnni else "no")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "int8_ceiling"
        subprocess.run([cxx, "-O2", "-std=c++17", "-mavx2", str(SOURCE), "-o", str(exe)], check=True)
        subprocess.run([str(exe), str(args.seconds)], check=True)


if __name__ == "__main__":
    main()

"""Losses of lean QAT (``qdsl.qat.LeanAdam``) vs normal QAT after N steps, at full size.

Model: ``qdsl.zoo.models.mlp`` with sizes ``(W, W, W, W, 10)`` (W = 4096: 50.4M parameters,
the model of ``benchmarks/qat_lean_rss.py``), 4-bit per-channel symmetric minmax weights,
8-bit activations, int32 bias; batch 64; a learnable task: the labels of a fixed random
linear teacher (``argmax(x @ T)``, x ~ N(0, 1)).  The teacher and a held-out set of 1024
inputs are the same for every run; ``seed`` sets the model's initial weights and the
training batches (calibration uses the first one).

Variants (each in its own subprocess, one thread; ``--jobs`` runs that many at once):

* ``qat``        normal qdsl QAT: ``qdsl.apply`` + calibrate + ``torch.optim.Adam``, seed 0;
* ``qat_seed1``  the same with seed 1: the seed-to-seed spread the lean figures are judged by;
* ``lean``       ``LeanAdam`` defaults (bf16 gradients, bf16 master with stochastic rounding,
  8-bit moments, tracked scale), seed 0;
* ``lean_m32``   ``LeanAdam(state_bits=32)`` (float32 moments), ``lean_fp32master``
  ``LeanAdam(master="fp32")``, ``lean_exact`` (fp32 master, fp32 gradients, fp32 moments: normal
  QAT's update) - to find which reduction costs loss, if any.

Printed: the mean of the last 10 training losses and the held-out loss (model in eval mode,
fake-quantized), each against ``qat``'s.

Measured (shared 2-core machine at load 13-17, so the s/step are not comparable; Adam lr 1e-4):

* 1024 wide (3.2M parameters), 200 steps, mean of the last 10 training losses / held-out
  loss, vs qat: qat 2.0156 / 1.9990; qat_seed1 -2.01% / -3.81%; lean -0.26% / -0.21%;
  lean_m32 -0.03% / -0.20%; lean_fp32master +0.02% / -0.33%; lean_exact +0.00% / +0.00%
  (bit for bit).  LeanAdam's defaults are within 1% of normal QAT on the same seed, ~10x
  closer than a second seed of normal QAT; no single reduction stands out.
* 4096 wide (50.4M), 200 steps: qat 1.9224 / 1.8955; lean +0.13% / +0.35% (within 1%).
  Along the way (progress lines, mean of the 10 losses before step N), lean vs qat: step 20
  -0.03%, 40 -0.12%, 60 -0.22%, 80 -0.15%, 100 -0.13%; qat_seed1 (stopped to free the CPU
  of the loaded machine) was +0.72% at step 20.

    python benchmarks/qat_lean_loss.py --width 4096 --steps 200 --jobs 3
    python benchmarks/qat_lean_loss.py --width 512 --steps 200 --variants qat,qat_seed1,lean,lean_exact
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's qdsl, not an installed one

SPEC = """version 1
defaults {
  weight = int(bits=4, signed, narrow, symmetric, per_channel, observer=minmax)
  input = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
"""
VARIANTS = ("qat", "qat_seed1", "lean", "lean_m32", "lean_fp32master", "lean_exact")
# variant -> (seed, LeanAdam keywords or None for normal QAT)
RUNS = {
    "qat": (0, None),
    "qat_seed1": (1, None),
    "lean": (0, {}),
    "lean_m32": (0, {"state_bits": 32}),
    "lean_fp32master": (0, {"master": "fp32"}),
    "lean_exact": (0, {"master": "fp32", "grad_dtype": "float32", "state_bits": 32}),
}


def _child(args) -> None:
    import torch
    import torch.nn.functional as F
    import qdsl
    from qdsl.parse import parse_text
    from qdsl.qat import LeanAdam
    from qdsl.zoo.models import mlp

    torch.set_num_threads(1)
    seed, lean = RUNS[args.variant]
    w = args.width
    fixed = torch.Generator().manual_seed(1234)
    teacher = torch.randn(w, 10, generator=fixed)
    held_x = torch.randn(1024, w, generator=fixed)
    held_y = (held_x @ teacher).argmax(1)
    g = torch.Generator().manual_seed(seed)

    def batch():
        x = torch.randn(args.batch, w, generator=g)
        return x, (x @ teacher).argmax(1)

    model = mlp(seed=seed, sizes=(w, w, w, w, 10))
    qdsl.apply(model, parse_text(SPEC, "w4.qspec"), materialize=lean is None)
    x_cal, _ = batch()
    if lean is None:
        qdsl.calibrate(model, [x_cal])
        from qdsl.quantizers.proxy_grad import install
        install(model)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    else:
        kw = dict(lean)
        if "grad_dtype" in kw:
            kw["grad_dtype"] = getattr(torch, kw["grad_dtype"])
        opt = LeanAdam(model, lr=args.lr, **kw)
        qdsl.calibrate(model, [x_cal])
    model.train()
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        x, y = batch()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if len(losses) % 10 == 0:  # progress of a long run, on stderr
            print(f"{args.variant} step {len(losses)} loss {sum(losses[-10:]) / 10:.4f} "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        held = F.cross_entropy(model(held_x), held_y).item()
    print(json.dumps({"variant": args.variant, "losses": losses, "held_loss": held, "seconds": seconds}))


def _run(variant: str, args) -> dict:
    cmd = [sys.executable, __file__, "--variant", variant, "--width", str(args.width), "--steps", str(args.steps),
           "--lr", str(args.lr), "--batch", str(args.batch)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if res.returncode:
        sys.stderr.write(res.stderr)
        raise SystemExit(f"variant {variant} failed")
    line = res.stdout.strip().splitlines()[-1]
    if args.verbose:
        r = json.loads(line)
        print(json.dumps({"variant": variant, "held_loss": r["held_loss"], "last10": sum(r["losses"][-10:]) / 10,
                          "s/step": r["seconds"] / args.steps}), flush=True)
    return json.loads(line)


def _table(rows: dict, steps: int) -> None:
    ref = rows["qat"]
    rlast = sum(ref["losses"][-10:]) / 10
    print(f"{'variant':<17}{'mean last 10':>13}{'vs qat':>9}{'held-out':>10}{'vs qat':>9}{'s/step':>8}")
    for v, r in rows.items():
        last = sum(r["losses"][-10:]) / 10
        print(f"{v:<17}{last:>13.4f}{last / rlast - 1:>+9.2%}{r['held_loss']:>10.4f}"
              f"{r['held_loss'] / ref['held_loss'] - 1:>+9.2%}{r['seconds'] / steps:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--variants", default="qat,qat_seed1,lean")
    ap.add_argument("--jobs", type=int, default=1, help="variants run at once (each one thread)")
    ap.add_argument("--verbose", action="store_true", help="print each variant's figures as it ends")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="the table from saved output lines of --variant runs")
    args = ap.parse_args()
    if args.variant:
        _child(args)
        return
    if args.table:
        rows = [json.loads(open(f).read().strip().splitlines()[-1]) for f in args.table]
        _table({r["variant"]: r for r in rows}, args.steps)
        return
    variants = args.variants.split(",")
    if "qat" not in variants:
        variants.insert(0, "qat")
    print(f"load average: {os.getloadavg()}", flush=True)
    n = 3 * args.width * args.width + 10 * args.width + 3 * args.width + 10
    print(f"mlp {args.width}x4 ({n / 1e6:.1f}M parameters), {args.steps} steps, batch {args.batch}, "
          f"Adam lr {args.lr}, teacher labels, 1 thread per run", flush=True)
    with ThreadPoolExecutor(args.jobs) as ex:
        rows = dict(zip(variants, ex.map(lambda v: _run(v, args), variants)))
    _table(rows, args.steps)
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()

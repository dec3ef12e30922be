"""Peak process memory (RSS) of lean QAT (``qdsl.qat.LeanAdam``) vs fp32 Adam and normal QAT.

Each variant runs in its own subprocess (``--variant NAME``), which reports its peak RSS
(``VmHWM`` of ``/proc/self/status``, whole process: python + torch + qdsl included) at
three points: after the imports (the baseline), after setup (model built, ``qdsl.apply``,
calibration, optimizer), and after the training steps.  ``train MB`` is the peak of the
training steps alone: the setup's high-water mark is reset first (``/proc/self/clear_refs``,
value 5), so it shows what training itself needs.

Model: ``qdsl.zoo.models.mlp`` with sizes ``(W, W, W, W, 10)`` (W = 4096: 50.4M parameters),
batch 64, 4-bit per-channel symmetric minmax weights, 8-bit activations, int32 bias.

Variants:

* ``fp32_adam``   the float model, ``torch.optim.Adam`` (no qdsl.apply);
* ``qat``         normal qdsl QAT: apply + calibrate + ``torch.optim.Adam``;
* ``lean_opt``    ``qdsl.qat.LeanOptimizer`` (packed codes on the module, fp32 masters in Adam);
* ``lean_bf16``   ``LeanAdam``: bf16 gradients, bf16 master, 8-bit moments (the defaults), on a
  model applied with ``materialize=False`` (as every ``lean_*`` variant but ``lean_opt``);
* ``lean_bf16_eager``  the same after a plain ``qdsl.apply`` (which computes every layer's
  fake-quantized weight at once: one more fp32 copy of the weights at setup);
* ``lean_none``   ``LeanAdam(master="none")``: codes only, stochastic rounding;
* ``lean_fp32``   ``LeanAdam(master="fp32", grad_dtype=float32, state_bits=32)``.

``--loss-steps N`` also trains every QAT variant N steps on a learnable task (a fixed random
teacher's labels, sizes ``(L, L, L, L, 10)``, L = ``--loss-width``) and prints the loss on a
held-out batch against normal QAT's.

    python benchmarks/qat_lean_rss.py                       # RSS, 20 steps, W = 4096
    python benchmarks/qat_lean_rss.py --loss-steps 200 --loss-width 1024 --skip-rss
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from qat_lean_loss import SPEC  # the same 4-bit per-channel MLP spec
from qat_lean_loss import _table as _loss_table  # (the loss comparison lives there)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's qdsl, not an installed one

VARIANTS = ("fp32_adam", "lean_bf16", "lean_bf16_eager", "lean_none", "qat", "lean_fp32", "lean_opt")
LEAN = {"lean_bf16": {}, "lean_none": {"master": "none"},
        "lean_fp32": {"master": "fp32", "grad_dtype": "float32", "state_bits": 32}}


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _model(width: int, loss: bool):
    import torch
    from torch import nn
    from qdsl.zoo.models import mlp

    if loss:
        return mlp(seed=0, sizes=(width, width, width, width, 10))
    # the same layers, initialised in place (zoo's seeded init draws each weight into a
    # temporary first: two extra copies of the largest weight at setup)
    torch.manual_seed(0)
    layers: list = [nn.Flatten()]
    for i, (a, b) in enumerate(zip((width,) * 4, (width,) * 3 + (10,))):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < 3 else [])
    return nn.Sequential(*layers)


def _build(variant: str, width: int, lr: float, x_cal, loss: bool):
    """The model and an object with zero_grad()/step() for ``variant``."""
    import torch
    import qdsl
    from qdsl.parse import parse_text
    from qdsl.qat import LeanAdam, LeanOptimizer

    model = _model(width, loss)
    if variant == "fp32_adam":
        return model.train(), torch.optim.Adam(model.parameters(), lr=lr)
    # lean training takes the weights out of the modules before any forward: apply need not
    # compute the fake-quantized copies (materialize=False); ``_eager`` shows what they cost
    lean = variant.startswith("lean_") and variant != "lean_opt" and not variant.endswith("_eager")
    qdsl.apply(model, parse_text(SPEC, "w4.qspec"), materialize=not lean)
    if variant in ("qat", "lean_opt"):
        qdsl.calibrate(model, [x_cal])
        model.train()
        if variant == "lean_opt":
            return model, LeanOptimizer(model, torch.optim.Adam, lr=lr)
        from qdsl.quantizers.proxy_grad import install
        install(model)
        return model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    kw = dict(LEAN[variant.removesuffix("_eager")])
    if "grad_dtype" in kw:
        kw["grad_dtype"] = getattr(torch, kw["grad_dtype"])
    # lean form first, then calibrate: calibration in lean form never materializes the
    # fake-quantized fp32 weights (it observes the float network, as without lean form)
    opt = LeanAdam(model, lr=lr, **kw)
    qdsl.calibrate(model, [x_cal])
    return model.train(), opt


def _child(args) -> None:
    import torch
    import torch.nn.functional as F
    import qdsl  # noqa: F401  (the baseline includes qdsl, as every variant imports it)
    import qdsl.qat  # noqa: F401

    torch.set_num_threads(1)
    out = {"variant": args.variant, "base_mb": _peak_mb()}
    if args.variant == "baseline":
        print(json.dumps(out))
        return
    g = torch.Generator().manual_seed(0)
    if args.loss_steps:
        width, steps = args.loss_width, args.loss_steps
        teacher = torch.randn(width, 10, generator=g)

        def batch(n):
            x = torch.randn(n, width, generator=g)
            return x, (x @ teacher).argmax(1)
    else:
        width, steps = args.width, args.steps

        def batch(n):
            return torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g)
    x_cal, _ = batch(args.batch)
    held_x, held_y = batch(1024)
    model, opt = _build(args.variant, width, args.lr, x_cal, bool(args.loss_steps))
    out["setup_mb"] = _peak_mb()
    out["reset"] = _reset_peak()
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = batch(args.batch)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["seconds"] = time.perf_counter() - t0
    out["train_mb"] = _peak_mb()
    out["losses"] = losses
    model.eval()
    with torch.no_grad():
        out["held_loss"] = F.cross_entropy(model(held_x), held_y).item()
    print(json.dumps(out))


def _run(variant: str, args, extra: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--variant", variant, "--lr", str(args.lr), "--batch", str(args.batch)] + extra
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode:
        sys.stderr.write(res.stderr)
        raise SystemExit(f"variant {variant} failed")
    row = json.loads(res.stdout.strip().splitlines()[-1])
    if args.verbose:  # the raw figures as each variant ends (a long run can be read while it goes)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    return row


def _rss_table(rows: dict, steps: int) -> None:
    ref = rows.get("fp32_adam")
    nan = float("nan")
    rp = max(ref["setup_mb"], ref["train_mb"]) if ref else nan
    print(f"{'variant':<17}{'peak MB':>8}{'ratio':>7}{'setup MB':>9}{'train MB':>9}{'ratio':>7}"
          f"{'above base':>11}{'ratio':>7}{'s/step':>8}")
    for v, r in rows.items():
        peak = max(r["setup_mb"], r["train_mb"])
        print(f"{v:<17}{peak:>8.0f}{peak / rp:>7.2f}{r['setup_mb']:>9.0f}{r['train_mb']:>9.0f}"
              f"{r['train_mb'] / ref['train_mb'] if ref else nan:>7.2f}{peak - r['base_mb']:>11.0f}"
              f"{(peak - r['base_mb']) / (rp - ref['base_mb']) if ref else nan:>7.2f}{r['seconds'] / steps:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--loss-steps", type=int, default=0)
    ap.add_argument("--loss-width", type=int, default=1024)
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="print each variant's figures as it ends")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--table", nargs="+", metavar="JSON",
                    help="print the tables from the output lines of --variant runs made by hand "
                         "(e.g. variants run side by side on a busy machine); --steps/--loss-steps as they ran")
    args = ap.parse_args()
    if args.variant:
        _child(args)
        return
    if args.table:
        rows = [json.loads(open(f).read().strip().splitlines()[-1]) for f in args.table]
        rss = {r["variant"]: r for r in rows if "held_loss" in r and not args.loss_steps}
        if rss:
            _rss_table(rss, args.steps)
        if args.loss_steps:
            _loss_table({r["variant"]: r for r in rows}, args.loss_steps)
        return
    print(f"load average: {os.getloadavg()}", flush=True)
    variants = args.variants.split(",")
    if not args.skip_rss:
        base = _run("baseline", args, [])["base_mb"]
        n = 3 * args.width * args.width + 10 * args.width + 3 * args.width + 10
        print(f"RSS: mlp {args.width}x4 ({n / 1e6:.1f}M parameters), {args.steps} steps, batch {args.batch}, "
              f"1 thread; baseline (python + torch + qdsl imported) {base:.0f} MB", flush=True)
        rows = {v: _run(v, args, ["--width", str(args.width), "--steps", str(args.steps)]) for v in variants}
        _rss_table(rows, args.steps)
    if args.loss_steps:
        print(f"loss: mlp {args.loss_width}x4, {args.loss_steps} steps, lr {args.lr}, batch {args.batch}, teacher labels")
        rows = {v: _run(v, args, ["--loss-steps", str(args.loss_steps), "--loss-width", str(args.loss_width)])
                for v in variants if v != "fp32_adam"}
        _loss_table(rows, args.loss_steps)


if __name__ == "__main__":
    main()

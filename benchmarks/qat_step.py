"""QAT step time relative to float: qdsl (int8, w4a8-pot, binary) vs torch.ao eager QAT.

One training step = forward + cross-entropy + backward + SGD (momentum 0.9) on
``ConvBnReluNet`` (3×32×32 input, batch 64) with 2 threads.  Every configuration is
built in this process and timed round-robin (one step of each per round), so load
changes on a shared machine hit all of them alike; the figure is the median over rounds.

* ``float``      the unmodified network in train mode
* ``qdsl int8``  ``specs/int8-default.qspec`` (w8 per-channel, a8 histogram, BN folded)
* ``qdsl w4a8-pot`` ``specs/pot-asic.qspec`` (4-bit PoT-scaled weights, 8-bit PoT acts)
* ``qdsl binary`` ``specs/xnor-binary.qspec`` (XNOR-Net weights/activations)
* ``torch.ao``   conv-bn-relu fused with ``fuse_modules_qat`` then ``prepare_qat`` with
  the default qconfig (``get_default_qat_qconfig``), the peer
* ``qdsl int8 compiled``  the int8 model under ``torch.compile`` (``--backend``,
  default ``aot_eager``: inductor needs a C++ compiler run per graph), compile time
  excluded (reported separately)

Target (issue 4): qdsl eager QAT step ≤ 1.4× float.

Suite ``w4-auto`` (issue 24): the simplest 4-bit spec, observer left to ``auto`` (below 8
bits the bit-aware range search, carried as a per-channel clip ratio during QAT),
``defaults { weight = int(bits=4, signed, narrow, symmetric, per_channel) }``, trained
with Adam at 1 thread, batch 64, on ``ConvBnReluNet`` (3×32×32) and on an MLP of four
2048×2048 Linears (+ a 2048×10 head).  Per model, float and the qdsl variants are timed
round-robin in this process (apply + calibrate on one batch, then train):

* ``qdsl w4 auto``              plain QAT: ``import qdsl.qat``, apply, calibrate, train
* ``qdsl w4 auto, prepare_qat`` the same after ``qdsl.qat.prepare_qat(model)``
* ``qdsl w4 auto, LeanOptimizer`` packed weights, masters in the optimizer
* ``qdsl w4 minmax``            ``observer=minmax`` (no search at all), for reference

It prints the median, the range (min-max) and the ratio to float's median, and the load
average.  Target (issue 24): ``qdsl w4 auto`` ≤ 1.5× float on both models.

    python benchmarks/qat_step.py [--suite specs|w4-auto|all] [--rounds 15] [--no-compile]
                                  [--backend inductor]
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from _timing import load_average  # benchmarks/ is the script's own directory

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's qdsl, not an installed one
SPECS = ROOT / "specs"


def _step_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, forward=None):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    fwd = forward if forward is not None else model
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(fwd(x), y)
        loss.backward()
        opt.step()

    return step


def build_qdsl(base: nn.Module, spec: str, calib: torch.Tensor) -> nn.Module:
    import qdsl
    import qdsl.qat  # noqa: F401  (QAT gradients)

    model = copy.deepcopy(base)
    qdsl.apply(model, str(SPECS / spec))
    model.eval()
    qdsl.calibrate(model, [calib[i : i + 32] for i in range(0, len(calib), 32)])
    qdsl.qat.prepare_qat(model)  # BN-folded layers train with live BN statistics
    return model.train()


def build_torch_ao(base: nn.Module) -> nn.Module:
    from torch.ao.quantization import fuse_modules_qat, get_default_qat_qconfig, prepare_qat

    model = copy.deepcopy(base).train()
    fuse_modules_qat(model, [["features.0", "features.1", "features.2"], ["features.3", "features.4", "features.5"],
                             ["features.6", "features.7", "features.8"]], inplace=True)
    model.qconfig = get_default_qat_qconfig("x86")
    return prepare_qat(model, inplace=True)


W4_AUTO = "version 1\ndefaults {{ weight = int(bits=4, signed, narrow, symmetric, per_channel{obs}) }}\n"


def _adam_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, opt=None):
    if opt is None:
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def _w4_qdsl(base: nn.Module, calib: torch.Tensor, observer: str = "", prepare: bool = False) -> nn.Module:
    import qdsl
    import qdsl.qat
    from qdsl.parse import parse_text

    model = copy.deepcopy(base)
    qdsl.apply(model, parse_text(W4_AUTO.format(obs=observer), "w4.qspec"))
    qdsl.calibrate(model, [calib], progress=False)
    if prepare:
        qdsl.qat.prepare_qat(model)
    return model.train()


def _time_round_robin(steps: dict, rounds: int) -> dict[str, list[float]]:
    for step in steps.values():  # warm-up (allocator, oneDNN primitives, lazy init)
        step()
        step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for label, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - t0)
    return times


def _searches(model: nn.Module) -> int:
    from qdsl.patch.handle import get_handle

    return sum(getattr(q.observer, "searches", 0) for q in get_handle(model).container.quantizers.values())


def w4_auto_suite(rounds: int, batch: int) -> None:
    """Issue 24: default-observer 4-bit QAT vs float, Adam, 1 thread (see the docstring)."""
    import qdsl.qat
    from qdsl.zoo.models import conv_bn_relu_net, mlp

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    cases = {
        "ConvBnReluNet 3x32x32": (conv_bn_relu_net(seed=0), torch.randn(batch, 3, 32, 32, generator=g)),
        "MLP 4x Linear(2048, 2048)": (mlp(seed=0, sizes=(2048, 2048, 2048, 2048, 2048, 10)),
                                      torch.randn(batch, 2048, generator=g)),
    }
    for name, (base, x) in cases.items():
        y = torch.randint(0, 10, (batch,), generator=g)
        plain = _w4_qdsl(base, x)
        steps = {"float": _adam_step(copy.deepcopy(base).train(), x, y),
                 "qdsl w4 auto": _adam_step(plain, x, y),
                 "qdsl w4 auto, prepare_qat": _adam_step(_w4_qdsl(base, x, prepare=True), x, y)}
        lean_model = _w4_qdsl(base, x)
        steps["qdsl w4 auto, LeanOptimizer"] = _adam_step(
            lean_model, x, y, opt=qdsl.qat.LeanOptimizer(lean_model, torch.optim.Adam, lr=1e-4))
        steps["qdsl w4 minmax"] = _adam_step(_w4_qdsl(base, x, observer=", observer=minmax"), x, y)
        searches0 = _searches(plain)
        times = _time_round_robin(steps, rounds)
        ref = statistics.median(times["float"])
        print(f"QAT step (fwd+bwd+Adam), {name}, batch {batch}, 1 thread, median of {rounds} rounds "
              f"(range searches during the {rounds + 2} 'qdsl w4 auto' steps: {_searches(plain) - searches0})")
        for label, ts in times.items():
            med = statistics.median(ts)
            print(f"  {label:<30s} {med * 1e3:9.1f} ms  (range {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})"
                  f"   {med / ref:5.2f}x float")
        print(f"  load average: {load_average()}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=("specs", "w4-auto", "all"), default="all")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="threads of the specs suite (w4-auto: 1)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--backend", default="aot_eager")
    args = ap.parse_args(argv)
    # torch.ao's deprecation notices and dynamo's graph-break reports are not results
    warnings.filterwarnings("ignore")
    torch._logging.set_logs(dynamo=logging.ERROR)
    if args.suite in ("w4-auto", "all"):
        w4_auto_suite(args.rounds, args.batch)
    if args.suite == "w4-auto":
        return 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from qdsl.zoo.models import conv_bn_relu_net

    base = conv_bn_relu_net(seed=0).train()
    x = torch.randn(args.batch, 3, 32, 32)
    y = torch.randint(0, 10, (args.batch,))
    calib = torch.randn(128, 3, 32, 32)

    steps: dict[str, object] = {"float": _step_fn(copy.deepcopy(base).train(), x, y)}
    for label, spec in (("qdsl int8", "int8-default.qspec"), ("qdsl w4a8-pot", "pot-asic.qspec"),
                        ("qdsl binary", "xnor-binary.qspec")):
        steps[label] = _step_fn(build_qdsl(base, spec, calib), x, y)
    steps["torch.ao eager QAT"] = _step_fn(build_torch_ao(base), x, y)
    compile_s = None
    if not args.no_compile:
        m = build_qdsl(base, "int8-default.qspec", calib)
        compiled = torch.compile(m, backend=args.backend)
        step = _step_fn(m, x, y, forward=compiled)
        t0 = time.perf_counter()
        step()  # compiles forward and backward
        compile_s = time.perf_counter() - t0
        steps[f"qdsl int8 compiled ({args.backend})"] = step

    times = _time_round_robin(steps, args.rounds)

    ref = statistics.median(times["float"])
    print(f"QAT step (fwd+bwd+SGD), ConvBnReluNet 3x32x32, batch {args.batch}, {args.threads} threads, "
          f"median of {args.rounds} rounds")
    for label, ts in times.items():
        med = statistics.median(ts)
        print(f"  {label:<34s} {med * 1e3:8.1f} ms   {med / ref:5.2f}x float")
    if compile_s is not None:
        print(f"  (torch.compile first step incl. compilation: {compile_s:.1f} s)")
    print(f"  load average: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Evaluation after ``freeze``: where the time goes, per spec.

A frozen model computes what the integer graph computes where float would differ: binary64
XNOR/ternary sums (qdsl.patch.layer, in binary32 on codes without autograd:
qdsl.patch.unit_sums), the graph's LINEAR output stage, LAYERNORM and SOFTMAX
(qdsl.patch.int_sim, qdsl.patch.residual_sim).  This script times, round-robin in one process
(1 thread, process CPU time, medians), the float model and the frozen one (for the unit-code
specs in each ``QDSL_FROZEN_SUMS`` mode: ``codes``, the default, ``certified`` and
``binary64``), and
prints the CPU time spent per forward in each simulation function (cumulative: a function
called from another counts in both).  Models as in benchmarks/qat_compile.py (``cnn``,
``transformer``, ``minilm``).

    python benchmarks/frozen_eval.py [--models cnn,transformer] [--specs xnor-binary,transformer-int8]
                                     [--rounds 9]
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import statistics
import time
import warnings

import torch
from _timing import load_average  # noqa: E402  (benchmarks/ is the script's own directory)
from qat_compile import (BUNDLED, ENCODER_SPECS, _base, _call, _data, _encoder, _encoder_data, _minilm, _qdsl,
                         _report, _round_robin, _stepper)

import qdsl
import qdsl.graph.ops.layernorm as ln_op
import qdsl.patch.attention as attention
import qdsl.patch.int_sim as int_sim
import qdsl.patch.residual_sim as residual_sim
from qdsl.patch.unit_sums import MODE_ENV

SIMULATIONS = [(residual_sim, "exact_accumulator"), (residual_sim, "rescale_codes"), (residual_sim, "linear_codes"),
               (residual_sim, "residual_terms"), (residual_sim, "wide_codes"), (int_sim, "simulated_layernorm"),
               (int_sim, "simulated_probs"), (int_sim, "layernorm"), (int_sim, "softmax_kept")]
"""(module, function) pairs timed; each is also rebound where int_sim, residual_sim or attention imported it."""


def _instrument(spent: dict) -> None:
    for mod, name in SIMULATIONS:
        f = getattr(mod, name)

        def timed(*a, _f=f, _name=name, **k):
            c = time.process_time()
            try:
                return _f(*a, **k)
            finally:
                spent[_name] += time.process_time() - c

        for m in (mod, int_sim, residual_sim, ln_op, attention):
            if getattr(m, name, None) is f:
                setattr(m, name, timed)


def _model(name: str):
    if name == "cnn":
        (x, y), base = _data(64), _base().train()
        return base, x, y
    if name == "transformer":
        (x, y), base = _encoder_data(), _encoder()
        return base, x, y
    found = _minilm()
    return (None, None, None) if found is None else (found[0], found[1], None)


def run(model: str, specs: list[str], rounds: int, spent: dict) -> None:
    base, x, y = _model(model)
    if base is None:
        return
    for spec in specs:
        print(f"\n== {model}, {spec} after freeze (eval, no_grad, 1 thread); load {load_average()}")
        q = _qdsl(base, spec, x)
        _stepper(q, q, x, y)()
        fz = copy.deepcopy(q).eval()
        qdsl.freeze(fz)
        unit = any(getattr(p, "unit_sums", None) is not None for p in qdsl.patch.get_handle(fz).layers.values())

        def ev(m, mode="certified"):
            def go():
                os.environ[MODE_ENV] = mode
                with torch.no_grad():
                    _call(m, x)
            return go

        fns = {"float": ev(copy.deepcopy(base).eval()), "after freeze": ev(fz)}
        if unit:
            fns["after freeze, codes"] = ev(fz, "codes")
            fns["after freeze, binary64"] = ev(fz, "binary64")
        spent.clear()
        times = _round_robin(fns, rounds)
        os.environ.pop(MODE_ENV, None)
        _report(times, "float")
        calls = rounds + 2  # _round_robin's two warm-up calls
        for name, t in sorted(spent.items(), key=lambda kv: -kv[1]):
            if t > 0:
                print(f"    {name:<22} {t / calls * 1e3:7.1f} ms per frozen forward (cumulative)")
    print(f"  load {load_average()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="cnn,transformer")
    ap.add_argument("--specs", default="xnor-binary,w4a8-per-channel," + ",".join(ENCODER_SPECS))
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    want = args.specs.split(",")
    spent: dict = collections.defaultdict(float)
    _instrument(spent)  # once: a second wrapping would count every call twice
    for model in args.models.split(","):
        default = BUNDLED if model == "cnn" else ENCODER_SPECS
        run(model, [s for s in want if s in default], args.rounds, spent)


if __name__ == "__main__":
    main()

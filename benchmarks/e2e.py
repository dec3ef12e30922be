"""End-to-end latency of torchvision-shaped CNNs at 3x224x224 (qdsl.zoo: ResNet-18, ResNet-50,
MobileNetV2; seeded, untrained weights): qdsl's C++ runtime vs torch fp32 eager vs torch.ao
x86 int8 vs onnxruntime QDQ int8, batch 1 and 8, 1 and 2 threads.

Contenders, all float32 images in and float32 logits out, all calibrated on the same
generated images (seeded normal noise):
  torch fp32     the eager model.
  torch.ao x86   FX graph mode PTQ, ``get_default_qconfig_mapping("x86")``: per-channel int8
                 weights, uint8 activations with ``reduce_range`` (7-bit codes).
  ort u8s8       ``quantize_static`` QDQ after ``quant_pre_process``: per-channel S8 weights,
                 U8 activations, MinMax; ORT_ENABLE_ALL, ``intra_op_num_threads`` = threads.
                 Inexact on AVX2 without VNNI (saturating int16 pair sums), see the check.
  ort u8s8 a7    the same model with its activation scales and zero points moved to 7 bits
                 (_ort.seven_bit_overrides), so the u8s8 kernels are exact: torch.ao's setting.
  ort u8u8       the same recipe with U8 weights: onnxruntime's exact 8-bit path.
  qdsl a8        specs/int8-default.qspec (apply, calibrate, freeze, export), run by
                 ``qdsl.runtime.CompiledGraph``: exact 8-bit.
  qdsl a7        the same with ``input.bits=7 output.bits=7`` (7-bit activations).
Like with like: qdsl a8 / ort u8u8 (exact 8-bit); qdsl a7 / ort u8s8 a7 and qdsl a7 /
torch.ao (exact, 7-bit activations).  qdsl a8 / ort u8s8 is the issue's first figure
(exact vs inexact).

Timing (benchmarks/_timing.py): each contender in its own steady state (warm-up, then
``--reps`` calls, median), the contenders taken in turn round after round (A, B, C, A, B,
C); a figure is the median over ``--rounds`` rounds with the range over rounds, a ratio is
taken round by round.  The load average is printed before and after each configuration.

    python benchmarks/e2e.py --quick                 # ResNet-18 and MobileNetV2, batch 1, 1 thread
    python benchmarks/e2e.py [--models resnet18,mobilenet_v2,resnet50] [--batches 1,8]
                             [--threads 1,2] [--rounds 5] [--reps 3] [--systems ...]
"""

from __future__ import annotations

import os

# numpy's OpenBLAS is never measured here, but its idle threads busy-wait after each call
# (data preparation) and take a core from whatever is timed next.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import copy
import logging
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's qdsl, not an installed one

import _ort  # noqa: E402
from _timing import add_timing_args, interleaved, load_average, span, timing_args  # noqa: E402

SYSTEMS = ["torch fp32", "torch.ao x86", "ort u8s8", "ort u8s8 a7", "ort u8u8", "qdsl a8", "qdsl a7"]
ORT_SYSTEMS = {"ort u8s8": "u8s8", "ort u8s8 a7": "u8s8a7", "ort u8u8": "u8u8"}
# (numerator, denominator, why): the ratios printed per configuration, like with like first.
RATIOS = [("qdsl a8", "ort u8u8", "exact 8-bit"), ("qdsl a7", "ort u8s8 a7", "exact, 7-bit acts"),
          ("qdsl a7", "torch.ao x86", "exact, 7-bit acts"), ("qdsl a8", "ort u8s8", "exact vs inexact")]
# the peers found exact on this CPU by exactness(): with VNNI (AVX512-VNNI, AVX-VNNI) onnxruntime's
# u8s8 path is exact on 8-bit data too, and the last ratio compares exact with exact
EXACT: set = set()


def factories(small: bool) -> dict:
    from qdsl.zoo.mobilenet import mobilenet_v2
    from qdsl.zoo.resnet import resnet18, resnet50

    if small:  # the test widths: the same graphs at a fraction of the cost (smoke runs)
        return {"resnet18": lambda: resnet18(width=8, num_classes=10),
                "resnet50": lambda: resnet50(width=8, num_classes=10),
                "mobilenet_v2": lambda: mobilenet_v2(width_mult=0.25, num_classes=10)}
    return {"resnet18": resnet18, "resnet50": resnet50, "mobilenet_v2": mobilenet_v2}


def export_qdsl(model, calib: list, seven_bit: bool):
    """specs/int8-default.qspec (7-bit: activations overridden), calibrated on `calib`,
    frozen and exported: the IntegerGraph qdsl's contenders run."""
    import qdsl

    qmodel = copy.deepcopy(model)
    overrides = ["input.bits=7", "output.bits=7"] if seven_bit else []
    qdsl.apply(qmodel, qdsl.load_spec(str(ROOT / "specs" / "int8-default.qspec")), overrides=overrides)
    qdsl.calibrate(qmodel, calib, progress=False)
    qdsl.freeze(qmodel)
    return qdsl.export(qmodel, calib[0][:2])


def build_qdsl(model, calib: list, seven_bit: bool, graph=None):
    """The CompiledGraph of `export_qdsl` (or of `graph`, an IntegerGraph or its bytes, when
    given) and how many int convs/linears run the exact ``vpmaddubsw`` kernel on AVX2
    without VNNI (CompiledGraph.plan)."""
    import qdsl.runtime as rt

    compiled = rt.CompiledGraph(export_qdsl(model, calib, seven_bit) if graph is None else graph)
    plan = [p for p in compiled.plan() if "maddubs_steps" in p]
    return compiled, f"{sum(p['maddubs_steps'] > 0 for p in plan)}/{len(plan)} int GEMMs on the vpmaddubsw kernel"


def build_torchao(model, calib: list):
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.backends.quantized.engine = "x86"
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (calib[0][:1],))
    with torch.no_grad():
        for x in calib:
            prepared(x)
    return convert_fx(prepared)


def build_ort(model, calib: list, workdir: str, wanted: set) -> dict[str, str]:
    """QDQ models for the wanted ORT systems: torch.onnx export (TorchScript exporter,
    dynamic batch), ``quant_pre_process`` (without it the exported Clip constants keep most
    convs in float), ``quantize_static``.  Returns system -> model path."""
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, \
        quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    raw, fp = os.path.join(workdir, "raw.onnx"), os.path.join(workdir, "fp32.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (calib[0][:1],), raw, dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "n"}, "y": {0: "n"}})
    quant_pre_process(raw, fp)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._it = iter(calib)

        def get_next(self):
            x = next(self._it, None)
            return None if x is None else {"x": x.numpy()}

    paths = {}
    for name, wtype in [("ort u8s8", QuantType.QInt8), ("ort u8u8", QuantType.QUInt8)]:
        if name not in wanted and not (name == "ort u8s8" and "ort u8s8 a7" in wanted):
            continue
        paths[name] = os.path.join(workdir, ORT_SYSTEMS[name] + ".onnx")
        quantize_static(fp, paths[name], Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=wtype, calibrate_method=CalibrationMethod.MinMax)
    if "ort u8s8 a7" in wanted:
        paths["ort u8s8 a7"] = os.path.join(workdir, "u8s8a7.onnx")
        quantize_static(fp, paths["ort u8s8 a7"], Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax,
                        extra_options={"TensorQuantOverrides": _ort.seven_bit_overrides(paths["ort u8s8"])})
    return {k: v for k, v in paths.items() if k in wanted}


def fused_ops(path: str) -> str:
    """Op counts of ORT's optimized graph: every conv should be a QLinearConv (a float
    Conv left between DQ and Q would time a float fallback, not the int8 kernels)."""
    import collections

    import onnx

    opt = path + ".opt.onnx"
    _ort.session(path, 1, optimized_path=opt)
    ops = collections.Counter(n.op_type for n in onnx.load(opt).graph.node)
    return f"{ops.get('QLinearConv', 0)} QLinearConv, {ops.get('Conv', 0)} float Conv"


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def calibration(size: int, batches: int, batch: int):
    """The seeded generator and the calibration images every contender is calibrated on;
    the generator then draws the timed inputs."""
    g = torch.Generator().manual_seed(0)
    return g, [torch.randn(batch, 3, size, size, generator=g) for _ in range(batches)]


def run_model(name: str, model, args, systems: list[str], results: list) -> None:
    import qdsl.runtime as rt

    size = args.size
    g, calib = calibration(size, args.calib_batches, args.calib_batch)
    built, notes = {}, []
    with tempfile.TemporaryDirectory() as workdir:
        if "torch fp32" in systems:
            built["torch fp32"] = model
        if "torch.ao x86" in systems:
            built["torch.ao x86"] = build_torchao(model, calib)
        for sysname, seven in (("qdsl a8", False), ("qdsl a7", True)):
            if sysname in systems:
                built[sysname], note = build_qdsl(model, calib, seven)
                notes.append(f"{sysname}: {note}")
        ort_paths = build_ort(model, calib, workdir, {s for s in systems if s in ORT_SYSTEMS}) \
            if any(s in ORT_SYSTEMS for s in systems) else {}
        notes += [f"{s}: {fused_ops(p)}" for s, p in ort_paths.items()]
        print(f"\n### {name}, 3x{size}x{size}, calibrated on {args.calib_batches} x {args.calib_batch} "
              "generated images")
        for n in notes:
            print(f"  {n}")
        for threads in args.threads:
            torch.set_num_threads(threads)
            rt.set_num_threads(threads)
            sessions = {s: _ort.session(p, threads) for s, p in ort_paths.items()}
            for batch in args.batches:
                x = torch.randn(batch, 3, size, size, generator=g)
                xn = x.numpy()
                fns = {}
                for s in systems:
                    if s in sessions:
                        fns[s] = (lambda sess: lambda: sess.run(None, {"x": xn})[0])(sessions[s])
                    elif s.startswith("qdsl"):
                        fns[s] = (lambda c: lambda: c.run(xn))(built[s])
                    else:
                        fns[s] = (lambda m: lambda: m(x))(built[s])
                with torch.no_grad():
                    outs = {s: np.asarray(fn()) for s, fn in fns.items()}
                    load_before = load_average()
                    times = interleaved(fns, args.rounds, args.reps, warmup_s=args.warmup)
                results.append(report(name, batch, threads, times, outs, load_before))
            del sessions  # their pools would compete with the next thread count


def report(name, batch, threads, times, outs, load_before) -> dict:
    print(f"\n{name}, batch {batch}, {threads} thread(s); load average before: {load_before}, "
          f"after: {load_average()}")
    ref = outs.get("torch fp32")
    print(f"  {'system':<14} {'ms: median (range over rounds)':>32}   cosine vs fp32")
    for s, ts in times.items():
        cos = f"{cosine(outs[s], ref):.4f}" if ref is not None else "-"  # a sanity check: same network
        print(f"  {s:<14} {span(ts, 1e3):>32}   {cos}")
    ratios = {}
    cosines = {s: cosine(outs[s], ref) for s in times} if ref is not None else {}
    for a, b, why in RATIOS:
        if a in times and b in times:
            r = np.asarray(times[a]) / np.asarray(times[b])
            ratios[f"{a} / {b}"] = r
            if why == "exact vs inexact" and b in EXACT:
                why = "exact 8-bit, exact on this CPU"
            print(f"  {a + ' / ' + b:<27} {span(r)}   ({why})")
    return {"model": name, "batch": batch, "threads": threads, "times": times, "ratios": ratios, "cosine": cosines,
            "shapes": {s: np.shape(o) for s, o in outs.items()}}


def summary(results: list, systems: list[str]) -> None:
    if not results:
        return
    print("\n## Summary: median ms over rounds; ratios: median (range) of the per-round ratios")
    names = list(results[0]["ratios"])
    print("| model, batch, threads | " + " | ".join(systems) + " | " + " | ".join(names) + " |")
    print("|---" * (1 + len(systems) + len(names)) + "|")
    for r in results:
        cells = [f"{np.median(r['times'][s]) * 1e3:.1f}" for s in systems]
        cells += [span(r["ratios"][n]) for n in names]
        print(f"| {r['model']}, {r['batch']}, {r['threads']} | " + " | ".join(cells) + " |")


def exactness(systems: list[str]) -> None:
    """Measure which peers' integer paths are exact on this CPU (on the op each one runs),
    so the tables' "exact" labels are facts, not assumptions.  qdsl equals its integer
    reference bit for bit by construction (tests/runtime)."""
    from kernels import torch_mismatch

    torch.backends.quantized.engine = "x86"
    rng = np.random.default_rng(0)
    t8, t7 = torch_mismatch(rng, torch, 255), torch_mismatch(rng, torch, 127)
    print(f"torch x86 quantized linear (fbgemm): {t8:.3%} of outputs wrong on 8-bit activations, {t7:.3%} on "
          "7-bit (torch.ao x86 = reduce_range: 7-bit)")
    exact = ["qdsl a8", "qdsl a7"] + (["torch.ao x86"] if t7 == 0 else [])
    if any(s in ORT_SYSTEMS for s in systems):
        r = _ort.exactness_report(("QLinearConv",))
        exact += [s for s, key in [("ort u8u8", "u8u8 a8"), ("ort u8s8", "u8s8 a8"), ("ort u8s8 a7", "u8s8 a7")]
                  if r[("QLinearConv", key)] == 0]
    inexact = [s for s in SYSTEMS[1:] if s not in exact]
    EXACT.clear()
    EXACT.update(exact)
    print(f"exact on this CPU: {', '.join(exact)}; not exact: {', '.join(inexact) or 'none'} (torch fp32: float)")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(ap, rounds=5, reps=3)
    ap.add_argument("--models", default=None, help="comma list of resnet18, resnet50, mobilenet_v2 "
                    "(default: all three; --quick: resnet18,mobilenet_v2)")
    ap.add_argument("--batches", default=None, help="comma list (default 1,8; --quick: 1)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of contenders")
    ap.add_argument("--size", type=int, default=224, help="input height and width")
    ap.add_argument("--small", action="store_true", help="test-width models (smoke runs)")
    ap.add_argument("--calib-batches", type=int, default=4)
    ap.add_argument("--calib-batch", type=int, default=4)
    ap.add_argument("--warmup", type=float, default=0.3, help="seconds of warm-up per contender per round")
    args = timing_args(ap.parse_args(argv))
    models = "resnet18,mobilenet_v2" if args.quick else "resnet18,mobilenet_v2,resnet50"
    args.models = (args.models or models).split(",")
    args.batches = [int(b) for b in (args.batches or ("1" if args.quick else "1,8")).split(",")]
    args.systems = args.systems.split(",")
    unknown = [s for s in args.systems if s not in SYSTEMS] + [m for m in args.models if m not in factories(False)]
    if unknown:
        ap.error(f"unknown system or model: {', '.join(unknown)}; systems: {', '.join(SYSTEMS)}")
    return args


def main(argv=None) -> list:
    args = parse_args(argv)
    import qdsl.runtime as rt

    if not rt.available():
        raise SystemExit(f"qdsl runtime unavailable: {rt.load_error()}")
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization logs a hint per model
    systems = list(args.systems)
    if _ort.modules() is None and any(s in ORT_SYSTEMS for s in systems):
        print("note: onnx/onnxruntime not installed (pip install .[bench]): the onnxruntime columns are skipped")
        systems = [s for s in systems if s not in ORT_SYSTEMS]
    print(f"models {args.models}, batches {args.batches}, threads {args.threads}, {args.rounds} rounds x "
          f"{args.reps} reps; load average: {load_average()}")
    exactness(systems)
    results: list = []
    torch_threads = torch.get_num_threads()
    try:
        for name in args.models:
            run_model(name, factories(args.small)[name](), args, systems, results)
    finally:  # main() is also called in-process (tests/benchmarks): leave the thread counts as found
        rt.set_num_threads(0)
        torch.set_num_threads(torch_threads)
    summary(results, systems)
    print(f"\nload average at the end: {load_average()}")
    return results


if __name__ == "__main__":
    main()

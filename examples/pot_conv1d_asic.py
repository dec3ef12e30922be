"""A shift-only ASIC flow: power-of-two QAT of a Conv1d model, lint, export, bit-exact C++.

What it shows, for hardware engineers targeting a fixed-point accelerator without a
multiplier in its requantization path (``specs/hw/pot-asic-24bit-acc.toml``):

1. ``specs/pot-asic.qspec`` on :class:`qdsl.zoo.models.Conv1dNet` trained on the
   synthetic keyword-spotting-like task of ``qdsl.zoo.data`` (chirps, tones, noise
   bursts and silence in noise): 4-bit weights and 8-bit activations, every scale a power
   of two, no zero points, BatchNorm folded, a 24-bit saturating accumulator.
2. PTQ (calibrate + freeze) beside QAT (``qdsl.qat.fit``: folded BN trained with batch
   statistics, straight-through gradients); ``--set weight.scale=learned_pot`` learns the
   power-of-two exponents instead of searching them.
3. ``qdsl.lint(spec, "pot-asic-24bit-acc", model=...)`` (expected: clean).
4. Export to an integer graph, save/load the ``.qgraph``, run it with the C++ runtime:
   with power-of-two scales the integer graph equals the fake-quant model *bit for bit*.
5. Per layer: the requantization shifts (every multiplier is 1, so requantization is an
   arithmetic shift), and the accumulator width needed - worst case from the bit widths,
   exact bound from the actual integer weights and bias, largest value seen on the test
   set - against the 24-bit budget (plus the saturation count).

Run: ``python examples/pot_conv1d_asic.py [--quick] [--set KEY=VALUE ...]``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "pot-asic.qspec"
PROFILE = "pot-asic-24bit-acc"


def shift_rows(graph) -> list[tuple[str, str, str, str]]:
    """(op, type, shifts, meaning) for every op whose output stage is a pure shift."""
    from qdsl.graph.ir import DType, OpType, RescaleKind, Rounding

    rows = []
    for op in graph.ops:
        a = op.attrs
        if "rq_kind" not in a or op.type is OpType.RESHAPE:
            continue
        if a["rq_kind"] != RescaleKind.POT:
            rows.append((op.name, op.type.name, "not a shift", f"rescale kind {RescaleKind(a['rq_kind']).name}"))
            continue
        shifts = sorted(set(a["rq_shift"]))
        per = "per channel" if len(a["rq_shift"]) > 1 else "per tensor"
        text = ", ".join(f">>{s}" if s > 0 else (f"<<{-s}" if s < 0 else "0") for s in shifts)
        out = graph.tensor(op.outputs[0]).dtype
        if out is DType.I32 and shifts == [0]:
            note = "no requantization: the wide int32 result goes on to the next op"
        else:
            note = (f"{per}, rounding {Rounding(a['rq_rounding']).name.lower()}, "
                    f"clamp to [{a['out_min']}, {a['out_max']}]")
        rows.append((op.name, op.type.name, f"{text} -> {out.name}", note))
    return rows


def _input_range(graph, name: str) -> tuple[int, int]:
    """Integer range of tensor ``name``: its producer's clamp when it has one, else its dtype's."""
    for op in graph.ops:
        if name in op.outputs:
            if "out_min" in op.attrs:
                return int(op.attrs["out_min"]), int(op.attrs["out_max"])
            if op.type.name == "QUANTIZE":
                return int(op.attrs["qmin"]), int(op.attrs["qmax"])
    return graph.tensor(name).dtype.range


def accumulator_rows(graph, x) -> list[tuple[str, int, int, int, int, int, int]]:
    """(op, fan-in, worst-case bits, exact-bound bits, observed bits, budget, saturations)
    for every conv/linear op, ``x`` being the float graph input."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from qdsl.graph import execute
    from qdsl.graph.ir import OpType
    from qdsl.lint.accumulator import bits_for, tight_range, worst_case_bits

    res = execute(graph, x, keep_values=True)
    rows = []
    for op in graph.ops:
        if op.type not in (OpType.CONV1D, OpType.CONV2D, OpType.LINEAR):
            continue
        a = op.attrs
        w_t = graph.tensor(op.inputs[1])
        w_zp = np.asarray(a["w_zp"], dtype=np.int64).reshape((-1,) + (1,) * (w_t.data.ndim - 1))
        w = w_t.data.astype(np.int64) - w_zp
        bias = graph.tensor(op.inputs[2]).data.astype(np.int64) if len(op.inputs) > 2 else None
        lo, hi = _input_range(graph, op.inputs[0])
        lo, hi = lo - a["in_zp"], hi - a["in_zp"]
        fan_in = int(np.prod(w.shape[1:]))
        worst = worst_case_bits(w_t.dtype.range, (lo, hi), fan_in)
        if bias is not None:  # the bias is added into the same accumulator
            wl, wh = w_t.dtype.range
            corners = [p * q for p in (wl, wh) for q in (lo, hi)]
            worst = bits_for(fan_in * min(corners) + int(bias.min()), fan_in * max(corners) + int(bias.max()))
        exact = bits_for(*tight_range(w, [(lo, hi)], bias))
        # the accumulators this test set really produces (float64 holds them exactly)
        xin = torch.from_numpy(res.values[op.inputs[0]].astype(np.float64) - a["in_zp"])
        wt = torch.from_numpy(w.astype(np.float64))
        bt = None if bias is None else torch.from_numpy(bias.astype(np.float64))
        if op.type is OpType.LINEAR:
            acc = F.linear(xin, wt, bt)
        else:
            conv = F.conv1d if op.type is OpType.CONV1D else F.conv2d
            acc = conv(xin, wt, bt, stride=a["stride"], padding=a["padding"], dilation=a["dilation"],
                       groups=a["groups"])
        seen = bits_for(int(acc.min()), int(acc.max()))
        rows.append((op.name, fan_in, worst, exact, seen, int(a["acc_bits"]), res.overflow.get(op.name, 0)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter float training and 1 QAT epoch (smoke test)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="spec override, e.g. weight.scale=learned_pot (repeatable)")
    parser.add_argument("--epochs", type=int, default=None, help="QAT epochs (default 3, 1 with --quick)")
    parser.add_argument("--lr", type=float, default=5e-4, help="peak QAT learning rate")
    parser.add_argument("--spec", default=str(SPEC))
    args = parser.parse_args(argv)
    epochs = args.epochs if args.epochs is not None else (1 if args.quick else 3)

    import numpy as np

    import qdsl
    import qdsl.qat
    from qdsl import runtime
    from qdsl.zoo.train import evaluate, predict, trained_conv1d_net

    # 12 float epochs is the shared (cached) reference model; 40 fit the task better
    float_model, data = trained_conv1d_net(epochs=12 if args.quick else 40)
    x_train, y_train, x_test, y_test = data
    calib = [x_train[i : i + 128] for i in range(0, 512, 128)]
    acc = {"float": evaluate(float_model, x_test, y_test)}
    print(f"Conv1dNet on synthetic keywords: {len(x_train)} train / {len(x_test)} test sequences of "
          f"{tuple(x_test.shape[1:])}; spec {Path(args.spec).name}"
          + (f" with {', '.join(args.overrides)}" if args.overrides else ""))

    ptq = copy.deepcopy(float_model)
    qdsl.apply(ptq, args.spec, overrides=args.overrides)
    qdsl.calibrate(ptq, calib, progress=False)
    qdsl.freeze(ptq)
    acc["PTQ"] = evaluate(ptq, x_test, y_test)

    model = copy.deepcopy(float_model)
    qdsl.apply(model, args.spec, overrides=args.overrides)
    qdsl.calibrate(model, calib, progress=False)
    qdsl.qat.fit(model, x_train, y_train, epochs=epochs, lr=args.lr)
    qdsl.freeze(model)
    acc["QAT"] = evaluate(model, x_test, y_test)

    diags = qdsl.lint(args.spec, PROFILE, model=model, overrides=args.overrides)
    print(f"\nqdsl lint {Path(args.spec).name} --hw {PROFILE}: "
          + ("clean (0 diagnostics)" if not diags else f"{len(diags)} diagnostic(s)"))
    for d in diags:
        print(d.render())

    fq_logits = predict(model, x_test).numpy()
    graph = qdsl.export(model, x_test[:1])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "conv1d_pot.qgraph"
        qdsl.save_graph(graph, path)
        size = path.stat().st_size
        graph = qdsl.load_graph(path)
    xs = x_test.numpy()
    ref = np.asarray(qdsl.run_graph(graph, xs, backend="reference"))
    out, backend = ref, "reference"
    if not runtime.available():
        cpp_same = f"not run (runtime not built: {runtime.load_error()})"
    else:
        try:
            out, backend = np.asarray(qdsl.run_graph(graph, xs, backend="cpp")), "C++"
            cpp_same = "yes (bit-identical)" if np.array_equal(out, ref) else "NO"
        except qdsl.QdslError as err:  # a graph feature this runtime build does not support
            cpp_same = f"NO: the runtime rejected the graph ({str(err).splitlines()[0]})"
    acc["integer graph"] = float((out.argmax(1) == y_test.numpy()).mean())
    exact = bool(np.array_equal(out, fq_logits))

    print(f"\nrequantization per layer (.qgraph {size / 1024:.1f} KiB, {len(graph.ops)} ops; every multiplier is 1):")
    print("| op | type | shift -> output | stage |")
    print("|---|---|---|---|")
    for row in shift_rows(graph):
        print("| " + " | ".join(row) + " |")

    print(f"\naccumulator bits needed vs the {PROFILE} budget ({len(xs)} test sequences):")
    print("| op | fan-in | worst case (bit widths) | exact bound (weights+bias) | observed | budget | saturated |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, fan_in, worst, tight, seen, budget, sat in accumulator_rows(graph, xs):
        print(f"| {name} | {fan_in} | {worst} | {tight} | {seen} | {budget} | {sat} |")

    print("\n| model | test accuracy |")
    print("|---|---:|")
    for name, value in acc.items():
        print(f"| {name} | {value * 100:.2f}% |")
    print(f"\nC++ == reference: {cpp_same}")
    print(f"integer graph ({backend}) == fake-quant model bit for bit: {'yes' if exact else 'NO'} "
          f"(max |Δ logit| {float(np.abs(out - fq_logits).max()):.2e}, "
          f"top-1 agreement {float((out.argmax(1) == fq_logits.argmax(1)).mean()) * 100:.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

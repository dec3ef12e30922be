"""``qdsl demo``: the whole pipeline on real data in about a minute and a half on one core.

1. Train a float ResNet-style CNN on scikit-learn's bundled digits (cached on disk).
2. PTQ sweep W8A8 → W2A2 with one spec and ``--set`` overrides (no file edits).
3. A short binary QAT with the XNOR-Net spec (binary weights and activations).
4. Export the power-of-two-scale model to an integer graph, save/load the ``.qgraph``
   file, run it with the C++ runtime, and check it against the Python reference
   executor (bit for bit) and the fake-quant model (top-1 agreement, max |Δ logit|).
5. Lint the spec + model against a bundled hardware profile.

Every stage reports what it measured, training steps show progress (a bar on a terminal,
a line per epoch otherwise); the last lines are one summary table.  Options point the demo
at the user's own spec (``--spec``) and shorten it (``--quick``).
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_demo", "bundled_spec", "DemoResult"]

import attrs


def bundled_spec(name: str) -> Path:
    """Path of a spec that ships with qdsl (``qdsl/data/specs/<name>.qspec``)."""
    from qdsl.spec.diagnostics import QdslError

    base = Path(__file__).resolve().parent.parent / "data" / "specs"
    path = base / f"{name}.qspec"
    if not path.is_file():
        known = sorted(p.name[: -len(".qspec")] for p in base.glob("*.qspec"))
        raise QdslError(f"no bundled spec '{name}'; bundled: {', '.join(known)}")
    return path


@attrs.define
class DemoResult:
    rows: list[tuple[str, str, str]] = attrs.Factory(list)
    """(stage, result, detail) lines of the summary table."""
    ok: bool = True

    def add(self, stage: str, result: str, detail: str = "") -> None:
        self.rows.append((stage, result, detail))

    def table(self) -> str:
        w0 = max(len(r[0]) for r in self.rows)
        w1 = max(len(r[1]) for r in self.rows)
        return "\n".join(f"{a.ljust(w0)}  {b.ljust(w1)}  {c}".rstrip() for a, b, c in self.rows)


def _stage(log: Callable[[str], None], n: int, total: int, text: str) -> float:
    log(f"[{n}/{total}] {text}")
    return time.perf_counter()


def run_demo(
    spec: str | None = None,
    *,
    quick: bool = False,
    profile: str = "pot-asic-24bit-acc",
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
    stream: Any = None,
) -> DemoResult:
    """Run the demo and return its summary (also printed by the CLI).

    Training steps report progress to ``stream`` (default stderr): a bar on a terminal,
    one line per epoch otherwise (:class:`~qdsl.workflows.progress.TrainProgress`)."""
    import numpy as np
    import torch

    import qdsl
    from qdsl.zoo.train import evaluate, trained_digits_resnet
    from qdsl.workflows.progress import TrainProgress
    from qdsl.workflows.sweep import format_table, sweep

    if spec is not None:
        from qdsl.parse import load_spec

        load_spec(spec)  # a bad spec fails here, located, before any training
    torch.manual_seed(0)
    res = DemoResult()
    total = 5
    ptq_spec = spec or str(bundled_spec("low-bit"))
    pot_spec = spec or str(bundled_spec("pot-asic"))

    t0 = _stage(log, 1, total, "training a float ResNet-style CNN on sklearn digits (1,797 8x8 images)")
    bar = TrainProgress("float ResNet", 30, stream=stream)
    model, data = trained_digits_resnet(epochs=30, progress=bar)
    if not bar.steps:
        log("      trained before: loaded from the training cache ($QDSL_TRAIN_CACHE or the temp dir)")
    x_train, y_train, x_test, y_test = data
    float_acc = evaluate(model, x_test, y_test)
    res.add("float model", f"{float_acc * 100:.2f}%", f"DigitsResNet, {len(x_test)} test images, {time.perf_counter() - t0:.1f} s")

    bits = [8, 4, 3] if quick else [8, 6, 4, 3, 2]
    _stage(log, 2, total, f"PTQ sweep W{bits[0]}A{bits[0]} -> W{bits[-1]}A{bits[-1]} with {Path(ptq_spec).name}")
    settings = [(("weight.bits", str(b)), ("input.bits", str(b))) for b in bits]
    points = sweep(model, ptq_spec, data, settings, progress=lambda m: log("      " + m))
    log(format_table(points))
    for p in points:
        b = dict(p.setting)["weight.bits"]
        res.add(f"PTQ W{b}A{b}", f"{p.accuracy * 100:.2f}%", f"{-p.drop * 100:+.2f} pts vs float, {p.float_size_bits / max(1, p.size_bits):.1f}x smaller")

    _stage(log, 3, total, "binary QAT (xnor-binary: 1-bit weights and activations, 8-bit first/last layer)")
    res.add(*_binary_qat(model, data, quick, log, stream))

    _stage(log, 4, total, f"export {Path(pot_spec).name} to an integer graph and run it")
    for row in _export_and_run(model, pot_spec, data, log):
        res.add(*row)

    _stage(log, 5, total, f"lint {Path(pot_spec).name} against the '{profile}' hardware profile")
    diags = qdsl.lint(pot_spec, profile, model=model)
    errors = [d for d in diags if d.severity.value == "error"]
    warnings_ = [d for d in diags if d.severity.value == "warning"]
    for d in diags[:6]:
        log("      " + d.render().splitlines()[0])
    res.add(f"lint vs {profile}", f"{len(errors)} errors, {len(warnings_)} warnings",
            "(qdsl lint SPEC --hw PROFILE --model ... for the full report)")
    return res


def _binary_qat(float_model: Any, data: tuple, quick: bool, log, stream: Any = None) -> tuple[str, str, str]:
    """XNOR-Net QAT of a Hardtanh CNN (see ``digits_binary_cnn`` for why not ReLU)."""
    import torch

    import qdsl
    import qdsl.qat
    from qdsl.zoo.models import digits_binary_cnn
    from qdsl.zoo.train import evaluate, train_float
    from qdsl.workflows.progress import TrainProgress

    x_train, y_train, x_test, y_test = data
    torch.manual_seed(0)
    model = train_float(digits_binary_cnn(), x_train, y_train, epochs=4, lr=0.01, seed=0,
                        progress=TrainProgress("float Hardtanh CNN", 4, stream=stream))
    float_acc = evaluate(model, x_test, y_test)
    qdsl.apply(model, str(bundled_spec("xnor-binary")))
    qdsl.calibrate(model, (x_train[i : i + 64] for i in range(0, 256, 64)), progress=False)
    calib_acc = evaluate(model, x_test, y_test)
    epochs = 3 if quick else 6
    t0 = time.perf_counter()
    qdsl.qat.fit(model, x_train, y_train, epochs=epochs, lr=5e-3, seed=0,
                 progress=TrainProgress("binary QAT", epochs, stream=stream))
    qdsl.freeze(model)
    acc = evaluate(model, x_test, y_test)
    log(f"      float {float_acc * 100:.2f}% -> binary after calibration {calib_acc * 100:.2f}% "
        f"-> after {epochs} QAT epochs {acc * 100:.2f}%")
    return ("binary QAT (XNOR)", f"{acc * 100:.2f}%",
            f"Hardtanh CNN, float {float_acc * 100:.1f}%, {calib_acc * 100:.1f}% after calibration, "
            f"{epochs} epochs in {time.perf_counter() - t0:.1f} s")


def _export_and_run(float_model: Any, spec: str, data: tuple, log) -> list[tuple[str, str, str]]:
    import numpy as np
    import torch

    import qdsl
    from qdsl.zoo.train import evaluate, predict

    x_train, y_train, x_test, y_test = data
    model = copy.deepcopy(float_model)
    qdsl.apply(model, spec)
    qdsl.calibrate(model, (x_train[i : i + 64] for i in range(0, 256, 64)), progress=False)
    qdsl.freeze(model)
    fq_logits = predict(model, x_test)
    graph = qdsl.export(model, x_test[:1])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "digits.qgraph"
        qdsl.save_graph(graph, path)
        size = path.stat().st_size
        graph = qdsl.load_graph(path)
    rows = []
    xs = x_test.numpy()
    t0 = time.perf_counter()
    ref = np.asarray(qdsl.run_graph(graph, xs, backend="reference"))
    t_ref = time.perf_counter() - t0
    from qdsl import runtime

    if runtime.available():
        t0 = time.perf_counter()
        out = np.asarray(qdsl.run_graph(graph, xs, backend="cpp"))
        t_cpp = time.perf_counter() - t0
        same = bool(np.array_equal(out, ref))
        rows.append(("C++ runtime == reference", "yes" if same else "NO",
                     f"{len(xs)} images: C++ {t_cpp * 1e3:.1f} ms, Python reference {t_ref * 1e3:.0f} ms"))
    else:
        out = ref
        rows.append(("C++ runtime", "not built", f"{runtime.load_error()}; ran the Python reference"))
    agree = float((torch.from_numpy(out).argmax(1) == fq_logits.argmax(1)).float().mean())
    diff = float((torch.from_numpy(out) - fq_logits).abs().max())
    acc = float((torch.from_numpy(out).argmax(1) == y_test).float().mean())
    rows.append(("integer graph accuracy", f"{acc * 100:.2f}%", f"{len(graph.ops)} ops, .qgraph file {size / 1024:.1f} KiB"))
    rows.append(("integer vs fake-quant", f"{agree * 100:.2f}% same top-1", f"max |logit difference| {diff:.2e}"))
    return rows

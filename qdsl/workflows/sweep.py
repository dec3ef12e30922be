"""Sweeps: the same spec at several settings (``--set weight.bits=8,6,4,3,2``), one table.

For each setting the float model is copied, the spec is applied with that setting as
overrides, calibrated on the first ``calib`` training images, optionally fine-tuned
with QAT for ``qat_epochs``, frozen and evaluated; the float copy is never touched, so
every point starts from the same weights.

Settings: each ``--set KEY=V1,V2,...`` lists values; lists of equal length are zipped
(``weight.bits=8,4 input.bits=8,4`` gives W8A8 and W4A4), and ``product=True`` takes
the cartesian product instead.  A single value applies to every point.

Model size counts what an integer deployment stores: quantized weights at their bit
width, int32 biases, and float32 for everything left in float (BatchNorm parameters
vanish when the spec folds BN).
"""

from __future__ import annotations

import copy
import csv
import itertools
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import attrs

from qdsl.spec.diagnostics import QdslError

__all__ = ["SweepPoint", "expand_settings", "model_size_bits", "run_point", "sweep", "write_csv", "plot", "format_table"]


@attrs.frozen
class SweepPoint:
    """One row of a sweep."""

    setting: tuple[tuple[str, str], ...]
    accuracy: float
    float_accuracy: float
    size_bits: int
    float_size_bits: int
    seconds: float

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.setting) or "(spec as written)"

    @property
    def drop(self) -> float:
        return self.float_accuracy - self.accuracy


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses: ``histogram(bins=512, percentile=99),mse``."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        depth += (ch == "(") - (ch == ")")
        cur.append(ch)
    parts.append("".join(cur))
    return parts


def expand_settings(items: Sequence[str], product: bool = False) -> list[tuple[tuple[str, str], ...]]:
    """``["weight.bits=8,4", "input.bits=8,4"]`` -> ``[(("weight.bits","8"),("input.bits","8")), ...]``."""
    keys: list[str] = []
    values: list[list[str]] = []
    for item in items:
        key, sep, rest = item.partition("=")
        if not sep or not key.strip() or not rest.strip():
            raise QdslError(f"--set: expected KEY=V1[,V2,...], got '{item}' (e.g. weight.bits=8,6,4)")
        keys.append(key.strip())
        values.append([v.strip() for v in _split_top_level(rest) if v.strip()])
    if not keys:
        return [()]
    if product:
        combos = list(itertools.product(*values))
    else:
        lengths = {len(v) for v in values if len(v) > 1}
        if len(lengths) > 1:
            raise QdslError(
                "--set: value lists of different lengths "
                + ", ".join(f"{k} ({len(v)})" for k, v in zip(keys, values))
                + "; give lists of equal length (zipped) or use --product"
            )
        n = lengths.pop() if lengths else 1
        combos = [tuple(v[i] if len(v) > 1 else v[0] for v in values) for i in range(n)]
    return [tuple(zip(keys, combo)) for combo in combos]


def model_size_bits(model: Any, plan: Any) -> int:
    """Bits to store ``model`` as ``plan`` quantizes it (float parameters at 32 bits).

    ``model`` is the model *before* ``qdsl.apply`` (parameter names as the plan knows them).
    """
    from qdsl.spec.model import Role

    total = 0
    folded_bn = set()
    if plan is not None and plan.fold_bn:
        folded_bn = {fqn for fqn, m in model.named_modules() if type(m).__name__.startswith("BatchNorm")}
    layers = {l.fqn: l for l in plan.layers} if plan is not None else {}
    for fqn, p in model.named_parameters():
        owner, _, pname = fqn.rpartition(".")
        if owner in folded_bn:
            continue
        bits = 32
        layer = layers.get(owner)
        if layer is not None and not layer.skip and pname in ("weight", "bias"):
            recipe = layer.recipe(Role.WEIGHT if pname == "weight" else Role.BIAS)
            if recipe is not None:
                bits = recipe.bits
        total += p.numel() * bits
    return total


def run_point(
    float_model: Any,
    spec: Any,
    data: tuple,
    setting: Iterable[tuple[str, str]] = (),
    *,
    calib: int = 256,
    qat_epochs: int = 0,
    qat_lr: float = 1e-3,
    seed: int = 0,
    keep: bool = False,
    strict: bool = False,
    calib_batches: Sequence[Any] | None = None,
    inputs: Any = None,
) -> tuple[float, int, Any]:
    """Quantize a copy of ``float_model`` with ``spec`` + ``setting``; ``(accuracy, size_bits, model)``.

    The returned model is the quantized copy when ``keep`` is true, else ``None``;
    ``strict`` is ``qdsl.apply``'s (refuse a spec that leaves reached layers in float).
    ``calib_batches`` (a list: every point re-reads it) replaces the slices of ``data[0]``
    as calibration data; its batches and ``inputs`` follow ``qdsl.calibrate``'s rule
    (tuples as positional inputs then targets, dicts as keyword arguments;
    :mod:`qdsl.calibration.batches`).
    """
    import qdsl
    from qdsl.zoo.train import evaluate

    model = copy.deepcopy(float_model).eval()
    overrides = [f"{k}={v}" for k, v in setting]
    handle = qdsl.apply(model, spec, overrides=overrides or None, strict=strict)
    if calib_batches is not None:
        qdsl.calibrate(model, calib_batches, inputs=inputs)
    else:
        x_train = data[0]
        qdsl.calibrate(model, (x_train[i : i + 64] for i in range(0, min(calib, len(x_train)), 64)), inputs=inputs)
    if qat_epochs:
        from qdsl.qat import fit

        fit(model, data[0], data[1], epochs=qat_epochs, lr=qat_lr, seed=seed)
    qdsl.freeze(model)
    acc = evaluate(model, data[2], data[3])
    size = model_size_bits(float_model, handle.plan)
    return acc, size, (model if keep else None)


def sweep(
    float_model: Any,
    spec: Any,
    data: tuple,
    settings: Sequence[tuple[tuple[str, str], ...]],
    *,
    calib: int = 256,
    qat_epochs: int = 0,
    progress: Callable[[str], None] | None = None,
    strict: bool = False,
    calib_batches: Iterable[Any] | None = None,
    inputs: Any = None,
) -> list[SweepPoint]:
    """Run every setting; the float model is evaluated once for reference.

    ``calib_batches``/``inputs``: calibration batches of any form ``qdsl.calibrate``
    takes (tuples, dicts) instead of the first ``calib`` rows of ``data[0]``; see
    :func:`run_point`."""
    from qdsl.zoo.train import evaluate

    if calib_batches is not None:
        calib_batches = list(calib_batches)  # every point calibrates on the same batches
    float_acc = evaluate(float_model, data[2], data[3])
    float_size = sum(p.numel() * 32 for p in float_model.parameters())
    points = []
    for i, setting in enumerate(settings):
        if progress:
            progress(f"[{i + 1}/{len(settings)}] " + (" ".join(f"{k}={v}" for k, v in setting) or "spec as written"))
        t0 = time.perf_counter()
        acc, size, _ = run_point(float_model, spec, data, setting, calib=calib, qat_epochs=qat_epochs,
                                 strict=strict, calib_batches=calib_batches, inputs=inputs)
        points.append(SweepPoint(tuple(setting), acc, float_acc, size, float_size, time.perf_counter() - t0))
    return points


def format_table(points: Sequence[SweepPoint]) -> str:
    """A plain-text table: setting, accuracy, drop, size, seconds."""
    if not points:
        return "(no points)"
    head = ("setting", "accuracy", "vs float", "size KiB", "x smaller", "time s")
    rows = [("float", f"{points[0].float_accuracy * 100:.2f}%", "", f"{points[0].float_size_bits / 8192:.1f}", "1.0", "")]
    for p in points:
        rows.append(
            (
                p.label,
                f"{p.accuracy * 100:.2f}%",
                f"{-p.drop * 100:+.2f}",
                f"{p.size_bits / 8192:.1f}",
                f"{p.float_size_bits / max(1, p.size_bits):.1f}",
                f"{p.seconds:.1f}",
            )
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(head), line(tuple("-" * w for w in widths)), *map(line, rows)])


def write_csv(points: Sequence[SweepPoint], path: str | Path) -> None:
    keys = sorted({k for p in points for k, _ in p.setting})
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*keys, "accuracy", "float_accuracy", "size_bits", "float_size_bits", "seconds"])
        for p in points:
            d = dict(p.setting)
            w.writerow([*(d.get(k, "") for k in keys), f"{p.accuracy:.6f}", f"{p.float_accuracy:.6f}",
                        p.size_bits, p.float_size_bits, f"{p.seconds:.3f}"])


def plot(points: Sequence[SweepPoint], path: str | Path) -> bool:
    """Accuracy vs model size as a PNG when matplotlib is installed; False otherwise."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p.size_bits / 8192 for p in points]
    ys = [p.accuracy * 100 for p in points]
    ax.plot(xs, ys, "o-")
    for p, x_, y_ in zip(points, xs, ys):
        ax.annotate(p.label, (x_, y_), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if points:
        ax.axhline(points[0].float_accuracy * 100, ls="--", c="gray", label="float")
    ax.set_xlabel("model size (KiB)")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True

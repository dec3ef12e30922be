"""Per-layer sensitivity to low-bit quantization, and mixed-precision specs from it.

:func:`sensitivity` runs the spec's whole PTQ (apply, calibrate - with whatever range
search, learned rounding and bias correction the spec enables -, freeze, evaluate,
remove) ``2N + 2`` times for ``N`` quantized Linear/Conv layers, with the layers'
weight and input bits overridden to ``bits``:

* *float* (nothing quantized) and *all* (every layer at ``bits``) as references;
* *alone*: only layer L at ``bits`` (every other layer skipped) -> ``alone = float - metric``;
* *all but*: every layer but L at ``bits`` -> ``all_but = metric - all``.

``score = alone + all_but`` (both in metric units, larger = more sensitive) ranks the
layers; the report lists them sorted.  With the accuracy metric (coarse on small test
sets: one image is 0.2 points), the same score computed on the cross-entropy loss
(``tiebreak``) orders layers whose accuracy scores tie.  Metrics: ``"accuracy"`` (top-1, in percent
points), ``"loss"`` (minus mean cross-entropy) or a callable ``(model, x, y) -> float``
where larger is better.

:func:`emit_mixed_precision` turns a report into an ordinary spec: the report's
(composed) spec plus one exact-name rule per quantized layer giving its weight and
input bits, ``high_bits`` (default ``bits + 1``) for the chosen layers and ``bits`` for
the rest.  The budget is the **weight-count-weighted** average of weight bits:
``sum(n_i · b_i) / sum(n_i) <= budget`` over the quantized layers (``n_i`` = number of
weights of layer i).  The chosen set maximises the summed score of the raised layers
within the budget: exhaustively for up to 16 layers, otherwise the better of two
greedy orders (by score, and by score per weight); budget left over then goes to the
remaining layers in score order.  Rules get a ``priority`` above any
in the spec so they win over its exact-name rules.

Data: ``data = (x_calib, x_test, y_test)``; the CLI's ``--data MODULE:LOADER`` returns
``(x_train, y_train, x_test, y_test)`` (:mod:`qdsl.workflows.refs`) and calibrates on
the first ``--calib`` (256) training images.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import attrs
import torch
from torch import nn
import torch.nn.functional as F

from qdsl.spec.diagnostics import QdslError
from qdsl.spec.model import QuantSpec, Role, Rule, RuleBody, Target, TensorQuant

__all__ = ["LayerSensitivity", "SensitivityReport", "sensitivity", "emit_mixed_precision", "ptq_metric",
           "mixed_average_bits"]

_EXHAUSTIVE_MAX = 16


@attrs.frozen
class LayerSensitivity:
    """One layer's sensitivity at the report's bits (metric units; larger = worse)."""

    fqn: str
    weights: int
    roles: tuple[str, ...]
    """The roles the sensitivity run overrode (weight, and input when quantized)."""
    alone: float
    all_but: float
    tiebreak: float = 0.0
    """The score on the loss (accuracy reports only): orders layers whose scores tie."""

    @property
    def score(self) -> float:
        return self.alone + self.all_but

    @property
    def key(self) -> float:
        """What the ranking and the budget choice maximise: the score, ties broken by
        ``tiebreak`` (scaled so it never outweighs a real score difference)."""
        return self.score + 1e-6 * self.tiebreak


@attrs.frozen
class SensitivityReport:
    """Result of :func:`sensitivity`; ``layers`` sorted most sensitive first."""

    spec: QuantSpec
    bits: int
    metric: str
    float_metric: float
    all_metric: float
    layers: tuple[LayerSensitivity, ...]

    def format(self) -> str:
        """A plain-text table, most sensitive layer first."""
        w = max([len(s.fqn) for s in self.layers] + [5])
        tie = any(s.tiebreak for s in self.layers)
        lines = [
            f"sensitivity at {self.bits} bits (weights and inputs), metric {self.metric}: "
            f"float {self.float_metric:.2f}, all layers at {self.bits} bits {self.all_metric:.2f}",
            f"{'layer':<{w}}  {'weights':>8}  {'drop alone':>10}  {'gain if float':>13}  {'score':>7}"
            + ("  loss score" if tie else ""),
        ]
        for s in self.layers:
            lines.append(f"{s.fqn:<{w}}  {s.weights:>8}  {s.alone:>10.2f}  {s.all_but:>13.2f}  {s.score:>7.2f}"
                         + (f"  {s.tiebreak:>10.4f}" if tie else ""))
        return "\n".join(lines)


def _metric_fn(metric: str | Callable[..., float]) -> tuple[str, Callable[..., float]]:
    if callable(metric):
        return getattr(metric, "__name__", "custom"), metric
    if metric == "accuracy":
        return metric, lambda m, x, y: 100.0 * float((_predict(m, x).argmax(1) == y).float().mean())
    if metric == "loss":
        return metric, lambda m, x, y: -float(F.cross_entropy(_predict(m, x), y))
    raise QdslError(f"unknown metric '{metric}'; use accuracy, loss or a callable (model, x, y) -> float")


@torch.no_grad()
def _predict(model: nn.Module, x: torch.Tensor, batch: int = 512) -> torch.Tensor:
    return torch.cat([model(x[i : i + batch]) for i in range(0, len(x), batch)])


def ptq_metric(model: nn.Module, spec: Any, x_calib: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
               metric: str | Callable[..., float] | Sequence[Any] = "accuracy", *, overrides: Any = None,
               batch_size: int = 64) -> Any:
    """Apply ``spec`` to ``model``, calibrate on ``x_calib``, freeze, measure, remove.
    With a list of metrics, returns the list of their values (one PTQ run)."""
    import qdsl

    many = isinstance(metric, (list, tuple))
    fns = [_metric_fn(m)[1] for m in (metric if many else [metric])]
    was_training = model.training
    model.eval()
    qdsl.apply(model, spec, overrides=overrides)
    try:
        qdsl.calibrate(model, [x_calib[i : i + batch_size] for i in range(0, len(x_calib), batch_size)],
                       progress=False)
        qdsl.freeze(model)
        values = [fn(model, x_test, y_test) for fn in fns]
        return values if many else values[0]
    finally:
        qdsl.remove(model)
        model.train(was_training)


def _skip_rules(names: Sequence[str]) -> tuple[Rule, ...]:
    return tuple(Rule((Target.parse(n),), RuleBody(skip=True)) for n in names)


def _quantized_layers(model: nn.Module, spec: QuantSpec) -> list[tuple[str, int, tuple[str, ...]]]:
    from qdsl.resolve import resolve

    plan = resolve(model, spec)
    modules = dict(model.named_modules())
    out = []
    for lp in plan.layers:
        m = modules.get(lp.fqn)
        if not lp.quantized or not isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)) or lp.recipe(Role.WEIGHT) is None:
            continue
        roles = tuple(r.value for r in (Role.WEIGHT, Role.INPUT) if lp.recipe(r) is not None)
        out.append((lp.fqn, int(m.weight.numel()), roles))
    return out


def sensitivity(
    model: nn.Module,
    spec: Any,
    data: Sequence[torch.Tensor],
    metric: str | Callable[..., float] = "accuracy",
    bits: int = 3,
    *,
    progress: Callable[[str], None] | None = None,
) -> SensitivityReport:
    """Per-layer sensitivity of ``model`` under ``spec`` at ``bits`` (see module doc)."""
    from qdsl.resolve.resolver import load_for_resolve

    if len(data) != 3:
        raise QdslError("sensitivity data must be (x_calib, x_test, y_test)")
    x_cal, x_test, y_test = data
    name, fn = _metric_fn(metric)
    fns = [fn, _metric_fn("loss")[1]] if name == "accuracy" else [fn]
    base = load_for_resolve(spec)
    layers = _quantized_layers(model, base)
    if not layers:
        raise QdslError("the spec quantizes no Linear/Conv layer of this model: nothing to measure")
    overrides = [f"weight.bits={bits}", f"input.bits={bits}"]
    say = progress or (lambda _msg: None)
    was_training = model.training
    model.eval()
    try:
        float_m = [f(model, x_test, y_test) for f in fns]
        all_m = ptq_metric(model, base, x_cal, x_test, y_test, fns, overrides=overrides)
        names = [f for f, _, _ in layers]
        out = []
        for i, (fqn, n, roles) in enumerate(layers):
            say(f"[{i + 1}/{len(layers)}] {fqn}")
            alone_spec = attrs.evolve(base, rules=base.rules + _skip_rules([x for x in names if x != fqn]))
            but_spec = attrs.evolve(base, rules=base.rules + _skip_rules([fqn]))
            one = ptq_metric(model, alone_spec, x_cal, x_test, y_test, fns, overrides=overrides)
            but = ptq_metric(model, but_spec, x_cal, x_test, y_test, fns, overrides=overrides)
            alone = [f - o for f, o in zip(float_m, one)]
            all_but = [b - a for b, a in zip(but, all_m)]
            tiebreak = alone[1] + all_but[1] if len(fns) > 1 else 0.0
            out.append(LayerSensitivity(fqn, n, roles, alone[0], all_but[0], tiebreak))
    finally:
        model.train(was_training)
    out.sort(key=lambda s: (-s.key, -s.alone, s.fqn))
    return SensitivityReport(base, bits, name, float_m[0], all_m[0], tuple(out))


def _choose(layers: Sequence[LayerSensitivity], capacity: float, step: int) -> set[str]:
    """Names of layers to raise: max summed score with ``step · sum(n) <= capacity``."""
    cands = [s for s in layers if s.key > 0 and s.weights * step <= capacity + 1e-9]
    if len(cands) <= _EXHAUSTIVE_MAX:
        best: tuple[float, int, tuple] = (0.0, 0, ())
        for r in range(1, len(cands) + 1):
            for combo in itertools.combinations(cands, r):
                cost = sum(s.weights for s in combo) * step
                if cost <= capacity + 1e-9:
                    key = (sum(s.key for s in combo), -cost, tuple(s.fqn for s in combo))
                    if key[:2] > best[:2]:
                        best = key
        return set(best[2])
    picks = []
    for order in (sorted(cands, key=lambda s: -s.key), sorted(cands, key=lambda s: -s.key / s.weights)):
        chosen, used = [], 0.0
        for s in order:
            if used + s.weights * step <= capacity + 1e-9:
                chosen.append(s)
                used += s.weights * step
        picks.append((sum(s.key for s in chosen), {s.fqn for s in chosen}))
    return max(picks, key=lambda p: p[0])[1]


def _fill(layers: Sequence[LayerSensitivity], chosen: set[str], capacity: float, step: int) -> set[str]:
    """Spend what the budget has left on the remaining layers, most sensitive first
    (scores at or below zero are measurement noise; more bits rarely hurt)."""
    used = sum(s.weights for s in layers if s.fqn in chosen) * step
    out = set(chosen)
    for s in sorted(layers, key=lambda s: (-s.key, s.weights)):
        if s.fqn not in out and used + s.weights * step <= capacity + 1e-9:
            out.add(s.fqn)
            used += s.weights * step
    return out


def mixed_average_bits(report: SensitivityReport, high: set[str], high_bits: int) -> float:
    """Weight-count-weighted average weight bits if the layers in ``high`` get ``high_bits``."""
    total = sum(s.weights for s in report.layers)
    return sum(s.weights * (high_bits if s.fqn in high else report.bits) for s in report.layers) / total


def emit_mixed_precision(report: SensitivityReport, budget_avg_bits: float, *,
                         high_bits: int | None = None) -> QuantSpec:
    """A spec that keeps the most sensitive layers at ``high_bits`` within the budget."""
    low = report.bits
    high = high_bits if high_bits is not None else low + 1
    if high <= low:
        raise QdslError(f"high_bits ({high}) must be above the report's bits ({low})")
    if budget_avg_bits < low:
        raise QdslError(f"a budget of {budget_avg_bits} average bits is below the report's {low} bits: "
                        "nothing can be kept at higher precision")
    total = sum(s.weights for s in report.layers)
    capacity = (budget_avg_bits - low) * total
    raised = _fill(report.layers, _choose(report.layers, capacity, high - low), capacity, high - low)
    prios = [r.priority for r in report.spec.rules if r.priority is not None]
    prio = max(prios + [0]) + 1
    rules = []
    for s in sorted(report.layers, key=lambda s: s.fqn):
        b = high if s.fqn in raised else low
        roles = {Role(r): TensorQuant(bits=b) for r in s.roles}
        rules.append(Rule((Target.parse(s.fqn),), RuleBody(roles=roles), priority=prio))
    return attrs.evolve(report.spec, rules=tuple(report.spec.rules) + tuple(rules), source=None)

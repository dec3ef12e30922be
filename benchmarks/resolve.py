"""Time ``qdsl.resolve`` for a 20-rule spec against a model with 10,000 modules.

Target (issue 2): under 0.5 s on the 2-core CI machine.  Prints the median of repeats
for (a) a prebuilt torch-free ``ModelIndex`` and (b) a real ``nn.Module`` (indexing
included), plus the index build alone, measured side by side in one process.

    python benchmarks/resolve.py [--blocks 2000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from qdsl.resolve import resolve
from qdsl.resolve.plan import ModelIndex
from qdsl.spec.model import (
    Granularity,
    GranularityKind,
    Kind,
    ObserverSpec,
    QuantSpec,
    Role,
    Rule,
    RuleBody,
    Target,
    TensorQuant,
)


class Block(nn.Module):
    """conv-bn-relu + linear: 5 modules per block counting itself."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8, 8)


class Big(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))


def twenty_rule_spec() -> QuantSpec:
    w4 = TensorQuant(kind=Kind.INT, bits=4, scale="pot", granularity=Granularity(GranularityKind.CHANNEL),
                     observer=ObserverSpec("mse"))
    a8 = TensorQuant(bits=8, signed=False, observer=ObserverSpec("histogram", {"percentile": 99.9}))
    w8 = TensorQuant(extends="w4", bits=8)

    def rule(targets, priority=None, **roles):
        skip = roles.pop("skip", None)
        return Rule([Target.parse(t) for t in targets], RuleBody(roles, skip=skip), priority=priority)

    rules = [
        rule(["type:Conv2d"], weight=TensorQuant(extends="w4", scale="learned_pot")),
        rule(["type:Linear"], weight=TensorQuant(extends="w8")),
        rule(["type:ReLU"], output=TensorQuant(extends="a8")),
        rule(["blocks.*.conv"], input=TensorQuant(extends="a8", bits=6)),
        rule(["blocks.1??.fc"], weight=TensorQuant(bits=6)),
        rule(["re:blocks\\.[0-9]+5\\.conv"], weight=TensorQuant(bits=5)),
        rule(["blocks.**.bn"], output=TensorQuant(extends="a8")),
        rule(["blocks.0.conv", "blocks.1999.fc"], weight=TensorQuant(extends="w8")),
        rule(["blocks.10.conv"], skip=True),
        rule(["re:.*\\.7\\.fc"], input=TensorQuant(bits=7)),
        rule(["blocks.2*.conv"], bias=TensorQuant(bits=16)),
        rule(["type:Block"], output=TensorQuant(extends="a8")),
        rule(["blocks.5"], output=TensorQuant(bits=4)),
        rule(["re:blocks\\.3[0-9]\\.fc"], weight=TensorQuant(granularity=Granularity(GranularityKind.TENSOR))),
        rule(["blocks.4*.fc"], output=TensorQuant(extends="a8")),
        rule(["blocks.[5-6]?.conv"], weight=TensorQuant(rounding="half_away")),
        rule(["blocks.9.**"], input=TensorQuant(dynamic=True)),
        rule(["re:blocks\\.1[0-9]{2}\\.relu"], output=TensorQuant(bits=6)),
        rule(["blocks.12.fc"], weight=TensorQuant(bits=3)),
        rule(["blocks.*3.bn"], priority=1, output=TensorQuant(bits=7)),
    ]
    assert len(rules) == 20
    defaults = RuleBody({
        Role.WEIGHT: TensorQuant(extends="w8"),
        Role.INPUT: TensorQuant(extends="a8"),
        Role.BIAS: TensorQuant(kind=Kind.INT, bits=32, scale="input*weight"),
    })
    return QuantSpec(quantizers={"w4": w4, "a8": a8, "w8": w8}, defaults=defaults, rules=rules)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2000, help="5 modules per block (2000 -> 10,002 modules)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = Big(args.blocks)
    index = ModelIndex.from_module(model)
    spec = twenty_rule_spec()
    plan = resolve(index, spec)  # warm-up, and a sanity check of the result
    quantized = sum(1 for lp in plan.layers if lp.quantized)
    t_index = median_time(lambda: resolve(index, spec), args.repeats)
    t_module = median_time(lambda: resolve(model, spec), args.repeats)
    t_build = median_time(lambda: ModelIndex.from_module(model), args.repeats)
    print(f"model: {len(index)} modules, spec: {len(spec.rules)} rules, plan: {len(plan.layers)} layers "
          f"({quantized} quantized)")
    print(f"resolve(ModelIndex)       median {t_index * 1e3:8.1f} ms  (target < 500 ms)")
    print(f"resolve(nn.Module)        median {t_module * 1e3:8.1f} ms  (includes indexing)")
    print(f"ModelIndex.from_module    median {t_build * 1e3:8.1f} ms")
    print(f"repeats: {args.repeats}; {'OK' if max(t_index, t_module) < 0.5 else 'OVER BUDGET'}")


if __name__ == "__main__":
    main()

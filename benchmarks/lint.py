"""Lint speed: a 20-rule spec on a 1,000-layer model (target: under 1 s).

Prints the median of several runs for: spec-only lint, lint with the model (resolve,
torch.fx trace, per-layer checks, hygiene), and lint against a torch-free ModelIndex.
Run: ``python benchmarks/lint.py``.
"""

from __future__ import annotations

import statistics
import time

from torch import nn

from qdsl.lint import lint, load_profile
from qdsl.parse import parse_text
from qdsl.resolve.plan import ModelIndex

BLOCKS, PER_BLOCK = 100, 10  # 1,000 Linear layers (plus 1,000 ReLUs)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(PER_BLOCK) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x):
        return self.layers(x) + x


def build_model(width: int = 8) -> nn.Module:
    return nn.Sequential(*[Block(width) for _ in range(BLOCKS)])


def build_spec() -> str:
    lines = [
        "version = 1",
        "[quantizers.w8]", 'kind = "int"', "bits = 8", "narrow_range = true", 'granularity = "channel"',
        "[quantizers.a8]", 'kind = "int"', "bits = 8", "symmetric = false",
        "[defaults]", 'weight = "w8"', 'input = "a8"', 'bias = { kind = "int", bits = 32, scale = "input*weight" }',
    ]
    targets = []
    for i in range(20):
        if i % 4 == 0:
            targets.append(f'"{i * 5}.layers.{(i % PER_BLOCK) * 2}"')           # exact
        elif i % 4 == 1:
            targets.append(f'"{i * 5}.layers.*"')                              # glob
        elif i % 4 == 2:
            targets.append(f'"re:{i * 5}\\\\.layers\\\\.(0|2|4)"')                # regex
        else:
            targets.append('"type:Linear"')                                    # type
    for i, t in enumerate(targets):
        bits = 4 if i % 3 == 0 else 8
        lines += ["[[rules]]", f"target = {t}", f"priority = {i}",
                  f'weight = {{ extends = "w8", bits = {bits} }}']
    return "\n".join(lines) + "\n"


def median_time(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    model = build_model()
    index = ModelIndex.from_module(model)
    spec = parse_text(build_spec(), "bench.qspec.toml")
    profile = load_profile("tflite-int8")
    n_layers = sum(isinstance(m, nn.Linear) for m in model.modules())
    findings = lint(spec, profile, model)
    print(f"lint benchmark: {len(spec.rules)} rules, {n_layers} weighted layers "
          f"({len(index)} modules), {len(findings)} findings")
    for label, fn in (
        ("spec only", lambda: lint(spec, profile)),
        ("with model (resolve + fx trace + checks)", lambda: lint(spec, profile, model)),
        ("with ModelIndex (torch-free)", lambda: lint(spec, profile, index)),
    ):
        t = median_time(fn)
        print(f"  {label:<42} {t * 1000:8.1f} ms   {'OK' if t < 1.0 else 'SLOW'} (target < 1000 ms)")


if __name__ == "__main__":
    main()

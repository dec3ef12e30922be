"""Time the spec front ends: each example in specs/ (DSL vs TOML) and a generated large spec.

No target is set; this prints figures so regressions are visible.  Medians of repeats,
DSL and TOML measured side by side in one process (round-robin, so machine load hits
both alike).  The large spec has RULES per-layer rules, the shape a sensitivity sweep
writes, and checks that parsing stays linear in the file size.

    python benchmarks/parse.py [--repeats 7] [--rules 1000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from qdsl.parse import format_spec, parse_text

SPECS = Path(__file__).resolve().parents[1] / "specs"


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _large(rules: int) -> str:
    body = "\n".join(
        f"rule layer{i // 4}.{i % 4}.conv{1 + i % 2} optional {{ weight = (bits={2 + i % 7}, observer=mse) }}"
        for i in range(rules)
    )
    return "version 1\nquantizer a8 = int(bits=8, unsigned, observer=histogram(percentile=99.99))\n" \
           "defaults { weight = int(bits=8, per_channel) input = a8 }\n" + body + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rules", type=int, default=1000)
    args = parser.parse_args()

    cases = [(p.stem, p.read_text(), p.with_name(p.name + ".toml").read_text())
             for p in sorted(SPECS.glob("*.qspec"))]
    for rules in (args.rules // 10, args.rules):
        dsl = _large(rules)
        cases.append((f"generated-{rules}-rules", dsl, format_spec(parse_text(dsl, "g.qspec"), to="toml")))

    print(f"{'spec':28} {'chars':>8} {'qspec ms':>10} {'toml ms':>10} {'qspec/toml':>11}")
    for name, dsl, toml in cases:
        d = t = 0.0
        ds, ts = [], []
        for _ in range(args.repeats):  # round-robin: both see the same machine load
            ds.append(_median_ms(lambda: parse_text(dsl, "b.qspec"), 1))
            ts.append(_median_ms(lambda: parse_text(toml, "b.qspec.toml"), 1))
        d, t = statistics.median(ds), statistics.median(ts)
        print(f"{name:28} {len(dsl):8d} {d:10.2f} {t:10.2f} {d / t:11.1f}")


if __name__ == "__main__":
    main()

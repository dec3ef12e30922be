"""Parse throughput (KB/s) of large generated specs, DSL and TOML, at several sizes.

The spec has N per-layer rules (the shape a sensitivity sweep writes, ~65 bytes a rule in
the DSL); N = 80000 is a ~5 MB file.  Each size is parsed ``--repeats`` times, DSL and TOML
interleaved so machine load hits both alike; the median wall time and the median CPU time
of this process (less sensitive to other processes on a shared machine) are printed with
the load average.  Throughput that stays flat across sizes means parsing is linear.

    PYTHONPATH=. python benchmarks/parse_speed.py [--rules 5000 20000 80000] [--repeats 3]

``--pyparsing`` also times the DSL with the fast path disabled (every statement through
the pyparsing grammar, as before the fast path); only sensible for the small sizes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import qdsl.parse.dsl_grammar as grammar
from qdsl.parse import format_spec, parse_text
from qdsl.parse.dsl_fast import Fallback
from _timing import load_average  # benchmarks/ is the script's own directory


def generated(rules: int) -> str:
    body = "\n".join(
        f"rule layer{i // 4}.{i % 4}.conv{1 + i % 2} optional {{ weight = (bits={2 + i % 7}, observer=mse) }}"
        for i in range(rules)
    )
    return ("version 1\nquantizer a8 = int(bits=8, unsigned, observer=histogram(percentile=99.99))\n"
            "defaults { weight = int(bits=8, per_channel) input = a8 }\n" + body + "\n")


def _time(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def _no_fast_path(text, pos):
    raise Fallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", type=int, nargs="+", default=[5000, 20000, 80000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pyparsing", action="store_true", help="also time the DSL without the fast path")
    args = parser.parse_args()

    print(f"load average: {load_average()}")
    print(f"{'rules':>7} {'format':>10} {'KB':>8} {'wall s':>8} {'cpu s':>8} {'KB/s wall':>10} {'KB/s cpu':>9}")
    for n in args.rules:
        dsl = generated(n)
        texts = {"qspec": (dsl, "b.qspec"), "toml": (format_spec(parse_text(dsl, "g.qspec"), to="toml"), "b.qspec.toml")}
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in texts}
        if args.pyparsing:
            runs["pyparsing"] = []
        for _ in range(args.repeats):  # round-robin
            for fmt, (text, name) in texts.items():
                runs[fmt].append(_time(lambda: parse_text(text, name)))
            if args.pyparsing:
                fast, grammar.parse_statement_fast = grammar.parse_statement_fast, _no_fast_path
                try:
                    runs["pyparsing"].append(_time(lambda: parse_text(dsl, "b.qspec")))
                finally:
                    grammar.parse_statement_fast = fast
        for fmt, times in runs.items():
            size = len((texts.get(fmt) or texts["qspec"])[0].encode()) / 1e3
            wall = statistics.median(t[0] for t in times)
            cpu = statistics.median(t[1] for t in times)
            print(f"{n:7d} {fmt:>10} {size:8.0f} {wall:8.2f} {cpu:8.2f} {size / wall:10.0f} {size / cpu:9.0f}")
    print(f"load average: {load_average()}")


if __name__ == "__main__":
    main()

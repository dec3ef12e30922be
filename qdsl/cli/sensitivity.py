"""``qdsl sensitivity SPEC --model MODULE:FACTORY --data MODULE:LOADER --bits 3
[--emit OUT.qspec --budget 3.5]``: per-layer sensitivity table, optional mixed spec.

``--data`` names a zero-argument loader returning ``(x_train, y_train, x_test, y_test)``
(:mod:`qdsl.workflows.refs`); the first ``--calib`` training inputs calibrate, the test
set is scored.  ``--emit`` writes an ordinary spec (DSL for ``*.qspec``, TOML for
``*.toml``) that passes ``qdsl check``, with a comment header stating the average bits.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sensitivity",
        help="per-layer sensitivity to low-bit PTQ; optionally emit a mixed-precision spec",
        description="Quantize one layer at a time (and all but one) at --bits with SPEC's PTQ and print "
        "the per-layer metric drop, most sensitive first. --emit writes a mixed-precision spec that keeps "
        "the most sensitive layers at --high-bits within --budget average weight bits.",
    )
    p.add_argument("spec", help="a *.qspec or *.qspec.toml file")
    p.add_argument("--model", required=True, help="MODULE:FACTORY returning a trained nn.Module")
    p.add_argument("--data", required=True, help="MODULE:LOADER returning (x_train, y_train, x_test, y_test)")
    p.add_argument("--bits", type=int, default=3, help="bits for weights and inputs of the probed layers (default 3)")
    p.add_argument("--metric", default="accuracy", choices=("accuracy", "loss"), help="default accuracy (percent)")
    p.add_argument("--calib", type=int, default=256, help="calibration inputs (default 256)")
    p.add_argument("--emit", metavar="OUT", help="write a mixed-precision spec here (.qspec or .qspec.toml)")
    p.add_argument("--budget", type=float, help="average weight bits for --emit (weight-count weighted)")
    p.add_argument("--high-bits", type=int, help="bits of the kept layers (default --bits + 1)")
    p.set_defaults(func=run)


def run(args) -> int:
    from qdsl.parse import format_spec, load_spec
    from qdsl.workflows.sensitivity import emit_mixed_precision, mixed_average_bits, sensitivity
    from qdsl.resolve.model_ref import load_model_ref
    from qdsl.spec.diagnostics import QdslError
    from qdsl.workflows.refs import load_data_ref

    if args.emit and args.budget is None:
        raise QdslError("--emit needs --budget (the average weight bits of the mixed spec, e.g. 3.5)")
    if args.budget is not None and not args.emit:
        raise QdslError("--budget is only used with --emit OUT.qspec")
    if not 1 <= args.bits <= 16:
        raise QdslError(f"--bits must be in 1..16, got {args.bits}")
    if args.calib < 1:
        raise QdslError(f"--calib must be >= 1, got {args.calib}")
    spec = load_spec(args.spec)  # fail fast on a bad spec, before loading anything heavy
    model = load_model_ref(args.model).eval()
    x_train, _y_train, x_test, y_test = load_data_ref(args.data)
    report = sensitivity(model, spec, (x_train[: args.calib], x_test, y_test), args.metric, args.bits,
                         progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(report.format())
    if args.emit:
        mixed = emit_mixed_precision(report, args.budget, high_bits=args.high_bits)
        high = args.high_bits if args.high_bits is not None else args.bits + 1
        kept = sorted(r.targets[0].pattern for r in mixed.rules[len(report.spec.rules):]
                      if any(tq.bits == high for tq in r.body.roles.values()))
        avg = mixed_average_bits(report, set(kept), high)
        out = Path(args.emit)
        fmt = "toml" if out.name.endswith(".toml") else "qspec"
        header = (f"# mixed precision from `qdsl sensitivity {args.spec} --bits {args.bits}`: "
                  f"{len(kept)} of {len(report.layers)} layers at {high} bits, the rest at {args.bits};\n"
                  f"# average weight bits {avg:.3f} (budget {args.budget}, weight-count weighted)\n")
        out.write_text(header + format_spec(mixed, fmt))
        print(f"wrote {out} ({', '.join(kept) or 'no layer'} at {high} bits; average {avg:.3f} bits)")
    return 0

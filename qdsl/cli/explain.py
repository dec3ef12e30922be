"""``qdsl explain SPEC --model MODULE:FACTORY``: where every resolved field came from.

Prints the provenance table of DESIGN.md §8 (layer, role, field, value, set by), or
with ``--format json`` the full records (``qdsl.resolve.to_records``).  ``--layer``
takes globs over layer names (repeatable), ``--role`` role names.  Bad specs or models
exit 2 with located diagnostics.  After the table: what the spec reaches but stays in
float, and quantized modules called more than once (:mod:`qdsl.patch.coverage`; JSON
keys ``left_float``, ``shared``, ``untraced``).
"""

from __future__ import annotations

import json

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "explain",
        help="show, per layer and field, which rule set each value",
        description="Resolve SPEC against a model and print where every field of every quantizer came from.",
    )
    p.add_argument("spec", metavar="SPEC", help="spec file (.qspec or .qspec.toml)")
    p.add_argument("--model", metavar="MODULE:FACTORY", required=True,
                   help="the model, e.g. qdsl.zoo.models:digits_resnet or path/to/file.py:build")
    p.add_argument("--layer", action="append", metavar="GLOB",
                   help="only layers whose name matches this glob (repeatable; ** crosses dots)")
    p.add_argument("--role", action="append", choices=("weight", "bias", "input", "output"),
                   help="only these roles (repeatable)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="override a field, e.g. --set weight.bits=4 (repeatable)")
    p.set_defaults(func=run)


def run(args) -> int:
    from qdsl.resolve import explain, load_model_ref, resolve, to_records
    from qdsl.resolve.explain import positional_targets

    from qdsl.patch.coverage import check_coverage
    from qdsl.patch.implied import with_implied
    from qdsl.patch.trace import trace_model

    model = load_model_ref(args.model)
    trace = trace_model(model)
    # the plan apply patches with: implied quantizers show as "implied by <op> in '<where>'"
    plan = with_implied(model, trace, resolve(model, args.spec, overrides=args.overrides or None))
    coverage = check_coverage(model, plan, trace)
    if args.format == "json":
        records = to_records(plan, args.layer, args.role)
        left = [{"name": f.name, "reason": f.reason, "reached_by": f.reached_by,
                 "at": f.span.location() if f.span.known else None} for f in coverage.floats]
        shared = [{"name": f.name, "reason": f.reason} for f in coverage.shared]
        print(json.dumps({"spec": str(args.spec), "model": args.model, "rows": records,
                          "left_float": left, "shared": shared, "untraced": coverage.untraced,
                          "positions": positional_targets(plan)}, indent=2))
    else:
        print(explain(plan, args.layer, args.role))
        for text in (coverage.report(), coverage.shared_report() if coverage.shared else ""):
            if text:
                print("\n" + text)
    return 0

"""``qdsl explain SPEC --model MODULE:FACTORY``: where every resolved field came from.

Prints the provenance table of DESIGN.md §8 (layer, role, field, value, set by), or
with ``--format json`` the full records (``qdsl.resolve.to_records``).  ``--layer``
takes globs over layer names (repeatable), ``--role`` role names.  Bad specs or models
exit 2 with located diagnostics.  After the table: what the spec reaches but stays in
float, and quantized modules called more than once (:mod:`qdsl.patch.coverage`; JSON
keys ``left_float``, ``shared``, ``untraced``).  Then the PTQ steps each weighted layer
will try after the observers and who chose them (``auto`` by bit width, or the spec;
:mod:`qdsl.resolve.ptq_policy`; JSON ``ptq_steps``).  With ``--data MODULE:LOADER`` the
model is also calibrated (``--calib`` training inputs, in batches of 64) and the PTQ
report says, per layer and step, what was kept and the held-back error before -> after
(JSON ``ptq_report``).
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
    p.add_argument("--data", metavar="MODULE:LOADER",
                   help="calibrate on this data (a loader returning x_train, y_train, x_test, y_test) "
                        "and print what each PTQ step kept, per layer")
    p.add_argument("--calib", type=int, default=256, metavar="N", help="calibration inputs with --data (default 256)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="override a field, e.g. --set weight.bits=4 (repeatable)")
    p.set_defaults(func=run)


def run(args) -> int:
    from qdsl.resolve import explain, load_model_ref, resolve, to_records
    from qdsl.resolve.explain import positional_targets
    from qdsl.resolve.ptq_policy import format_layer_steps, layer_steps

    from qdsl.patch.coverage import check_coverage
    from qdsl.patch.implied import with_implied
    from qdsl.patch.trace import trace_model

    model = load_model_ref(args.model)
    trace = trace_model(model)
    # the plan apply patches with: implied quantizers show as "implied by <op> in '<where>'"
    plan = with_implied(model, trace, resolve(model, args.spec, overrides=args.overrides or None))
    coverage = check_coverage(model, plan, trace)
    steps = layer_steps(plan)
    ptq = _calibrated_report(model, args) if args.data else None
    if args.format == "json":
        records = to_records(plan, args.layer, args.role)
        left = [{"name": f.name, "reason": f.reason, "reached_by": f.reached_by,
                 "at": f.span.location() if f.span.known else None} for f in coverage.floats]
        shared = [{"name": f.name, "reason": f.reason} for f in coverage.shared]
        print(json.dumps({"spec": str(args.spec), "model": args.model, "rows": records,
                          "left_float": left, "shared": shared, "untraced": coverage.untraced,
                          "positions": positional_targets(plan),
                          "ptq_steps": [{"layer": s.fqn, "bits": s.bits, "learned_rounding": s.learned_rounding,
                                         "learned_rounding_by": s.learned_rounding_by,
                                         "bias_correction": s.bias_correction,
                                         "bias_correction_by": s.bias_correction_by} for s in steps],
                          "ptq_report": None if ptq is None else [
                              {"layer": d.layer, "step": d.step, "kept": d.kept, "error_before": _num(d.error_before),
                               "error_after": _num(d.error_after), "note": d.note} for d in ptq]}, indent=2))
    else:
        print(explain(plan, args.layer, args.role))
        for text in (coverage.report(), coverage.shared_report() if coverage.shared else ""):
            if text:
                print("\n" + text)
        print("\n" + format_layer_steps(steps))
        if ptq is not None:
            print("\nPTQ report (calibrated on --data; held-back error = the layer's output MSE vs float):")
            print(ptq.format())
    return 0


def _num(v: float):
    return None if v != v else v  # NaN is not JSON


def _calibrated_report(model, args):
    """Apply, calibrate on ``--data`` (PTQ steps included), take the report, remove."""
    import qdsl
    from qdsl.ptq import PtqReport, ptq_report
    from qdsl.workflows.refs import load_data_ref

    x_train = load_data_ref(args.data)[0]
    n = min(args.calib, len(x_train))
    model.eval()
    qdsl.apply(model, args.spec, overrides=args.overrides or None)
    try:
        qdsl.calibrate(model, [x_train[i : i + 64] for i in range(0, n, 64)], progress=False)
        return ptq_report(model) or PtqReport()
    finally:
        qdsl.remove(model)

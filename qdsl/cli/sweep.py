"""``qdsl sweep SPEC --model MODULE:FACTORY --data MODULE:LOADER --set weight.bits=8,6,4,3,2``."""

from __future__ import annotations

import sys

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sweep",
        help="PTQ (optionally QAT) a trained model at several settings; print accuracy and size",
        description="Quantize a trained model with SPEC at each setting and print a table "
        "(and write CSV / a PNG plot). Lists given to several --set are zipped.",
    )
    p.add_argument("spec", help="a *.qspec or *.qspec.toml file")
    p.add_argument("--model", required=True, help="MODULE:FACTORY returning a trained nn.Module")
    p.add_argument("--data", required=True, help="MODULE:LOADER returning (x_train, y_train, x_test, y_test)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=V1,V2",
                   help="values to sweep, e.g. weight.bits=8,6,4,3,2 (repeatable)")
    p.add_argument("--product", action="store_true", help="cartesian product of the --set lists instead of zip")
    p.add_argument("--calib", type=int, default=256, help="calibration images (default 256)")
    p.add_argument("--qat-epochs", type=int, default=0, help="QAT epochs after calibration (default 0: PTQ only)")
    p.add_argument("--csv", help="write the table as CSV here")
    p.add_argument("--plot", help="write accuracy vs size as a PNG here (needs matplotlib)")
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 2) when the spec reaches modules or ops that would stay float")
    p.set_defaults(func=run)


def run(args) -> int:
    from qdsl.parse import load_spec
    from qdsl.resolve.model_ref import load_model_ref
    from qdsl.workflows.refs import load_data_ref
    from qdsl.workflows.sweep import expand_settings, format_table, plot, sweep, write_csv

    spec = load_spec(args.spec)  # fail fast on a bad spec, before loading anything heavy
    settings = expand_settings(args.sets, product=args.product)
    model = load_model_ref(args.model).eval()
    data = load_data_ref(args.data)
    points = sweep(model, spec, data, settings, calib=args.calib, qat_epochs=args.qat_epochs,
                   progress=lambda msg: print(msg, file=sys.stderr, flush=True), strict=args.strict)
    print(format_table(points))
    if args.csv:
        write_csv(points, args.csv)
        print(f"wrote {args.csv}")
    if args.plot:
        if plot(points, args.plot):
            print(f"wrote {args.plot}")
        else:
            print("--plot: matplotlib is not installed; no plot written", file=sys.stderr)
    return 0

"""``qdsl lint SPEC --hw PROFILE [--model MODULE:FACTORY] [--format text|json|sarif] [--set K=V]``.

Exit codes: 0 no findings, 1 findings (errors or warnings), 2 unusable input (a spec or
profile that does not parse or is invalid on its own, a model that does not load) -
the latter raised as ``QdslError`` and printed by ``qdsl.cli.main`` without a traceback.
The report goes to stdout in every format, so ``--format sarif > lint.sarif`` works.
"""

from __future__ import annotations

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "lint",
        help="check a spec against a hardware capability profile",
        description="Report every conflict between SPEC and what the target hardware supports "
        "(exit 0 clean, 1 findings, 2 unusable input).",
    )
    p.add_argument("spec", metavar="SPEC", help="spec file (.qspec or .qspec.toml)")
    p.add_argument("--hw", required=True, metavar="PROFILE",
                   help="hardware profile: a .toml path or a bundled name (tflite-int8, x86-fbgemm, "
                   "pot-asic-24bit-acc, xnor-fpga, int-only-photonic)")
    p.add_argument("--model", metavar="MODULE:FACTORY",
                   help="also check the resolved plan per layer, e.g. qdsl.zoo.models:digits_resnet")
    p.add_argument("--format", choices=("text", "json", "sarif"), default="text")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="override a field, e.g. --set weight.bits=4 (repeatable)")
    p.set_defaults(func=run)


def run(args) -> int:
    from qdsl import __version__
    from qdsl.lint import lint, load_profile, render_text, to_json, to_sarif

    profile = load_profile(args.hw)
    model = None
    if args.model:
        from qdsl.resolve import load_model_ref

        model = load_model_ref(args.model)
    diags = lint(args.spec, profile, model, overrides=args.overrides or None)
    if args.format == "json":
        print(to_json(diags, profile.name))
    elif args.format == "sarif":
        print(to_sarif(diags, profile.name, __version__))
    else:
        print(render_text(diags, profile.name))
    return 1 if any(d.severity.value in ("error", "warning") for d in diags) else 0

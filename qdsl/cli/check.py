"""``qdsl check SPEC [--model MODULE:FACTORY] [--set K=V ...]``: validate a spec.

Reads the spec (either front end), applies ``--set`` overrides, runs every model-free
check and, with ``--model``, resolves it against the model too.  Prints
``ok: SPEC (N presets, M rules[, K layers quantized, F left float])`` and exits 0, or
prints every diagnostic in the house format and exits 2.  Warnings are printed but do
not fail.  With ``--model``, every module and functional op the spec reaches but qdsl
leaves in float (``nn.Embedding``, ``torch.matmul``...; :mod:`qdsl.patch.coverage`) and every
quantized module called more than once is listed on stderr; ``--strict`` makes the
former an error (exit 2, ``E505``), as ``qdsl.apply(..., strict=True)`` does.  Ops export has
no integer lowering for (W321, :mod:`qdsl.lint.lowering`) are warnings.
"""

from __future__ import annotations

import sys

__all__ = ["add_parser", "run"]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "check",
        help="validate a spec (and resolve it against a model)",
        description="Validate a .qspec / .qspec.toml file; with --model, also resolve it against that model.",
    )
    p.add_argument("spec", metavar="SPEC", help="spec file (.qspec or .qspec.toml)")
    p.add_argument("--model", metavar="MODULE:FACTORY",
                   help="also resolve against this model, e.g. qdsl.zoo.models:digits_resnet or file.py:build")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V",
                   help="override a field, e.g. --set weight.bits=4 (repeatable)")
    p.add_argument("--strict", action="store_true",
                   help="with --model: fail when the spec reaches modules or ops that would stay float")
    p.set_defaults(func=run)


def run(args) -> int:
    from qdsl.resolve import check_spec, load_model_ref, resolve
    from qdsl.resolve.resolver import load_for_resolve
    from qdsl.spec.diagnostics import render_all

    spec = load_for_resolve(args.spec, args.overrides or None)
    model = load_model_ref(args.model) if args.model else None
    diags = check_spec(spec)
    if not any(d.is_error for d in diags):
        # what export would refuse whatever the model (W320): a warning, the spec still trains
        from qdsl.lint.export_width import export_width_findings
        from qdsl.resolve.check import compose_if_needed, prepare

        diags += export_width_findings(prepare(compose_if_needed(spec)))
    if model is None and any(d.is_error for d in diags):
        print(render_all(diags), file=sys.stderr)
        return 2
    summary = f"{_plural(len(spec.quantizers), 'preset')}, {_plural(len(spec.rules), 'rule')}"
    if model is not None:
        # resolve repeats the model-free checks and adds the model's, so a spec with
        # problems of both kinds is reported in one pass (SpecError -> exit 2 in main)
        plan = resolve(model, spec)
        summary += f", {_plural(sum(1 for lp in plan.layers if lp.quantized), 'layer')} quantized"
        # torch is loaded anyway (the model); the coverage check needs its fx trace
        from qdsl.patch.coverage import check_coverage
        from qdsl.patch.trace import trace_model

        coverage = check_coverage(model, plan, trace_model(model))
        if args.strict and coverage.floats:
            raise coverage.error()
        if coverage.floats:
            summary += f", {len(coverage.floats)} left float"
        for text in (coverage.report(), coverage.shared_report() if coverage.shared else ""):
            if text:
                print(text, file=sys.stderr)
        # ops export has no lowering for (W321, the catalog lint reads): a warning, the model still trains
        from qdsl.lint.graph import model_graph
        from qdsl.lint.lowering import lowering_findings

        diags += lowering_findings(model_graph(model), args.model, plan)
    elif args.strict:
        print("note: --strict checks what a model leaves in float; it needs --model", file=sys.stderr)
    if diags:
        print(render_all(diags), file=sys.stderr)
    print(f"ok: {args.spec} ({summary})")
    return 0

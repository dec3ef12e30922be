"""``qdsl fmt SPEC [--to toml|qspec] [-o OUT | --in-place | --check]``: convert or canonicalise a spec.

Reads one file raw (includes are kept as ``include`` lines, not merged), prints its
opening comment block and then its canonical form in the requested syntax to stdout, or writes it to ``-o OUT``.  The input
file is only ever rewritten with ``--in-place`` (and only when the syntax stays the
same, so a ``.qspec`` never ends up holding TOML).
"""

from __future__ import annotations

import argparse
import os
import sys

from qdsl.spec.diagnostics import QdslError

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "fmt",
        help="print a spec in canonical .qspec or .qspec.toml form (converts both ways)",
        description="Print SPEC in canonical form; --to converts between the DSL and TOML.",
    )
    p.add_argument("spec", help="a .qspec or .qspec.toml file")
    p.add_argument("--to", choices=("qspec", "toml"), default=None,
                   help="output syntax (default: the input's own syntax)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    out.add_argument("--in-place", action="store_true", help="rewrite SPEC itself (same syntax only)")
    out.add_argument("--check", action="store_true",
                     help="write nothing; exit 1 if SPEC is not already in canonical form (for CI)")
    p.set_defaults(func=run)


def _leading_comments(text: str) -> str:
    """The file's opening comment block (both syntaxes use ``#``), kept above the output.

    Spec records hold no comments, so comments elsewhere in the file are not preserved.
    """
    lines = []
    for line in text.splitlines():
        if not line.lstrip().startswith("#"):
            break
        lines.append(line.rstrip() + "\n")
    return "".join(lines)


def run(args: argparse.Namespace) -> int:
    from qdsl.parse import detect_format, format_spec, parse_file

    spec = parse_file(args.spec)
    source_fmt = detect_format(args.spec)
    to = args.to or source_fmt
    with open(args.spec, encoding="utf-8-sig") as fh:
        original = fh.read()
    text = _leading_comments(original) + format_spec(spec, to=to)
    if args.check:
        if to != source_fmt:
            raise QdslError("--check compares SPEC with its canonical form in its own syntax; drop --to")
        if original == text:
            return 0
        print(f"{args.spec}: not in canonical form (run qdsl fmt --in-place {args.spec})", file=sys.stderr)
        return 1
    if args.in_place:
        if to != source_fmt:
            raise QdslError(f"--in-place would write {to} syntax into {args.spec}; use -o OUT to convert")
        target = args.spec
    elif args.output:
        if os.path.exists(args.output) and os.path.samefile(args.output, args.spec):
            raise QdslError(f"-o {args.output} is the input file; pass --in-place to rewrite it")
        target = args.output
    else:
        sys.stdout.write(text)
        return 0
    try:
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        raise QdslError(f"cannot write {target}: {exc.strerror or exc}") from None
    return 0

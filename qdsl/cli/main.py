"""``qdsl`` entry point: dispatch to subcommand modules and turn user errors into exit 2.

Each subcommand lives in ``qdsl/cli/<name>.py`` and defines::

    def add_parser(subparsers) -> None   # adds its parser, sets defaults(func=run)
    def run(args) -> int                 # the exit code

A user mistake (any ``QdslError``, ``SpecError`` included) prints its rendered message
to stderr and exits 2 - never a traceback.  ``QDSL_DEBUG=1`` re-raises for developers.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

__all__ = ["main", "COMMANDS"]

COMMANDS = ("check", "fmt", "explain", "lint", "run", "sweep", "sensitivity", "demo")
"""Subcommands in help order; a module that is not present is simply not offered."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qdsl", description="Declarative quantization for PyTorch.")
    from qdsl import __version__

    parser.add_argument("--version", action="version", version=f"qdsl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        modname = f"qdsl.cli.{name}"
        if importlib.util.find_spec(modname) is None:
            continue
        importlib.import_module(modname).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from qdsl.spec.diagnostics import QdslError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except QdslError as err:
        if os.environ.get("QDSL_DEBUG"):
            raise
        print(str(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

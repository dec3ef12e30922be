"""AST of the ``.qspec`` DSL: what the pyparsing grammar builds, with source offsets.

Every node carries ``start``/``end`` character offsets into the file (end exclusive);
``qdsl.parse.lower`` turns them into spans and the nodes into the located value tree.
The grammar is deliberately generic where the schema is open (call arguments, body
statements), so misspelled names become E1xx schema errors with did-you-mean instead
of opaque syntax errors.
"""

from __future__ import annotations

from typing import Union

import attrs

__all__ = [
    "Name",
    "Num",
    "Str",
    "Product",
    "Arg",
    "Call",
    "Value",
    "BodyStmt",
    "Body",
    "TargetText",
    "RuleOption",
    "VersionStmt",
    "SettingStmt",
    "IncludeStmt",
    "QuantizerStmt",
    "DefaultsStmt",
    "RuleStmt",
    "Statement",
]


@attrs.frozen
class Name:
    """An identifier: ``w4pot``, ``signed``, ``true``."""

    text: str
    start: int
    end: int


@attrs.frozen
class Num:
    """An integer or float literal."""

    value: int | float
    start: int
    end: int


@attrs.frozen
class Str:
    """A quoted string, already unescaped (``"..."`` with escapes or raw ``'...'``)."""

    value: str
    start: int
    end: int


@attrs.frozen
class Product:
    """``input*weight``: the derived bias scale."""

    left: Name
    right: Name
    start: int
    end: int


@attrs.frozen
class Arg:
    """One call argument: ``key=value`` or a bare value (a flag such as ``signed``)."""

    key: Name | None
    value: "Value"
    start: int
    end: int


@attrs.frozen
class Call:
    """``head(args)``; ``head`` is None for an anonymous field list ``(bits=4)``."""

    head: Name | None
    args: tuple[Arg, ...]
    start: int
    end: int


Value = Union[Name, Num, Str, Product, Call]


@attrs.frozen
class BodyStmt:
    """Inside ``defaults { }`` / ``rule ... { }``: ``name = value``, ``name(args)`` or ``name``."""

    name: Name
    value: Value | None
    call: Call | None
    start: int
    end: int


@attrs.frozen
class Body:
    """A braced block; ``start`` is the ``{``."""

    stmts: tuple[BodyStmt, ...]
    start: int
    end: int


@attrs.frozen
class TargetText:
    """A rule target as the text ``Target.parse`` classifies (``type:Conv2d``, ``re:...``)."""

    text: str
    start: int
    end: int


@attrs.frozen
class RuleOption:
    """``optional``, ``priority N`` or ``as NAME``."""

    word: Name
    value: Num | Name | Str | None
    start: int
    end: int


@attrs.frozen
class VersionStmt:
    value: Num
    start: int
    end: int


@attrs.frozen
class SettingStmt:
    """``fold_bn``, ``bias_correction = false``, ``learned_rounding = adaround``."""

    name: Name
    value: Value | None
    start: int
    end: int


@attrs.frozen
class IncludeStmt:
    path: Str
    start: int
    end: int


@attrs.frozen
class QuantizerStmt:
    name: Name
    value: Value
    start: int
    end: int


@attrs.frozen
class DefaultsStmt:
    body: Body
    start: int
    end: int


@attrs.frozen
class RuleStmt:
    targets: tuple[TargetText, ...]
    options: tuple[RuleOption, ...]
    body: Body
    start: int
    end: int


Statement = Union[VersionStmt, SettingStmt, IncludeStmt, QuantizerStmt, DefaultsStmt, RuleStmt]

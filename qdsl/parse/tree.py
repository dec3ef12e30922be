"""The located value tree both front ends produce before lowering.

A :class:`Node` is a TOML-shaped value (str, int, float, bool, list of nodes, dict of
nodes) plus where it is written.  The TOML front end builds it straight from
:class:`LocatedToml`; the DSL front end desugars its AST into the *same* shape
(``int(bits=4, per_channel)`` becomes ``{kind = "int", bits = 4, granularity =
"channel"}``).  So one schema (``qdsl.parse.schema``) validates both syntaxes and
their error messages agree.
"""

from __future__ import annotations

from typing import Any, Iterator

import attrs

from qdsl.parse.located_toml import LocatedToml, TomlPath
from qdsl.spec.diagnostics import Span

__all__ = ["Node", "node_from_toml"]


@attrs.define(eq=False)
class Node:
    """A value with its span; ``key_span`` is where its key is written (table entries)."""

    value: Any
    span: Span
    key_span: Span | None = None
    form: str = ""
    """How the value was written when that matters for a message (``"name"`` for a DSL
    identifier, ``"call"`` for ``f(...)``); empty for plain TOML values."""

    @property
    def is_table(self) -> bool:
        return isinstance(self.value, dict)

    @property
    def is_array(self) -> bool:
        return isinstance(self.value, list)

    @property
    def where(self) -> Span:
        """The key's span if there is one, else the value's."""
        return self.key_span or self.span

    def items(self) -> Iterator[tuple[str, "Node"]]:
        return iter(self.value.items()) if isinstance(self.value, dict) else iter(())

    def plain(self) -> Any:
        """The value without spans (nested nodes unwrapped)."""
        if isinstance(self.value, dict):
            return {k: v.plain() for k, v in self.value.items()}
        if isinstance(self.value, list):
            return [v.plain() for v in self.value]
        return self.value


def node_from_toml(lt: LocatedToml, path: TomlPath = ()) -> Node:
    """The subtree of ``lt`` at ``path`` as nodes, every value and key located."""

    def build(value: Any, p: TomlPath) -> Node:
        if isinstance(value, dict):
            inner: Any = {k: build(v, p + (k,)) for k, v in value.items()}
        elif isinstance(value, list):
            inner = [build(v, p + (i,)) for i, v in enumerate(value)]
        else:
            inner = value
        key_span = lt.key_span(p) if p and isinstance(p[-1], str) else None
        return Node(inner, lt.span(p) if p else lt.span(()), key_span)

    root = build(lt.get(path), tuple(path))
    if not path:
        root.span = Span(lt.filename, 1, 1, 1, 2, source=lt.text)
    return root

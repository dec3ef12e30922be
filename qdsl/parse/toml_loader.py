"""The TOML front end: ``*.qspec.toml`` text -> ``QuantSpec``.

The text is read by :func:`read_located_toml` (syntax errors are E001 at tomllib's
line:col), turned into the located value tree, and lowered by the schema shared with
the DSL, so every schema error names the offending key or value's file:line:col.
"""

from __future__ import annotations

from qdsl.parse.located_toml import read_located_toml
from qdsl.parse.schema import lower_tree
from qdsl.parse.tree import node_from_toml
from qdsl.spec.model import QuantSpec

__all__ = ["parse_toml"]


def parse_toml(text: str, filename: str = "<input>") -> QuantSpec:
    """Parse a ``.qspec.toml`` text; raises ``SpecError`` with every problem found."""
    return lower_tree(node_from_toml(read_located_toml(text, filename)))

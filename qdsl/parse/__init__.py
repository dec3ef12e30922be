"""Spec front ends (TOML and the .qspec DSL), composition and formatting; never imports torch."""

from qdsl.parse.located_toml import LocatedToml, read_located_toml

__all__ = ["LocatedToml", "read_located_toml"]

"""Nothing outside the number formats branches on a concrete quantizer kind.

What differs between kinds is asked of the kind's number format (qdsl/spec/formats.py for
the torch-free facts, qdsl/quantizers/formats/ for the torch ops), so adding a kind is a
new format plus its registration (docs/architecture.md, "Number formats").  This scans
every module's AST for a *branch* on a ``Kind`` member:

* ``Kind.X`` inside a comparison (``kind is Kind.BINARY``, ``k in (Kind.INT, Kind.POT)``,
  ``v == Kind.FLOAT.value``),
* ``Kind.X`` as a dict key (a dispatch table ``{Kind.BINARY: 1, ...}``) or one of two or
  more ``Kind`` members in a tuple/list/set (a kind list used for membership),
* a comparison of something named ``*kind*`` with a built-in kind's name as a string.

Using a member as a *value* (``QuantizerRecipe(Kind.INT, ...)``, a default) is fine.
``ALLOWED`` lists, per file, how many branches are left and why; the count must match
exactly, so converting one means lowering the count here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from qdsl.spec.model import Kind

ROOT = Path(__file__).resolve().parents[1] / "qdsl"
FORMAT_HOMES = ("spec/formats.py", "quantizers/formats/")
MEMBERS = {k.name for k in Kind}
NAMES = {k.value for k in Kind}

ALLOWED: dict[str, tuple[int, str]] = {}


def _is_member(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Kind"
            and node.attr in MEMBERS)


def _branches(tree: ast.AST) -> list[int]:
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    lines: list[int] = []
    for node in ast.walk(tree):
        if _is_member(node):
            up, child = parents.get(node), node
            while isinstance(up, (ast.Attribute, ast.Tuple, ast.List, ast.Set)):  # Kind.X.value, (Kind.X, ...)
                up, child = parents.get(up), up
            if isinstance(up, ast.Compare) or (isinstance(up, ast.Dict) and child in up.keys):
                lines.append(node.lineno)
                continue
            container = parents.get(node)
            if isinstance(container, (ast.Tuple, ast.List, ast.Set)) and sum(map(_is_member, container.elts)) >= 2:
                lines.append(node.lineno)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any("kind" in ast.unparse(s).lower() and "rescale" not in ast.unparse(s).lower()
                        and "granularity" not in ast.unparse(s).lower() for s in sides)
            strings = any(isinstance(s, ast.Constant) and s.value in NAMES for s in sides)
            if named and strings:
                lines.append(node.lineno)
    return sorted(set(lines))


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py")
                  if not any(str(p.relative_to(ROOT)).startswith(home) for home in FORMAT_HOMES))


def test_scan_finds_branches():
    src = ("if kind is Kind.BINARY: pass\nx = {Kind.INT: 1}\nok = k in (Kind.INT, Kind.POT)\n"
           "f = v == Kind.FLOAT.value\ng = li.weight_kind == 'pot'\n"
           "r = QuantizerRecipe(Kind.INT, 8)\nd = a if b else Kind.INT\nh = {'kind': Kind.FLOAT}\n")
    assert _branches(ast.parse(src)) == [1, 2, 3, 4, 5]


def test_no_kind_branches_outside_the_formats():
    found = {}
    for path in _modules():
        lines = _branches(ast.parse(path.read_text(), str(path)))
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    unexpected = {f: ls for f, ls in found.items() if f not in ALLOWED or len(ls) != ALLOWED[f][0]}
    stale = sorted(f for f in ALLOWED if f not in found)
    assert not unexpected and not stale, (
        f"branches on a Kind member outside the number formats: {unexpected} (ask the format instead: "
        f"qdsl/spec/formats.py, qdsl/quantizers/formats/); allow-list entries with no branch left: {stale}")


@pytest.mark.parametrize("path", sorted(ALLOWED))
def test_allow_list_entries_have_reasons(path):
    count, reason = ALLOWED[path]
    assert count > 0 and len(reason) > 20

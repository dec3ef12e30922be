"""Imports flow one way (docs/architecture.md, "Layers"; DESIGN.md §9).

``LAYERS`` below is the layer order, lowest first: a module may import its own package
and the packages of *lower* layers only; packages that share a layer (``ptq`` and
``qat``) may not import each other.  The scan reads the AST of every module under
``qdsl/``, so it sees

* ``import``/``from ... import`` anywhere, including inside functions (lazy imports)
  and relative imports;
* string references to qdsl modules: ``importlib.import_module("qdsl.x")`` and
  ``"qdsl.x.y:attr"`` part factories (a string counts when it names an existing qdsl
  module, so docstrings and messages do not);
* the façade: ``import qdsl`` followed by ``qdsl.apply(...)`` is an import of whatever
  ``qdsl.apply`` resolves to (the lazy table in qdsl/__init__.py).

``qdsl.spec``, ``qdsl.parse``, ``qdsl.resolve.plan`` and ``qdsl.graph`` must never import
torch, so specs and graphs can be checked without it; checked in a subprocess so this
test's own imports do not interfere.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "qdsl"

# lowest first; a tuple is one layer of peers.  "<facade>" is qdsl/__init__.py (the lazy
# public names, which name every layer) and qdsl/__main__.py.
LAYERS: list[tuple[str, ...]] = [
    ("_callable", "spec", "_native_files"),  # torch-free: records, diagnostics, part declarations; the .so's place
    ("parse",),              # torch-free: TOML and DSL front ends
    ("resolve",),            # torch-free: spec + model index -> Plan
    ("graph",),              # torch-free: integer-graph IR, validation, .qgraph, reference executor, requant
    ("quantizers",),         # torch parts: observers, scales, roundings, STE, the proxy, its gradient path
    ("patch",),              # hooks and parametrizations on an unmodified model
    ("calibration",),        # calibrate / freeze / DDP observer sync; PTQ steps plug in
    ("ptq", "qat"),          # what runs after the observers / training
    ("export",),             # frozen model -> graph
    ("runtime",),            # the compiled C++ runtime, run_graph
    ("lint",),               # plans, graphs and models against hardware profiles
    ("api",),                # qdsl.apply (hw=) and qdsl.calibrate (PTQ steps) composed
    ("zoo",),                # reference models, shipped data, training helpers
    ("workflows",),          # sweeps, demo, sensitivity: whole cycles through the façade
    ("cli",),
    ("<facade>",),
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

_STRING_REF = re.compile(r"qdsl(\.[A-Za-z_]\w*)+(:\w*)?")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "<facade>"
    return parts[1]


def _existing(name: str) -> str | None:
    """The longest prefix of ``name`` that is a qdsl module or package."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def _facade_table() -> dict[str, str]:
    tree = ast.parse(MODULES["qdsl"].read_text())
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "_LAZY":
            return {k: v.split(":")[0] for k, v in ast.literal_eval(node.value).items()}
    raise AssertionError("qdsl/__init__.py has no _LAZY table")


FACADE = _facade_table()


def _imports(module: str, path: Path) -> list[tuple[int, str, str]]:
    """``(line, what was written, qdsl module it reaches)`` for every qdsl import of ``module``."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found: list[tuple[int, str, str]] = []

    def add(line: int, text: str, target: str | None) -> None:
        if target is not None and target != "qdsl":
            found.append((line, text, target))

    facade_names = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "qdsl":
                    facade_names = True
                elif alias.name.startswith("qdsl."):
                    add(node.lineno, f"import {alias.name}", _existing(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if src != "qdsl" and not src.startswith("qdsl."):
                continue
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                if sub in MODULES:
                    add(node.lineno, f"from {src} import {alias.name}", sub)
                elif src == "qdsl" and alias.name in FACADE:
                    add(node.lineno, f"from qdsl import {alias.name}", FACADE[alias.name])
                elif src != "qdsl":
                    add(node.lineno, f"from {src} import {alias.name}", _existing(src))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _STRING_REF.fullmatch(node.value):
            add(node.lineno, repr(node.value), _existing(node.value.split(":")[0]))
    if facade_names:  # ``import qdsl`` then ``qdsl.apply(...)``: the façade's target
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "qdsl":
                target = FACADE.get(node.attr) or _existing(f"qdsl.{node.attr}")
                add(node.lineno, f"qdsl.{node.attr}", target)
    return found


def _violations() -> list[str]:
    bad = []
    for module, path in MODULES.items():
        src = _layer_of(module)
        for line, text, target in _imports(module, path):
            dst = _layer_of(target)
            if dst == src:
                continue
            if RANK[dst] >= RANK[src]:
                how = "a peer" if RANK[dst] == RANK[src] else "a higher layer"
                bad.append(f"{path.relative_to(ROOT)}:{line}: {text} reaches {target} ({dst}), {how} than {src}")
    return bad


def test_every_package_has_a_layer():
    packages = {_layer_of(m) for m in MODULES}
    assert packages <= set(RANK), f"place these packages in LAYERS: {sorted(packages - set(RANK))}"


def test_imports_flow_one_way():
    bad = _violations()
    assert not bad, "imports that go up or sideways (see LAYERS in this file):\n" + "\n".join(bad)


def test_no_package_cycle():
    # implied by the test above; kept separate so a cycle is named as one
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for _, _, target in _imports(module, path):
            if _layer_of(target) != _layer_of(module):
                edges.setdefault(_layer_of(module), set()).add(_layer_of(target))
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("package import cycle: " + " -> ".join(stack[stack.index(nxt):] + [node, nxt]))
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])


def test_scan_sees_lazy_string_and_facade_imports(tmp_path, monkeypatch):
    """The scanner itself: each kind of reference in a module of a low layer is reported."""
    src = (
        "import importlib\n"
        "def f():\n"
        "    from qdsl.lint import enforce\n"
        "    importlib.import_module('qdsl.runtime')\n"
        "    return 'qdsl.qat.bn_fold:prepare_qat', 'see qdsl.export for details'\n"
        "def g():\n"
        "    import qdsl\n"
        "    return qdsl.apply\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(src)
    found = {target for _, _, target in _imports("qdsl.spec.probe", path)}
    assert found == {"qdsl.lint", "qdsl.runtime", "qdsl.qat.bn_fold", "qdsl.api"}


@pytest.mark.parametrize("module", ["qdsl.spec", "qdsl.parse", "qdsl.resolve.plan", "qdsl.graph",
                                    "qdsl.graph.reference", "qdsl.graph.qgraph"])
def test_torch_free(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_qdsl_is_cheap():
    code = "import sys, qdsl; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

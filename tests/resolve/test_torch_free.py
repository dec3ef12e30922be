"""The resolver layer and ``qdsl check`` without a model never import torch."""

import importlib
import subprocess
import sys
from pathlib import Path

import qdsl

SPEC = Path(__file__).resolve().parents[2] / "specs" / "int8-default.qspec"


def test_resolve_and_check_without_torch():
    code = (
        "import sys\n"
        "from qdsl.cli.main import main\n"
        "from qdsl.resolve import resolve, check_spec, explain\n"
        "from qdsl.resolve.plan import ModelIndex, ModuleEntry\n"
        f"assert main(['check', {str(SPEC)!r}]) == 0\n"
        "index = ModelIndex([ModuleEntry('fc', 'Linear', {'weight': (4, 8), 'bias': (4,)})])\n"
        f"plan = resolve(index, {str(SPEC)!r})\n"
        "assert plan.layer('fc').recipe('weight').bits == 8\n"
        "assert 'torch' not in sys.modules, [m for m in sys.modules if 'torch' in m][:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_top_level_api_points_here(resnet):
    from qdsl.resolve import explain

    assert qdsl.explain is explain
    # qdsl.resolve may be bound to the package (any submodule import does that); it
    # must still resolve when called
    importlib.import_module("qdsl.resolve.plan")

    plan = qdsl.resolve(resnet, SPEC)
    assert plan.layer("fc").recipe("weight").bits == 8

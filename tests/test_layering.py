"""Imports flow one way (STYLE.md): spec -> parse -> resolve -> quantizers -> patch -> export.

``qdsl.spec`` and ``qdsl.parse`` must never import torch, so specs can be checked
without it; checked in a subprocess so this test's own imports do not interfere.
"""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["qdsl.spec", "qdsl.parse", "qdsl.resolve.plan"])
def test_torch_free(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_qdsl_is_cheap():
    code = "import sys, qdsl; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

"""The public entry points: ``qdsl.lint(...)`` works however ``qdsl.lint`` was reached."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SPEC = Path(__file__).parent / "specs" / "x86-fail.qspec.toml"


@pytest.mark.parametrize("prelude", [
    "import qdsl",                        # the lazy top-level API first
    "import qdsl, qdsl.lint",             # the submodule imported first (binds qdsl.lint to it)
    "import qdsl; from qdsl.lint import enforce",
])
def test_qdsl_lint_is_callable(prelude):
    code = (f"{prelude}\n"
            f"d = qdsl.lint({str(SPEC)!r}, 'x86-fbgemm')\n"
            "assert [x.code for x in d] == ['E302', 'E305', 'E303', 'E308', 'E301'], d\n"
            "import qdsl.lint.api as api\n"
            "assert api.enforce is __import__('qdsl.lint', fromlist=['enforce']).enforce\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_load_profile_is_public():
    import qdsl

    assert qdsl.load_profile("tflite-int8").name == "tflite-int8"

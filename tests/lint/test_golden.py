"""Golden lint reports: for each bundled profile a spec that passes and specs that fail,
spec-only and on a reference model, compared with the exact rendered text.

Regenerate after an intended change with ``QDSL_UPDATE_GOLDENS=1 pytest tests/lint``
(or ``--update-goldens`` where the root conftest defines it) and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qdsl.lint import lint, render_text

HERE = Path(__file__).parent
SPECS = HERE / "specs"
GOLDEN = HERE / "golden"

# (spec file name without .qspec.toml, or a .qspec DSL file; profile; reference model
# factory or None; expected to pass)
CASES = [
    ("tflite-pass", "tflite-int8", None, True),
    ("tflite-pass", "tflite-int8", "conv_bn_relu_net", True),
    ("tflite-fail", "tflite-int8", None, False),
    ("tflite-fail", "tflite-int8", "digits_resnet", False),
    ("tflite-fail.qspec", "tflite-int8", None, False),  # the DSL form: same findings, DSL fixes
    ("tflite-fail.qspec", "tflite-int8", "digits_resnet", False),
    ("x86-pass", "x86-fbgemm", None, True),
    ("x86-pass", "x86-fbgemm", "digits_resnet", True),
    ("x86-fail", "x86-fbgemm", None, False),
    ("pot-asic-pass", "pot-asic-24bit-acc", None, True),
    ("pot-asic-pass", "pot-asic-24bit-acc", "conv_bn_relu_net", True),
    ("pot-asic-fail", "pot-asic-24bit-acc", None, False),
    ("pot-asic-fail", "pot-asic-24bit-acc", "conv_bn_relu_net", False),
    ("xnor-pass", "xnor-fpga", None, True),
    ("xnor-pass", "xnor-fpga", "binary_mlp", True),
    ("xnor-fail", "xnor-fpga", "binary_mlp", False),
    ("photonic-pass", "int-only-photonic", None, True),
    ("photonic-pass", "int-only-photonic", "conv_bn_relu_net", True),
    ("photonic-fail", "int-only-photonic", None, False),
    ("photonic-fail", "int-only-photonic", "conv_bn_relu_net", False),
]


def _update(request) -> bool:
    try:
        if request.config.getoption("--update-goldens"):
            return True
    except ValueError:
        pass
    return os.environ.get("QDSL_UPDATE_GOLDENS") == "1"


@pytest.mark.parametrize("stem,profile,model,passes", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2] or 'spec'}" for c in CASES])
def test_golden_report(stem, profile, model, passes, monkeypatch, request):
    import qdsl.zoo.models as models

    monkeypatch.chdir(SPECS)  # spans name the spec relative to its directory
    net = getattr(models, model)() if model else None
    diags = lint(stem if stem.endswith(".qspec") else f"{stem}.qspec.toml", profile, net)
    text = render_text(diags, profile) + "\n"
    golden = GOLDEN / f"{stem}--{profile}--{model or 'spec'}.txt"
    if _update(request):
        golden.write_text(text)
    assert golden.exists(), f"missing golden {golden.name}; run with QDSL_UPDATE_GOLDENS=1"
    assert text == golden.read_text()
    if passes:
        assert diags == []
    else:
        assert any(d.is_error for d in diags)
        # every finding points at a place: a spec line, or a layer of the model
        assert all(d.span.known or d.span.path for d in diags)


@pytest.mark.parametrize("model", [None, "conv_bn_relu_net"])
def test_golden_profile_that_constrains_nothing(model, monkeypatch, request):
    """A profile with only ``version = 1`` used to lint "no findings": now one W341 warning."""
    import qdsl.zoo.models as models

    monkeypatch.chdir(SPECS)
    diags = lint("tflite-pass.qspec.toml", "empty-profile.toml", getattr(models, model)() if model else None)
    text = render_text(diags, "empty-profile") + "\n"
    golden = GOLDEN / f"tflite-pass--empty-profile--{model or 'spec'}.txt"
    if _update(request):
        golden.write_text(text)
    assert golden.exists(), f"missing golden {golden.name}; run with QDSL_UPDATE_GOLDENS=1"
    assert text == golden.read_text()
    assert [(d.code, d.severity.value, d.span.line) for d in diags] == [("W341", "warning", 2)]

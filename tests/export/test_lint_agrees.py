"""lint and export agree (issue 17): for each torchvision-shaped model and bundled CNN spec,
``qdsl.lint`` with the model reports an export refusal (W320: weights too wide for the graph;
W321: an op with no integer lowering, from the one construct table, or a binary layer of
an op with no binary form in the catalogue) exactly when
``qdsl.export`` refuses the model, and names the place export names.  ``qdsl check --model``
reports the same op."""

import glob
import os

import pytest
import torch

import qdsl
from qdsl.export.values import ExportError

from .tv_models import FACTORIES, MUL_FACTORIES

MODELS = {**FACTORIES, **MUL_FACTORIES}
SPECS = sorted(os.path.basename(p)[: -len(".qspec")] for p in glob.glob("specs/*.qspec")
               if not os.path.basename(p).startswith("transformer"))
REFUSALS = {"W320", "W321"}
# int8-default for every model is fast; the other specs repeat the ResNet-50 / EfficientNet cost
FAST = {(m, "int8-default") for m in MODELS} | {("resnet18", "xnor-binary"), ("unet", "xnor-binary")}


def _cases():
    for model in MODELS:
        for spec in SPECS:
            marks = () if (model, spec) in FAST else (pytest.mark.slow,)
            yield pytest.param(model, spec, marks=marks, id=f"{model}-{spec}")


@pytest.mark.parametrize("name,spec", list(_cases()))
def test_lint_reports_what_export_refuses(name, spec):
    path = f"specs/{spec}.qspec"
    size = 16 if name == "unet" else 32
    model = MODELS[name]()
    found = [d for d in qdsl.lint(path, "specs/hw/tflite-int8.toml", model) if d.code in REFUSALS]
    qdsl.apply(model, path)
    x = torch.randn(4, 3, size, size)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    try:
        qdsl.export(model, x[:1])
        refused = None
    except ExportError as e:
        refused = str(e)
    assert (refused is not None) == bool(found), f"lint: {[d.message for d in found]}; export: {refused}"
    if refused is not None:
        # export stops at the first place; lint's finding for that op lists it (module or "op in module")
        places = [p.split(" in ")[-1] for d in found for p in d.message.rpartition("(")[2].rstrip(")").split(", ")]
        assert any(f"'{p}'" in refused for p in places), (refused, places)


def test_check_reports_the_missing_op(capsys):
    from qdsl.cli.main import main

    rc = main(["check", "specs/int8-default.qspec", "--model", "tests/export/tv_models.py:mean_classifier"])
    err = capsys.readouterr().err
    assert rc == 0  # a warning: the model still trains
    assert "warning[W321]: 'mean' has no integer lowering" in err, err

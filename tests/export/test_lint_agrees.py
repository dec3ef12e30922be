"""lint and export agree (issue 17): for each torchvision-shaped model and bundled CNN spec,
``qdsl.lint`` with the model reports an export refusal (W320: weights too wide for the graph;
W321: an op with no integer lowering, from the one construct table, or a binary layer of
an op with no binary form in the catalogue) exactly when
``qdsl.export`` refuses the model, and names the place export names.  ``qdsl check --model``
reports the same op.  The same holds for integer ops (products, adds, concats) that read a bare
function's result (``y * torch.sigmoid(y)``), on small models below."""

import glob
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdsl
from qdsl.export.values import ExportError
from qdsl.runtime.run import run_graph

from .tv_models import FACTORIES, MUL_FACTORIES

MODELS = {**FACTORIES, **MUL_FACTORIES}
SPECS = sorted(os.path.basename(p)[: -len(".qspec")] for p in glob.glob("specs/*.qspec")
               if not os.path.basename(p).startswith("transformer"))
REFUSALS = {"W320", "W321"}
# int8-default for every model is fast; the other specs repeat the ResNet-50 / EfficientNet cost
FAST = {(m, "int8-default") for m in MODELS} | {("resnet18", "xnor-binary"), ("unet", "xnor-binary"),
                                               ("resnet18", "mxfp4")}


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


# ---------------------------------------------------------------- integer ops reading function results
# qdsl quantizes with hooks on an unmodified model, so a value no module returns once per forward
# (a bare function's result, the model input) can carry no quantizer; an integer op that needs one
# makes export refuse the model.  One walk decides it (qdsl.patch.implied -> qdsl.patch.unplaced):
# export raises its first record, lint reports every record as W321 with the same message and hint.

class _Pair(nn.Module):
    """Two Linear branches of one input, ``combine(a, b)``, then a classifier."""

    def __init__(self, combine, out=16):
        super().__init__()
        self.fc_a, self.fc_b, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(out, 4)
        self.combine = combine

    def forward(self, x):
        return self.fc2(self.combine(self.fc_a(x), self.fc_b(x)))


class _GateFn(nn.Module):
    """A submodule computing ``y * torch.sigmoid(y)`` on its own Linear's output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x)
        return y * torch.sigmoid(y)


class _GateOut(nn.Module):
    """A submodule returning ``torch.sigmoid(fc(x))``: the module carries the quantizer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.sigmoid(self.fc(x))


class _Nested(nn.Module):
    def __init__(self, block, mul_outside=False):
        super().__init__()
        self.fc0, self.block, self.fc2 = nn.Linear(16, 16), block, nn.Linear(16, 4)
        self.mul_outside = mul_outside

    def forward(self, x):
        y = self.fc0(x)
        return self.fc2(y * self.block(x) if self.mul_outside else self.block(y))


class _InputProduct(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(x * self.fc1(x))


FUNCTION_MODELS = {
    # (factory, export refuses it)
    "mul_sigmoid": (lambda: _Pair(lambda a, b: b * torch.sigmoid(a)), True),
    "swish": (lambda: _Pair(lambda a, b: a * torch.sigmoid(a)), True),
    "mul_hardsigmoid": (lambda: _Pair(lambda a, b: a * F.hardsigmoid(a)), True),
    "mul_tanh": (lambda: _Pair(lambda a, b: torch.tanh(a) * b), True),
    "mul_relu": (lambda: _Pair(lambda a, b: torch.relu(a) * b), False),  # the clamp passes a's quantizer on
    "gate_in_submodule": (lambda: _Nested(_GateFn()), True),
    "gate_returned_by_submodule": (lambda: _Nested(_GateOut(), mul_outside=True), False),
    "add_relu": (lambda: _Pair(lambda a, b: a + torch.relu(b)), False),  # ADD reads the clamped accumulator
    "add_sigmoid": (lambda: _Pair(lambda a, b: a + torch.sigmoid(b)), True),
    "add_three": (lambda: _Pair(lambda a, b: a + b + a), True),  # the first sum is a function's result
    "cat_sigmoid": (lambda: _Pair(lambda a, b: torch.cat([a, torch.sigmoid(b)], 1), 32), False),  # on cat's grid
    "cat_relu": (lambda: _Pair(lambda a, b: torch.cat([torch.relu(a), b], 1), 32), False),
    "input_product": (_InputProduct, True),
}


@pytest.mark.parametrize("name", list(FUNCTION_MODELS))
def test_lint_reports_function_results_export_refuses(name):
    factory, refuses = FUNCTION_MODELS[name]
    torch.manual_seed(0)
    model = factory()
    spec = "specs/int8-default.qspec"
    found = [d for d in qdsl.lint(spec, "specs/hw/tflite-int8.toml", model) if d.code in REFUSALS]
    qdsl.apply(model, spec)
    x = torch.randn(8, 16)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    try:
        graph = qdsl.export(model, x[:1])
        refused = None
    except ExportError as e:
        refused = e
    assert (refused is not None) == refuses, refused
    assert bool(found) == refuses, [d.message for d in found]
    if refused is None:
        # exported: the graph runs and agrees with the fake-quant model (not a silent float value)
        with torch.no_grad():
            want = model(x).numpy()
        got = run_graph(graph, x.numpy())
        assert abs(got - want).max() <= 0.1 * abs(want).max() + 1e-6
        return
    # the same record: export's message and hint are lint's, at the place export names
    text = str(refused)
    assert any(d.message.split(": ", 1)[1].rsplit(" (", 1)[0] in text and d.hints[0] in text for d in found), \
        (text, [(d.message, d.hints) for d in found])
    assert any(f"'{d.span.path.split(' in ')[-1]}'" in text for d in found), (text, [d.span.path for d in found])


def test_function_result_hint_names_the_module_form():
    model = FUNCTION_MODELS["mul_hardsigmoid"][0]()
    (d,) = [d for d in qdsl.lint("specs/int8-default.qspec", "specs/hw/tflite-int8.toml", model) if d.code == "W321"]
    assert "reads the result of F.hardsigmoid" in d.message and "(mul in <model>)" in d.message
    assert "nn.Hardsigmoid() instead of F.hardsigmoid" in d.hints[0]
    model = FUNCTION_MODELS["gate_in_submodule"][0]()
    (d,) = [d for d in qdsl.lint("specs/int8-default.qspec", "specs/hw/tflite-int8.toml", model) if d.code == "W321"]
    assert d.span.path == "mul in block" and "in 'block' reads the result of torch.sigmoid" in d.message


def test_lint_cli_reports_the_function_result(capsys):
    from qdsl.cli.main import main

    rc = main(["lint", "specs/int8-default.qspec", "--hw", "specs/hw/tflite-int8.toml",
               "--model", "tests/export/tv_models.py:swish_classifier"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "W321" in out and "torch.sigmoid" in out and "nn.Sigmoid()" in out, out

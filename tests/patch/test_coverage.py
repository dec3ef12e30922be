"""apply reports what the spec reaches but leaves in float, and shared observers (qdsl.patch.coverage)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdsl
from qdsl.cli.main import main
from qdsl.patch import state_of
from qdsl.patch.coverage import LeftFloatError, LeftFloatWarning, SharedModuleWarning
from qdsl.spec.diagnostics import QdslWarning, SpecError
from qdsl.zoo.models import digits_resnet
from patch_helpers import INT8, spec

W8A8 = """version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
defaults { weight = w8  input = a8 }
"""


class Wrap(nn.Module):
    """``inner`` then a Linear; ``prep`` turns the example input into what ``inner`` takes."""

    def __init__(self, inner, call, width=8):
        super().__init__()
        self.inner = inner
        self.call = call
        self.fc = nn.Linear(width, 4)

    def forward(self, x):
        return self.fc(self.call(self.inner, x))


def _first(out):
    return out[0] if isinstance(out, tuple) else out


MODULES = {
    "Embedding": (lambda: nn.Embedding(10, 8), lambda m, x: m(x), lambda: torch.randint(0, 10, (2, 5))),
}
# nn.MultiheadAttention is quantized now (qdsl.patch.attention; tests/patch/test_attention.py)

RECURRENT = {
    "LSTM": (lambda: nn.LSTM(8, 8, batch_first=True), lambda m, x: _first(m(x)), lambda: torch.randn(2, 5, 8)),
    "GRU": (lambda: nn.GRU(8, 8, batch_first=True), lambda m, x: _first(m(x)), lambda: torch.randn(2, 5, 8)),
    "RNN": (lambda: nn.RNN(8, 8, batch_first=True), lambda m, x: _first(m(x)), lambda: torch.randn(2, 5, 8)),
    "LSTMCell": (lambda: nn.LSTMCell(8, 8), lambda m, x: _first(m(x)), lambda: torch.randn(2, 8)),
    "GRUCell": (lambda: nn.GRUCell(8, 8), lambda m, x: m(x), lambda: torch.randn(2, 8)),
}


def _apply(model, text=W8A8, **kw):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        handle = qdsl.apply(model, spec(text), **kw)
    return handle, [w.message for w in rec if isinstance(w.message, QdslWarning)]


@pytest.mark.parametrize("type_name", sorted(MODULES))
def test_each_unsupported_module_is_named_in_the_warning(type_name):
    make, call, example = MODULES[type_name]
    model = Wrap(make(), call)
    handle, found = _apply(model, example_input=example())
    (w,) = [m for m in found if isinstance(m, LeftFloatWarning)]
    names = {f.name for f in w.coverage.floats}
    assert "inner" in names and "fc" not in names
    if type_name == "Embedding":  # quantized by a rule of its own (issue 19), not by defaults
        assert "inner: defaults do not apply to nn.Embedding" in str(w) and "rule type:Embedding" in str(w)
    else:
        assert f"inner: nn.{type_name} weights are not supported yet" in str(w)
    assert "s.qspec:4" in str(w) or "test.qspec:4" in str(w)  # where the defaults reach it
    handle.remove()


TRANSPOSED = {
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(8, 8, 3), lambda m, x: m(x).mean(-1), lambda: torch.randn(2, 8, 5)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(8, 8, 3), lambda m, x: m(x).mean((-1, -2)),
                        lambda: torch.randn(2, 8, 5, 5)),
}


@pytest.mark.parametrize("type_name", sorted(TRANSPOSED))
def test_conv_transpose_is_quantized_not_left_float(type_name):
    # issue 17: ConvTranspose1d/2d were W505 (left float); the defaults now quantize them
    make, call, example = TRANSPOSED[type_name]
    model = Wrap(make(), call)
    handle, found = _apply(model, example_input=example(), strict=True)
    assert not [m for m in found if isinstance(m, LeftFloatWarning)]
    assert handle.layers["inner"].wq is not None and handle.layers["inner"].wq.axis == 1  # the output channels
    handle.remove()


@pytest.mark.parametrize("type_name", sorted(RECURRENT))
def test_recurrent_layers_are_quantized_not_left_float(type_name):
    # issue 19: LSTM/GRU/RNN and their cells were W505 (left float); defaults now quantize them
    make, call, example = RECURRENT[type_name]
    model = Wrap(make(), call)
    handle, found = _apply(model, example_input=example(), strict=True)
    assert not [m for m in found if isinstance(m, LeftFloatWarning)]
    keys = set(handle.container.quantizers)
    sfx = "" if type_name.endswith("Cell") else "_l0"
    assert {f"inner:weight_ih{sfx}", f"inner:weight_hh{sfx}", "inner:input", f"inner:hidden{sfx}"} <= keys
    handle.remove()


@pytest.mark.parametrize("type_name", sorted(MODULES))
def test_strict_refuses_before_touching_the_model(type_name):
    make, call, example = MODULES[type_name]
    model = Wrap(make(), call)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LeftFloatError) as info:
        qdsl.apply(model, spec(W8A8), strict=True)
    assert set(info.value.codes) == {"E505"}
    assert any(d.message.startswith("inner:") and d.span.line == 4 for d in info.value.diagnostics)
    assert state_of(model) is None and "_qdsl" not in model._modules
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class Functional(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        if op in ("linear", "@"):
            self.w = nn.Parameter(torch.randn(8, 8))
        if op == "conv2d":
            self.k = nn.Parameter(torch.randn(8, 8, 3, 3))
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        if self.op == "linear":
            return F.linear(y, self.w)
        if self.op == "conv2d":
            return F.conv2d(y.reshape(2, 8, 1, 1).expand(2, 8, 3, 3), self.k).flatten(1)
        if self.op == "matmul":
            return torch.matmul(y, x.t())
        if self.op == "bmm":
            return torch.bmm(y.unsqueeze(1), x.unsqueeze(2)).flatten(1)
        return y @ self.w  # "@"


@pytest.mark.parametrize("op, name, operand", [
    ("linear", "F.linear in <model>", "reads parameter w"),
    ("conv2d", "F.conv2d in <model>", "reads parameter k"),
    ("matmul", "torch.matmul in <model>", "of activations"),
    ("bmm", "torch.bmm in <model>", "of activations"),
    ("@", "@ in <model>", "reads parameter w"),
])
def test_each_functional_product_is_named(op, name, operand):
    model = Functional(op)
    handle, found = _apply(model, example_input=torch.randn(2, 8))
    (w,) = [m for m in found if isinstance(m, LeftFloatWarning)]
    (f,) = [f for f in w.coverage.floats if f.name == name]
    assert operand in f.reason and "not quantized" in f.reason
    # the parameter is reported once, with the op that reads it (not again as "<model>")
    assert [f.name for f in w.coverage.floats] == [name]
    handle.remove()
    with pytest.raises(LeftFloatError, match=name.split(" ")[0].replace(".", r"\.")):
        qdsl.apply(model, spec(W8A8), strict=True)


def test_a_parameter_nobody_reads_through_an_op_is_reported_on_its_module():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(4, 8))
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x) * self.table.sum(0)

    _, found = _apply(Scaled())
    (w,) = found
    assert [f.name for f in w.coverage.floats] == ["<model>"]
    assert "parameter table read directly by the forward of Scaled" in str(w)


class Table(nn.Module):
    """A module whose kernel is not named ``weight`` (no weight role)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ self.table


def test_type_rule_gives_the_same_located_error_as_the_exact_name():
    # (was nn.MultiheadAttention, which has a weight role now: qdsl.patch.attention)
    model = Wrap(Table(), lambda m, x: m(x))
    for extra in ("", "  input = a8"):  # with input set, the weight used to be dropped silently
        errs = {}
        for target in ("type:Table", "inner"):
            with pytest.raises(SpecError) as info:
                qdsl.apply(model, spec(W8A8 + f"rule {target} {{ weight = w8{extra} }}\n"))
            (d,) = info.value.diagnostics
            errs[target] = d
        assert errs["type:Table"].code == errs["inner"].code == "E203"
        assert errs["type:Table"].span.line == errs["inner"].span.line == 5
        for d in errs.values():
            assert "table" in " ".join(d.notes)
            assert d.span.source_line()[d.span.col - 1:].startswith("w8")
    assert state_of(model) is None


def test_shared_module_warns_that_one_observer_sees_every_call_site():
    class Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(self.fc(self.relu(self.fc(x))))

    text = W8A8 + "rule type:ReLU { output = a8 }\n"
    handle, found = _apply(Reuse(), text)
    (w,) = found
    assert isinstance(w, SharedModuleWarning)
    assert {f.name for f in w.coverage.shared} == {"fc", "relu"}
    assert "called 2 times per forward" in str(w) and "one output observer" in str(w)
    handle.remove()


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # data-dependent control flow: fx cannot trace this
            y = self.fc(y)
        return y


def test_untraceable_model_says_what_was_not_checked():
    _, found = _apply(Untraceable())
    (w,) = found
    assert "not checked: functional ops" in str(w) and "modules called more than once" in str(w)
    assert "could not trace" in str(w) and "TraceError" in str(w)
    # its own parameter needs no trace: still listed
    assert [f.name for f in w.coverage.floats] == ["<model>"]


def test_untraceable_model_counts_calls_in_the_example_forward():
    torch.manual_seed(0)
    model = Untraceable()
    with torch.no_grad():
        model.fc.bias.fill_(10.0)  # the branch is taken: fc runs twice
    _, found = _apply(model, example_input=torch.randn(2, 8))
    shared = [m for m in found if isinstance(m, SharedModuleWarning)]
    assert [f.name for f in shared[0].coverage.shared] == ["fc"]
    (left,) = [m for m in found if isinstance(m, LeftFloatWarning)]
    assert "modules called more than once" not in str(left)  # counted after all
    # checked again on the patched model: fc's moved master weight is still fc's quantized weight
    assert [f.name for f in left.coverage.floats] == ["<model>"]


def test_module_whose_forward_never_runs():
    model = Wrap(nn.MultiheadAttention(8, 2, batch_first=True), lambda m, x: m(x, x, x)[0])
    model.unused = nn.Linear(8, 8)
    text = W8A8 + "rule type:MultiheadAttention { skip }\nrule **.out_proj { weight = w8 }\n"
    handle, found = _apply(model, text)
    (w,) = found
    reasons = {f.name: f.reason for f in w.coverage.floats}
    assert set(reasons) == {"inner.out_proj", "unused"}
    assert "called functionally by MultiheadAttention" in reasons["inner.out_proj"]
    assert "never called" in reasons["unused"]
    handle.remove()


def test_linear_subclass_gets_a_rule_hint():
    class MyLinear(nn.Linear):
        pass

    model = Wrap(MyLinear(8, 8), lambda m, x: m(x))
    _, found = _apply(model)
    (f,) = found[0].coverage.floats
    assert f.name == "inner" and "by exact class name" in f.reason and "type:MyLinear" in f.hint


@pytest.mark.parametrize("kind, text", [
    ("LSTM", W8A8 + "rule inner { skip }\n"),
    ("LSTM", W8A8 + "rule type:LSTM { skip }\n"),
    ("LSTM", W8A8.replace("weight = w8  ", "")),  # no default weight: nothing asks for its weights
    ("Embedding", W8A8 + "rule type:Embedding { weight = float }\n"),  # the spec says float
])
def test_quiet_when_the_spec_does_not_reach_it(kind, text):
    make, call, example = {**MODULES, **RECURRENT}[kind]
    model = Wrap(make(), call)
    handle, found = _apply(model, text, example_input=example())
    assert found == []
    handle.remove()


def test_parameter_free_and_norm_modules_are_never_listed():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.LayerNorm(36), nn.Linear(36, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", QdslWarning)
        qdsl.apply(model, spec(W8A8), example_input=torch.randn(1, 1, 8, 8), strict=True).remove()


def test_supported_model_gives_no_warning():
    model = digits_resnet()
    with warnings.catch_warnings():
        warnings.simplefilter("error", QdslWarning)
        handle = qdsl.apply(model, spec(INT8), example_input=torch.randn(2, 1, 8, 8), strict=True)
    handle.remove()


def test_check_lists_them_and_strict_fails(tmp_path, capsys):
    (tmp_path / "m.py").write_text(
        "import torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = nn.Embedding(10, 8)\n"
        "        self.fc = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return self.fc(self.emb(x))\n"
        "def build():\n    return M()\n")
    (tmp_path / "s.qspec").write_text(W8A8)
    args = [str(tmp_path / "s.qspec"), "--model", f"{tmp_path / 'm.py'}:build"]
    assert main(["check", *args]) == 0
    out, err = capsys.readouterr()
    assert "1 left float" in out and "emb: defaults do not apply to nn.Embedding" in err
    assert main(["check", *args, "--strict"]) == 2
    err = capsys.readouterr().err
    assert "error[E505]: emb:" in err and "s.qspec:4:" in err
    assert main(["explain", *args]) == 0
    assert "emb: defaults do not apply to nn.Embedding" in capsys.readouterr().out
    assert main(["explain", *args, "--format", "json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in doc["left_float"]] == ["emb"] and doc["untraced"] is None


def test_user_module_quantized_by_a_rule_is_not_reported():
    class Proj(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return F.linear(x, self.weight)

    model = Wrap(Proj(), lambda m, x: m(x))
    _, found = _apply(model)
    assert [f.name for f in found[0].coverage.floats] == ["F.linear in inner"]
    assert "reads parameter inner.weight" in found[0].coverage.floats[0].reason
    qdsl.remove(model)
    handle, found = _apply(model, W8A8 + "rule type:Proj { weight = w8  input = a8 }\n", strict=True)
    assert found == []
    handle.remove()

"""``qdsl check`` / ``qdsl explain`` exit codes and output, and ``load_model_ref``."""

import json
import textwrap

import pytest

from qdsl.cli.main import main
from qdsl.resolve import load_model_ref
from qdsl.resolve.model_ref import ModelRefError

MODEL = "qdsl.zoo.models:digits_resnet"

GOOD = """\
version 1
quantizer w4 = int(bits=4, signed, narrow, per_channel, observer=mse)
quantizer a8 = int(bits=8, unsigned)

defaults {
  weight = w4
  input = a8
}

rule stem.0, fc as ends {
  weight = w4(bits=8)
}
"""


def write(tmp_path, text, name="m.qspec"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_check_ok_without_and_with_model(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    assert main(["check", path]) == 0
    assert capsys.readouterr().out.strip() == f"ok: {path} (2 presets, 1 rule)"
    assert main(["check", path, "--model", MODEL]) == 0
    assert capsys.readouterr().out.strip() == f"ok: {path} (2 presets, 1 rule, 11 layers quantized)"


def test_check_reports_model_free_errors_located(tmp_path, capsys):
    path = write(tmp_path, GOOD.replace("observer=mse", "observer=msee"))
    assert main(["check", path]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2:" in err and "error[E204]: unknown observer 'msee'" in err
    assert "did you mean 'mse'" in err and "^" in err


def test_check_with_model_reports_resolve_errors(tmp_path, capsys):
    path = write(tmp_path, GOOD.replace("rule stem.0, fc", "rule stem.0, fcc"))
    assert main(["check", path, "--model", MODEL]) == 2
    err = capsys.readouterr().err
    assert "error[E201]: target 'fcc' of rule ends matches no module" in err
    assert f"{path}:10:" in err and "did you mean 'fc'" in err
    assert "Traceback" not in err


def test_check_set_overrides(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    # each piece is valid; together with the preset's bits = 4 a binary weight is not
    assert main(["check", path, "--set", "weight.kind=binary", "--model", MODEL]) == 2
    assert "error[E211]: binary quantizers need bits == 1 (got 4)" in capsys.readouterr().err
    assert main(["check", path, "--set", "weight.bits=6"]) == 0


def test_check_syntax_error_exits_2(tmp_path, capsys):
    path = write(tmp_path, "version 1\nrule {\n")
    assert main(["check", path]) == 2
    assert "error[E0" in capsys.readouterr().err


def test_explain_text_and_json(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    assert main(["explain", path, "--model", MODEL, "--layer", "stem.*", "--role", "weight"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["layer", "role", "field", "value"]
    bits = next(line for line in out if line.split()[:3] == ["stem.0", "weight", "bits"])
    assert f"rule ends ({path}:11)" in bits  # where the weight value is written and "overrides w4: 4" in bits
    assert main(["explain", path, "--model", MODEL, "--layer", "fc", "--format", "json",
                 "--set", "input.bits=6"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {(r["role"], r["field"]): r for r in doc["rows"]}
    assert rows[("input", "bits")]["value"] == 6
    assert rows[("input", "bits")]["set_by"]["label"] == "override input.bits=6"
    assert rows[("weight", "bits")]["value"] == 8


def test_explain_bad_layer_glob_exits_2(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    assert main(["explain", path, "--model", MODEL, "--layer", "layer[1"]) == 2
    assert "error[E218]: invalid layer glob 'layer[1'" in capsys.readouterr().err


def test_explain_bad_model_ref_exits_2(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    assert main(["explain", path, "--model", "qdsl.zoo.models:nope"]) == 2
    err = capsys.readouterr().err
    assert "has no attribute 'nope'" in err and "digits_resnet" in err


def test_model_ref_from_module_file_class_and_instance(tmp_path):
    assert type(load_model_ref(MODEL)).__name__ == "DigitsResNet"
    assert type(load_model_ref("qdsl.zoo.models:MLP")).__name__ == "MLP"  # a class is called
    f = tmp_path / "mynet.py"
    f.write_text("import torch\nnet = torch.nn.Linear(3, 4)\ndef build():\n    return torch.nn.Conv1d(1, 2, 3)\n")
    assert type(load_model_ref(f"{f}:build")).__name__ == "Conv1d"
    assert type(load_model_ref(f"{f}:net")).__name__ == "Linear"  # an instance is used as is


@pytest.mark.parametrize("ref,fragment", [
    ("digits_resnet", "expected MODULE:FACTORY"),
    ("qdsl.nope.models:x", "no module named 'qdsl.nope'"),
    ("qdsl.zoo.models:nothing_here", "has no attribute 'nothing_here'"),
    ("missing/file.py:build", "no such file"),
    ("qdsl.zoo.models:__doc__", "not a factory or a module"),
    ("qdsl.zoo.models:_seeded", "raised TypeError"),
    ("builtins:dict", "returned a dict, not a torch.nn.Module"),
])
def test_model_ref_errors(ref, fragment):
    with pytest.raises(ModelRefError, match="--model") as exc:
        load_model_ref(ref)
    assert fragment in str(exc.value)


def test_model_ref_file_that_fails_to_import(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ModelRefError, match="RuntimeError: boom"):
        load_model_ref(f"{f}:build")


def test_check_with_model_reports_both_kinds_of_problem_at_once(tmp_path, capsys):
    text = GOOD.replace("observer=mse", "observer=msee").replace("rule stem.0, fc", "rule stem.0, fcc")
    path = write(tmp_path, text)
    assert main(["check", path, "--model", MODEL]) == 2
    err = capsys.readouterr().err
    assert "error[E204]" in err and "error[E201]" in err
    assert err.index("E204") < err.index("E201")  # file order: line 2 before line 10

"""Sweeps: setting expansion, size accounting, a real PTQ sweep on digits, CLI errors."""

import copy

import pytest
import torch

import qdsl
from qdsl.cli.main import main
from qdsl.spec.diagnostics import QdslError
from qdsl.zoo.models import mlp
from qdsl.workflows.sweep import expand_settings, format_table, model_size_bits, sweep, write_csv

SPEC = "specs/w4a8-per-channel.qspec"


def test_expand_zips_equal_lists_and_broadcasts_singletons():
    got = expand_settings(["weight.bits=8,4", "input.bits=8,4", "fold_bn=true"])
    assert got == [
        (("weight.bits", "8"), ("input.bits", "8"), ("fold_bn", "true")),
        (("weight.bits", "4"), ("input.bits", "4"), ("fold_bn", "true")),
    ]


def test_expand_keeps_parenthesised_commas():
    got = expand_settings(["input.observer=histogram(bins=512, percentile=99.9),minmax"])
    assert got == [(("input.observer", "histogram(bins=512, percentile=99.9)"),), (("input.observer", "minmax"),)]


def test_expand_product():
    got = expand_settings(["weight.bits=8,4", "input.bits=8,6"], product=True)
    assert len(got) == 4 and (("weight.bits", "4"), ("input.bits", "6")) in got


@pytest.mark.parametrize("bad", [["weight.bits"], ["=4"], ["weight.bits="], ["weight.bits=8,4", "input.bits=8,6,4"]])
def test_expand_rejects_malformed(bad):
    with pytest.raises(QdslError):
        expand_settings(bad)


def test_size_counts_bits_per_quantized_weight():
    model = mlp()
    n_w = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    n_b = sum(m.bias.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    sizes = {}
    for bits in (8, 4):
        m = copy.deepcopy(model)
        handle = qdsl.apply(m, SPEC, overrides=[f"weight.bits={bits}"])
        sizes[bits] = model_size_bits(model, handle.plan)
    # weights at their width, int32 biases
    assert sizes[8] == n_w * 8 + n_b * 32
    assert sizes[8] - sizes[4] == n_w * 4


@pytest.fixture(scope="module")
def digits_mlp():
    from qdsl.zoo.data import digits
    from qdsl.zoo.train import train_float

    data = digits()
    torch.manual_seed(0)
    model = train_float(mlp(), data[0], data[1], epochs=8, lr=0.01, seed=0)
    return model, data


def test_sweep_accuracy_falls_with_bits_and_float_model_untouched(digits_mlp):
    model, data = digits_mlp
    before = {k: v.clone() for k, v in model.state_dict().items()}
    points = sweep(model, SPEC, data, expand_settings(["weight.bits=8,2", "input.bits=8,2"]))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not hasattr(model, "_qdsl")
    w8, w2 = points
    assert w8.accuracy >= w8.float_accuracy - 0.02
    assert w2.accuracy < w8.accuracy
    assert w2.size_bits < w8.size_bits < w8.float_size_bits
    table = format_table(points)
    assert "weight.bits=8 input.bits=8" in table and "float" in table


def test_sweep_csv(tmp_path, digits_mlp):
    model, data = digits_mlp
    points = sweep(model, SPEC, data, expand_settings(["weight.bits=8"]))
    out = tmp_path / "s.csv"
    write_csv(points, out)
    lines = out.read_text().splitlines()
    assert lines[0].startswith("weight.bits,accuracy") and lines[1].startswith("8,")


def test_sweep_cli_bad_references_exit_2(capsys):
    assert main(["sweep", SPEC, "--model", "no.such.module:f", "--data", "qdsl.zoo.trained:digits"]) == 2
    assert "no module named" in capsys.readouterr().err
    assert main(["sweep", SPEC, "--model", "qdsl.zoo.models:mlp", "--data", "qdsl.zoo.models:mlp"]) == 2
    assert "must return (x_train, y_train, x_test, y_test)" in capsys.readouterr().err
    assert main(["sweep", SPEC, "--model", "qdsl.zoo.models:mlp", "--data", "qdsl.zoo.trained:digits",
                 "--set", "weight.bits"]) == 2


def test_sweep_cli_bad_spec_is_located(tmp_path, capsys):
    bad = tmp_path / "bad.qspec"
    bad.write_text("version 1\ndefaults { weight = int(bits=99) }\n")
    assert main(["sweep", str(bad), "--model", "qdsl.zoo.models:mlp", "--data", "qdsl.zoo.trained:digits"]) == 2
    err = capsys.readouterr().err
    assert "bad.qspec:2:" in err and "^" in err


def test_sweep_strict_refuses_layers_left_float(tmp_path, capsys):
    (tmp_path / "m.py").write_text(
        "import torch.nn as nn\n"
        "from qdsl.zoo.models import mlp\n"
        "def build():\n"
        "    m = mlp()\n"
        "    m.table = nn.Embedding(4, 4)  # reached by the defaults' weight, never quantized\n"
        "    return m\n")
    args = ["sweep", SPEC, "--model", f"{tmp_path / 'm.py'}:build", "--data", "qdsl.zoo.trained:digits",
            "--calib", "64"]
    assert main(args + ["--strict"]) == 2
    err = capsys.readouterr().err
    assert "error[E505]: table: defaults do not apply to nn.Embedding" in err

"""W320: power-of-two weights wider than 4 bits train but can never export (int8 cannot hold them)."""

import pytest

import qdsl
from qdsl.cli.main import main
from qdsl.zoo.models import conv_bn_relu_net

SPEC = """version 1

quantizer wpot = pot(bits={bits}, per_channel)

defaults {{
  input = int(bits=8, signed, symmetric)
}}

rule type:Conv2d {{
  weight = {weight}
}}
"""


def _write(tmp_path, bits, via_preset=False):
    weight = "wpot" if via_preset else f"pot(bits={bits}, per_channel)"
    path = tmp_path / "pot.qspec"
    path.write_text(SPEC.format(bits=bits, weight=weight))
    return str(path)


def _w320(diags):
    return [d for d in diags if d.code == "W320"]


@pytest.mark.parametrize("via_preset", [False, True])
def test_lint_finds_five_bit_pot_weights_at_bits(tmp_path, via_preset):
    path = _write(tmp_path, 5, via_preset)
    found = _w320(qdsl.lint(path, "tflite-int8"))
    assert len(found) == 1
    d = found[0]
    assert not d.is_error and "span more than int8" in d.message and "cannot hold them" in d.message
    line = 3 if via_preset else 10
    text = open(path).read().split("\n")[line - 1]
    assert d.span.line == line and text[d.span.col - 1:].startswith("5")
    assert any("bits <= 4" in h for h in d.hints)


def test_lint_with_model_finds_it_too(tmp_path):
    found = _w320(qdsl.lint(_write(tmp_path, 5), "tflite-int8", model=conv_bn_relu_net(in_ch=1)))
    assert len(found) == 1 and found[0].span.line == 10


def test_four_bit_pot_weights_give_no_finding(tmp_path):
    assert not _w320(qdsl.lint(_write(tmp_path, 4), "tflite-int8"))
    assert not _w320(qdsl.lint(_write(tmp_path, 4), "tflite-int8", model=conv_bn_relu_net(in_ch=1)))


def test_cli_lint_and_check_report_it(tmp_path, capsys):
    path = _write(tmp_path, 5)
    main(["lint", path, "--hw", "tflite-int8"])
    assert "warning[W320]" in capsys.readouterr().out
    assert main(["check", path]) == 0  # a warning: the spec still trains
    out = capsys.readouterr()
    assert out.out.startswith("ok:")
    assert "warning[W320]" in out.err and f"{path}:10:" in out.err


def test_cli_check_is_silent_at_four_bits(tmp_path, capsys):
    assert main(["check", _write(tmp_path, 4)]) == 0
    assert "W320" not in capsys.readouterr().err

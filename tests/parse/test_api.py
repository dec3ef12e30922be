"""The public API contract of qdsl.parse, format detection, file errors and ``qdsl fmt``."""

import subprocess
import sys

import pytest

import qdsl
from qdsl.cli.main import main
from qdsl.parse import detect_format, format_spec, load_spec, parse_file, parse_text
from qdsl.spec.diagnostics import SpecError
from qdsl.spec.model import QuantSpec, Role

DSL = "version 1\nquantizer a8 = int(bits=8)\ndefaults { input = a8 }\nrule fc { skip }\n"


def test_public_names():
    import qdsl.parse as p

    for name in ("parse_text", "parse_file", "load_spec", "compose", "parse_overrides", "format_spec",
                 "read_located_toml"):
        assert name in p.__all__ and callable(getattr(p, name))
    assert qdsl.load_spec is p.load_spec and qdsl.parse_spec is p.parse_text and qdsl.format_spec is p.format_spec


def test_parse_never_imports_torch():
    code = "import sys, qdsl.parse as p; p.parse_text('version 1', 'a.qspec'); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "name,text,fmt",
    [
        ("a.qspec", DSL, "qspec"),
        ("a.qspec.toml", "version = 1", "toml"),
        ("a.toml", "version = 1", "toml"),
        ("<input>", "version = 1\n[defaults]\n", "toml"),
        ("<input>", "[defaults\n", "toml"),
        ("<input>", DSL, "qspec"),
    ],
)
def test_detect_format(name, text, fmt):
    assert detect_format(name, text) == fmt


def test_parse_text_sniffs_and_accepts_explicit_format():
    assert parse_text(DSL) == parse_text(format_spec(parse_text(DSL), to="toml"))
    with pytest.raises(SpecError) as info:
        parse_text(DSL, "x.txt", fmt="toml")
    assert info.value.codes == ["E001"]
    with pytest.raises(SpecError):
        parse_text(DSL, fmt="yaml")


def test_parse_file_sets_source_and_reports_unreadable(tmp_path):
    path = tmp_path / "m.qspec"
    path.write_text(DSL)
    assert parse_file(path).source == str(path)
    with pytest.raises(SpecError) as info:
        parse_file(tmp_path / "missing.qspec")
    assert info.value.codes == ["E100"]
    binary = tmp_path / "bin.qspec"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SpecError):
        parse_file(binary)
    with pytest.raises(SpecError):
        parse_file(tmp_path)  # a directory


def test_load_spec_accepts_a_spec_object():
    spec = parse_text(DSL, "m.qspec")
    out = load_spec(spec, ["input.bits=4"])
    assert isinstance(out, QuantSpec) and out.overrides.roles[Role.INPUT].bits == 4


def test_field_spans_cover_every_field_in_both_syntaxes():
    dsl = parse_text("version 1\nquantizer q = int(bits=4, signed, per_channel, observer=mse, scale=pot)\n", "a.qspec")
    toml = parse_text(format_spec(dsl, to="toml"), "a.qspec.toml")
    for spec in (dsl, toml):
        q = spec.quantizers["q"]
        assert set(q.field_spans) == set(q.set_fields())
        assert all(s.line >= 1 for s in q.field_spans.values())
    assert dsl.quantizers["q"].field_spans["bits"].col == 24


def test_cli_fmt_converts_and_never_overwrites(tmp_path, capsys):
    src = tmp_path / "m.qspec"
    src.write_text(DSL)
    assert main(["fmt", str(src), "--to", "toml"]) == 0
    out = capsys.readouterr().out
    assert parse_text(out, "x.qspec.toml") == parse_text(DSL)
    dest = tmp_path / "m.qspec.toml"
    assert main(["fmt", str(src), "--to", "toml", "-o", str(dest)]) == 0
    assert parse_file(dest) == parse_file(src)
    assert main(["fmt", str(src), "-o", str(src)]) == 2
    assert src.read_text() == DSL
    assert main(["fmt", str(src), "--to", "toml", "--in-place"]) == 2
    assert main(["fmt", str(src), "--in-place"]) == 0
    assert src.read_text() == format_spec(parse_text(DSL), to="qspec")


def test_cli_fmt_reports_errors_with_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.qspec"
    bad.write_text("version 1\nrulle x { }\n")
    assert main(["fmt", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.qspec:2:1: error[E003]: unknown statement 'rulle'" in err
    assert "Traceback" not in err


def test_reference_doc_example_is_the_same_spec_in_both_columns():
    """docs/spec-language.md opens with one spec side by side in both syntaxes; keep them equal."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "spec-language.md").read_text()
    start = doc.index("```\n# model.qspec ") + 4
    block = doc[start:doc.index("```\n", start)].splitlines()
    split = block[0].index("# model.qspec.toml")
    left = "\n".join(line[:split] for line in block)
    right = "\n".join(line[split:] for line in block)
    assert parse_text(left, "doc.qspec") == parse_text(right, "doc.qspec.toml")


def test_bom_and_crlf_files_parse(tmp_path):
    path = tmp_path / "win.qspec"
    path.write_bytes(b"\xef\xbb\xbf" + DSL.replace("\n", "\r\n").encode())
    assert parse_file(path) == parse_text(DSL)
    bad = tmp_path / "bad.qspec"
    bad.write_bytes(b"version 1\r\nrule fc { wieght = a8 }\r\n")
    with pytest.raises(SpecError) as info:
        parse_file(bad)
    (diag,) = info.value.diagnostics
    assert (diag.span.line, diag.span.col) == (2, 11)
    assert "2 | rule fc { wieght = a8 }" in diag.render()


def test_single_override_string():
    assert load_spec(parse_text(DSL), "input.bits=6").overrides.roles[Role.INPUT].bits == 6


def test_cli_fmt_check(tmp_path, capsys):
    src = tmp_path / "m.qspec"
    src.write_text(DSL)
    assert main(["fmt", str(src), "--check"]) == 1
    assert "not in canonical form" in capsys.readouterr().err
    src.write_text(format_spec(parse_text(DSL), to="qspec"))
    assert main(["fmt", str(src), "--check"]) == 0


def test_cli_fmt_keeps_the_opening_comment_block(tmp_path, capsys):
    src = tmp_path / "m.qspec"
    src.write_text("# header line 1\n# header line 2\n" + DSL)
    assert main(["fmt", str(src), "--to", "toml"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# header line 1\n# header line 2\nversion = 1\n")
    assert parse_text(out, "x.qspec.toml") == parse_text(DSL)

"""``qdsl lint``: exit codes 0/1/2, text, JSON and SARIF 2.1.0 output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qdsl.cli.main import main
from qdsl.lint.codes import CODES

SPECS = Path(__file__).parent / "specs"


def run(capsys, *argv):
    code = main(["lint", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_clean_spec_exits_0(capsys, monkeypatch):
    monkeypatch.chdir(SPECS)
    code, out, _ = run(capsys, "x86-pass.qspec.toml", "--hw", "x86-fbgemm")
    assert code == 0 and out.strip() == "lint against x86-fbgemm: no findings"
    code, _, _ = run(capsys, "x86-pass.qspec.toml", "--hw", "x86-fbgemm",
                     "--model", "qdsl.zoo.models:digits_resnet")
    assert code == 0


def test_findings_exit_1(capsys, monkeypatch):
    monkeypatch.chdir(SPECS)
    code, out, _ = run(capsys, "tflite-fail.qspec.toml", "--hw", "tflite-int8")
    assert code == 1
    assert out.startswith("tflite-fail.qspec.toml:7:8: error[E302]: weight.bits = 4")
    assert out.rstrip().endswith("lint against tflite-int8: 5 errors, 0 warnings")


def test_warnings_alone_exit_1(capsys, monkeypatch, tmp_path):
    spec = tmp_path / "w.qspec.toml"
    spec.write_text('version = 1\nfold_bn = true\n[defaults]\n'
                    'weight = { kind = "int", bits = 8, signed = true, scale = "pot" }\n'
                    'input = { kind = "int", bits = 8, signed = false, scale = "pot" }\n'
                    'bias = { kind = "int", bits = 32, scale = "input*weight" }\n')
    code, out, _ = run(capsys, str(spec), "--hw", "pot-asic-24bit-acc", "--model",
                       "qdsl.zoo.models:conv_bn_relu_net")
    assert code == 1 and "warning[W313]" in out and "error[" not in out


def test_set_override(capsys, monkeypatch):
    monkeypatch.chdir(SPECS)
    code, out, _ = run(capsys, "x86-pass.qspec.toml", "--hw", "x86-fbgemm", "--set", "weight.bits=4")
    assert code == 1
    assert out.startswith("<--set>:1:13: error[E302]: weight.bits = 4 is not supported by x86-fbgemm")
    assert "  hint: use --set weight.bits=8" in out  # the fix in the syntax of where the value is written
    code, _, _ = run(capsys, "tflite-pass.qspec.toml", "--hw", "tflite-int8", "--set", "input.bits=8")
    assert code == 0


@pytest.mark.parametrize("argv,needle", [
    (["nope.qspec.toml", "--hw", "tflite-int8"], "nope.qspec.toml"),
    (["x86-pass.qspec.toml", "--hw", "no-such-hw"], "E191"),
    (["x86-pass.qspec.toml", "--hw", "x86-fbgemm", "--model", "no.such.module:f"], "--model"),
])
def test_unusable_input_exits_2(capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(SPECS)
    code, out, err = run(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err


def test_bad_profile_file_exits_2_with_location(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(SPECS)
    prof = tmp_path / "p.toml"
    prof.write_text('version = 1\n[roles.weight]\nbits = [8]\nkinds = ["itn"]\n')
    code, _, err = run(capsys, "x86-pass.qspec.toml", "--hw", str(prof))
    assert code == 2
    assert "p.toml:4:10: error[E105]: unknown kind 'itn'" in err and "did you mean 'int'" in err


def test_json_output(capsys, monkeypatch):
    monkeypatch.chdir(SPECS)
    code, out, _ = run(capsys, "x86-fail.qspec.toml", "--hw", "x86-fbgemm", "--format", "json")
    assert code == 1
    doc = json.loads(out)
    assert doc["profile"] == "x86-fbgemm" and doc["summary"] == {"errors": 5, "warnings": 0}
    first = doc["diagnostics"][0]
    assert first == {
        "code": "E302", "severity": "error",
        "message": "weight.bits = 4 (from preset 'w4g') is not supported by x86-fbgemm (allowed: 8)",
        "file": "x86-fail.qspec.toml", "line": 7, "column": 8, "end_line": 7, "end_column": 9,
        "path": first["path"], "hints": ["use bits = 8"], "notes": first["notes"],
    }


def _check_sarif(doc: dict) -> None:
    """The properties SARIF 2.1.0 requires (sarif-schema-2.1.0.json), plus what we promise."""
    assert doc["version"] == "2.1.0"
    assert doc["$schema"].endswith("sarif-2.1.0.json")
    assert isinstance(doc["runs"], list) and doc["runs"]
    for run_ in doc["runs"]:
        driver = run_["tool"]["driver"]
        assert driver["name"] == "qdsl"
        ids = [r["id"] for r in driver["rules"]]
        assert len(ids) == len(set(ids)) and set(CODES) <= set(ids)
        for r in driver["rules"]:
            assert r["shortDescription"]["text"]
        for res in run_["results"]:
            assert res["ruleId"] in ids and ids[res["ruleIndex"]] == res["ruleId"]
            assert res["level"] in ("none", "note", "warning", "error")
            assert isinstance(res["message"]["text"], str) and res["message"]["text"]
            assert res["locations"], "every finding has a location"
            for loc in res["locations"]:
                phys = loc.get("physicalLocation")
                if phys is not None:
                    assert phys["artifactLocation"]["uri"]
                    if "region" in phys:
                        assert phys["region"]["startLine"] >= 1 and phys["region"]["startColumn"] >= 1
                else:
                    assert loc["logicalLocations"][0]["fullyQualifiedName"]


def test_sarif_output(capsys, monkeypatch):
    monkeypatch.chdir(SPECS)
    code, out, _ = run(capsys, "pot-asic-fail.qspec.toml", "--hw", "pot-asic-24bit-acc", "--format", "sarif",
                       "--model", "qdsl.zoo.models:conv_bn_relu_net")
    assert code == 1
    doc = json.loads(out)
    _check_sarif(doc)
    results = doc["runs"][0]["results"]
    spec_hits = [r for r in results if "physicalLocation" in r["locations"][0]]
    model_hits = [r for r in results if "physicalLocation" not in r["locations"][0]]
    assert spec_hits and model_hits  # spec findings carry a region, op findings name the layer
    first = spec_hits[0]["locations"][0]["physicalLocation"]
    assert first["artifactLocation"]["uri"] == "pot-asic-fail.qspec.toml"
    assert first["region"]["startLine"] == 7 and first["region"]["startColumn"] == 8
    assert model_hits[0]["locations"][0]["logicalLocations"][0]["fullyQualifiedName"] == "features.1"


def test_sarif_override_findings_have_a_location(capsys, monkeypatch):
    monkeypatch.chdir(SPECS)
    code, out, _ = run(capsys, "x86-pass.qspec.toml", "--hw", "x86-fbgemm", "--format", "sarif",
                       "--set", "weight.bits=4")
    assert code == 1
    doc = json.loads(out)
    _check_sarif(doc)
    (res,) = doc["runs"][0]["results"]
    assert res["ruleId"] == "E302"
    assert res["locations"][0]["logicalLocations"][0]["fullyQualifiedName"] == "<--set>"


def test_sarif_clean_run_is_valid(capsys, monkeypatch):
    monkeypatch.chdir(SPECS)
    code, out, _ = run(capsys, "x86-pass.qspec.toml", "--hw", "x86-fbgemm", "--format", "sarif")
    assert code == 0
    doc = json.loads(out)
    _check_sarif(doc)
    assert doc["runs"][0]["results"] == []

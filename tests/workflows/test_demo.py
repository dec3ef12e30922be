"""``qdsl demo --quick`` runs the whole pipeline and its summary says what it measured."""

from qdsl.cli.main import main


def test_demo_quick_end_to_end(capsys):
    assert main(["demo", "--quick", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    # training shows progress: one line per epoch when stderr is not a terminal (the QAT
    # always trains; the float models may come from the training cache)
    assert [line.split()[:4] for line in captured.err.splitlines() if "binary QAT epoch" in line] == [
        ["binary", "QAT", "epoch", f"{e}/3"] for e in (1, 2, 3)]
    rows = {line[:28].strip(): line[28:].strip() for line in out.splitlines() if line.strip()}
    float_acc = float(rows["float model"].split("%")[0])
    assert float_acc > 97.0
    assert float(rows["PTQ W8A8"].split("%")[0]) >= float_acc - 0.5
    assert float(rows["binary QAT (XNOR)"].split("%")[0]) >= 85.0
    assert rows["C++ runtime == reference"].startswith("yes") or rows.get("C++ runtime", "").startswith("not built")
    assert rows["integer vs fake-quant"].startswith("100.00% same top-1")
    assert "max |logit difference| 0.00e+00" in rows["integer vs fake-quant"]  # PoT scales: bit-exact
    assert rows["lint vs pot-asic-24bit-acc"].startswith("0 errors")


def test_demo_with_a_bad_spec_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.qspec"
    bad.write_text("version 1\ndefaults { weight = int(bitz=4) }\n")
    assert main(["demo", "--quick", "--spec", str(bad)]) == 2
    assert "bad.qspec:2:" in capsys.readouterr().err

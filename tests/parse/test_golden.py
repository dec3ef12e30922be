"""The grammar corpus: valid files load and round-trip; invalid files give exactly their golden diagnostics.

Run ``pytest tests/parse --update-goldens`` after an intended change to the messages,
then review the diff of ``grammar/invalid/*.expected``.
"""

from pathlib import Path

import pytest

from qdsl.parse import format_spec, load_spec, parse_file, parse_text
from qdsl.spec.diagnostics import SpecError

ROOT = Path(__file__).resolve().parents[2]
VALID = sorted((ROOT / "grammar" / "valid").glob("*.qspec*"))
INVALID = sorted(p for p in (ROOT / "grammar" / "invalid").glob("*.qspec*") if not p.name.endswith(".expected"))


def test_corpus_is_substantial():
    assert len(INVALID) >= 15
    assert any(p.name.endswith(".toml") for p in INVALID)
    assert len(VALID) >= 3


@pytest.mark.parametrize("path", VALID, ids=[p.name for p in VALID])
def test_valid_files(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    rel = path.relative_to(ROOT)
    load_spec(rel)  # includes resolve
    raw = parse_file(rel)
    for to, name in (("qspec", "x.qspec"), ("toml", "x.qspec.toml")):
        assert parse_text(format_spec(raw, to=to), name) == raw


@pytest.mark.parametrize("path", INVALID, ids=[p.name for p in INVALID])
def test_invalid_files_match_goldens(path, monkeypatch, request):
    monkeypatch.chdir(ROOT)
    rel = path.relative_to(ROOT)
    with pytest.raises(SpecError) as info:
        load_spec(rel)
    got = info.value.render() + "\n"
    golden = path.with_name(path.name + ".expected")
    if request.config.getoption("--update-goldens", default=False):
        golden.write_text(got)
    assert golden.exists(), f"no golden for {path.name}; run pytest tests/parse --update-goldens"
    assert got == golden.read_text()
    # every diagnostic is located on a real line of some file, with a caret
    for diag in info.value.diagnostics:
        assert diag.span.line >= 1
        assert "^" in diag.render()

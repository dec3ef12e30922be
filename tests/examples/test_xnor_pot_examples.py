"""Smoke runs of examples/xnor_binary_qat.py and examples/pot_conv1d_asic.py (``--quick``).

Each runs its example's ``main(["--quick"])`` end to end and checks the printed figures:

* xnor: binary QAT recovers from the calibration-only accuracy to >= 85 % on digits
  (measured 96.7-97.1 % in the quick run), the C++ runtime equals the reference executor
  bit for bit, the integer graph agrees with the fake-quant model on >= 97 % of top-1
  (measured 99.8-100 %), and the ``.qgraph`` is > 10x smaller than the float weights.
* pot: lint clean against pot-asic-24bit-acc, C++ == reference, integer graph == fake-quant
  bit for bit (power-of-two scales), every requantization a shift, every accumulator
  bound ordered observed <= exact <= worst case and within the 24-bit budget, no
  saturation, QAT accuracy >= 80 % (measured 85.4 %; float 84.0 %).

Both use one torch thread (as the ptq tests do): on two shared cores a second
intra-op thread mostly spins.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _example(stem: str):
    name = f"_qdsl_example_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _runtime_built() -> bool:
    from qdsl import runtime

    return runtime.available()


def _pct(text: str) -> float:
    return float(re.match(r"([\d.]+)%", text).group(1))


def _tables(out: str) -> dict[str, dict[str, list[str]]]:
    """Markdown tables by their header line; each maps a row's first cell to its other cells."""
    tables: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in out.splitlines():
        if not line.startswith("|"):
            current = None
        elif not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if current is None:
                current = tables.setdefault(" | ".join(cells), {})
            else:
                current[cells[0]] = cells[1:]
    return tables


def test_xnor_binary_qat_quick(capsys, one_thread):
    assert _example("xnor_binary_qat").main(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = _tables(out)["stage | result | detail"]
    assert "features.3 binary, features.6 binary" in out and "BCONV2D" in out, out
    calib = _pct(rows["binary, after calibration"][0])
    epochs = [_pct(rows[f"QAT epoch {i}"][0]) for i in (1, 2, 3)]
    final = _pct(rows["binary QAT, frozen"][0])
    graph = _pct(rows["integer graph"][0])
    assert final >= 85.0 and final > calib + 10, out
    assert epochs[-1] == final  # the last epoch trains the inference forward; freeze changes nothing
    assert abs(graph - final) <= 2.0, out
    assert _pct(rows["integer vs fake-quant"][0]) >= 97.0, out
    qgraph_kib = float(rows[".qgraph size"][0].split()[0])
    ratio = float(re.search(r"([\d.]+)x smaller", rows[".qgraph size"][1]).group(1))
    assert 0 < qgraph_kib and ratio > 10, out
    if _runtime_built():
        assert rows["C++ == reference"][0] == "yes (bit-identical)", out


def test_pot_conv1d_asic_quick(capsys, one_thread):
    assert _example("pot_conv1d_asic").main(["--quick"]) == 0
    out = capsys.readouterr().out
    tables = _tables(out)
    assert "pot-asic-24bit-acc: clean (0 diagnostics)" in out, out
    assert "== fake-quant model bit for bit: yes (max |Δ logit| 0.00e+00, top-1 agreement 100.00%)" in out, out
    if _runtime_built():
        assert "C++ == reference: yes (bit-identical)" in out, out
    accs = {k: _pct(v[0]) for k, v in tables["model | test accuracy"].items()}
    assert set(accs) == {"float", "PTQ", "QAT", "integer graph"}, out
    assert accs["integer graph"] == accs["QAT"] >= 80.0, out
    assert accs["PTQ"] >= 75.0, out
    # every weighted layer and the pool requantize with a shift only (or not at all)
    shifts = tables["op | type | shift -> output | stage"]
    assert list(shifts) == ["features.0", "features.3", "features.6", "pool", "classifier"], out
    assert all(re.fullmatch(r"(>>\d+|0)(, >>\d+)* -> (I8|I32)", v[1]) for v in shifts.values()), out
    assert shifts["features.0"][1].endswith("-> I8") and shifts["pool"][1].endswith("-> I8"), out
    acc_header = "op | fan-in | worst case (bit widths) | exact bound (weights+bias) | observed | budget | saturated"
    acc_rows = tables[acc_header]
    assert list(acc_rows) == ["features.0", "features.3", "features.6", "classifier"], out
    for name, (fan_in, worst, exact, seen, budget, saturated) in acc_rows.items():
        assert int(seen) <= int(exact) <= int(worst), (name, out)
        assert int(exact) <= int(budget) == 24 and int(saturated) == 0, (name, out)
    # features.3: 16 channels x 3 taps of int4 codes [-8, 7] on ReLU outputs [0, 127]:
    # 48 * 8 * 127 = 48768 needs 17 bits before the bias (measured 17 with it)
    assert acc_rows["features.3"][0] == "48" and int(acc_rows["features.3"][1]) >= 17, out

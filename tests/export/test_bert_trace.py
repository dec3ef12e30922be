"""A BERT-shaped model (Hugging Face's BertModel constructs: tests/export/bert_models.py) and the
real BertModel (only when ``transformers`` is installed) do not trace yet; export must then say
which module and which statement stopped torch.fx, not only the exception."""

from __future__ import annotations

import pytest
import torch

import qdsl
from qdsl.export.values import ExportError
from qdsl.parse import parse_text

from tests.export.bert_models import TinyBert

SPEC = """
version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
defaults {
  weight = w8
  input = a8
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
"""


def _frozen(model, batch):
    model.eval()
    qdsl.apply(model, parse_text(SPEC, "t.qspec"))
    qdsl.calibrate(model, [batch])
    qdsl.freeze(model)
    return model


def test_tiny_bert_trace_failure_names_module_and_statement():
    # position/token-type ids sliced from a buffer by the input's length: fx cannot slice a real
    # tensor with a proxy; before, the error named only the root class and the TypeError
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    model = _frozen(TinyBert(), {"input_ids": ids, "attention_mask": mask})
    with pytest.raises(ExportError) as ei:
        qdsl.export(model, {"input_ids": ids[:1], "attention_mask": mask[:1]})
    assert ei.value.where == "embeddings"
    text = str(ei.value)
    assert "cannot export 'embeddings'" in text and "Embeddings.forward" in text
    assert "bert_models.py:" in text and "self.token_type_ids[:, :length]" in text


def test_hf_bert_trace_failure_is_located():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False)
    ids = torch.randint(0, 60, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    _frozen(model, {"input_ids": ids, "attention_mask": mask})
    with pytest.raises(ExportError) as ei:
        qdsl.export(model, {"input_ids": ids[:1], "attention_mask": mask[:1]})
    text = str(ei.value)
    # the statement that failed, with its file, whichever construct it is in this version
    assert "torch.fx cannot trace BertModel" in text and " at " in text and ".py:" in text


def test_transformer_int8_spec_quantizes_embeddings_and_layernorms():
    # specs/transformer-int8.qspec: every Embedding (per-row int8 table, 8-bit output) and every
    # LayerNorm input on top of the Linear layers; the fake-quant model stays close to float
    from pathlib import Path

    from qdsl.parse import load_spec
    from qdsl.patch.handle import get_handle

    spec = load_spec(Path(__file__).resolve().parents[2] / "specs" / "transformer-int8.qspec")
    torch.manual_seed(0)
    model = TinyBert().eval()
    ids = torch.randint(0, 50, (8, 12))
    mask = torch.ones(8, 12, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        want = model(ids, mask)[0]
    handle = qdsl.apply(model, spec)
    names = set(handle.layers)
    emb = {f"embeddings.{n}_embeddings" for n in ("word", "position", "token_type")}
    norms = {n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    assert emb | norms <= names and len(norms) == 5
    qdsl.calibrate(model, [{"input_ids": ids, "attention_mask": mask}])
    qdsl.freeze(model)
    h = get_handle(model)
    assert all(h.quantizer(n, "output") is not None for n in emb)
    assert all(h.quantizer(n, "input") is not None for n in norms)
    with torch.no_grad():
        got = model(ids, mask)[0]
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos >= 0.98


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # data-dependent control flow: fx's TraceError
            y = -y
        return y


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 4)
        self.block = _Branchy()

    def forward(self, x):
        return self.block(self.head(x))


def test_control_flow_trace_failure_names_the_submodule():
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    model = _Outer().eval()
    qdsl.apply(model, parse_text(SPEC, "t.qspec"))
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    with pytest.raises(ExportError) as ei:
        qdsl.export(model, x[:1])
    assert ei.value.where == "block"
    assert "_Branchy.forward" in str(ei.value) and "if y.sum() > 0:" in str(ei.value)

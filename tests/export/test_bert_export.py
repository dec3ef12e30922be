"""A BERT-shaped encoder (tests/export/bert_models.py: Hugging Face BertModel's constructs)
through the integer graph: the trace carries the example's sizes (position and token-type ids
sliced from buffers fold to constants), the embeddings' chained sum and every post-norm
residual sum reach LAYERNORM at a wide int32 grid and its output stays wide (I32) on the
residual path while the next Linears read 8-bit codes (specs/transformer-int8.qspec leaves
LayerNorm inputs and outputs in float), C++ equals the reference executor."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qdsl
import qdsl.runtime as rt
from qdsl.export.lower_attn import wide_sum_grid
from qdsl.export.values import ExportError
from qdsl.graph.ir import DType, OpType
from qdsl.parse import parse_text
from qdsl.runtime.run import run_graph

from tests.export.attn_models import BERT_ATTENTION as ATTENTION, SPEC_FILE, bert_int8_spec, cos
from tests.export.bert_models import TinyBert


@pytest.fixture(scope="module")
def exported():
    torch.manual_seed(0)
    model = TinyBert(pooler=False, softmax_module=True).eval()
    ids = torch.randint(0, 50, (16, 12))
    with torch.no_grad():
        want = model(ids).numpy()
    qdsl.apply(model, bert_int8_spec())
    qdsl.calibrate(model, [{"input_ids": ids[:8]}, {"input_ids": ids[8:]}])
    qdsl.freeze(model)
    with torch.no_grad():
        fq = model(ids).numpy()
    graph = qdsl.export(model, {"input_ids": ids[:1]})
    return graph, ids.numpy(), want, fq


def test_tiny_bert_exports_with_wide_layernorm_inputs(exported):
    graph, ids, want, fq = exported
    lns = [op for op in graph.ops if op.type is OpType.LAYERNORM]
    assert len(lns) == 5 and all(len(op.inputs) == 2 for op in lns)
    # the embeddings: the word lookup's codes plus the position + token-type constant (1, L, E)
    emb = graph.tensor(lns[0].inputs[1])
    assert emb.is_constant and emb.dtype is DType.I32 and tuple(emb.shape) == (1, 12, 32)
    # the residual LayerNorms read a Linear's int32 result and the 8-bit residual
    assert all(graph.tensor(op.inputs[0]).dtype is DType.I32 for op in lns[1:])
    assert tuple(graph.inputs) == ("input",) and graph.tensor("input").dtype is DType.I32
    got = np.asarray(run_graph(graph, ids, backend="reference"))
    # graph vs float as close as the fake-quant model, graph vs fake-quant: a few output LSBs
    assert cos(got, want) >= 0.999 and cos(fq, want) >= 0.999
    assert cos(got, fq) >= 0.9999
    print(f"\ncos(graph, float) {cos(got, want):.6f}  cos(fq, float) {cos(fq, want):.6f}  "
          f"cos(graph, fq) {cos(got, fq):.7f}  max |graph - fq| {np.abs(got - fq).max():.4f}")


def test_layernorm_outputs_stay_wide(exported):
    # the spec leaves LayerNorm outputs unquantized: each LAYERNORM writes I32 (its
    # accumulator), the next residual LayerNorm reads it as its second term, the Linears'
    # 8-bit input quantizers REQUANTIZE it (q/k/v share one), and the model output is the last
    # LayerNorm's I32 value dequantized
    graph, *_ = exported
    lns = [op for op in graph.ops if op.type is OpType.LAYERNORM]
    wide = {op.outputs[0] for op in lns}
    assert all(graph.tensor(n).dtype is DType.I32 for n in wide)
    assert all(op.inputs[1] in wide for op in lns[1:])
    readers = [op for op in graph.ops if set(op.inputs) & wide and op.type is not OpType.LAYERNORM]
    assert sorted(op.type.name for op in readers) == ["DEQUANTIZE"] + ["REQUANTIZE"] * 4
    assert all(graph.tensor(op.outputs[0]).dtype in (DType.U8, DType.I8) for op in readers
               if op.type is OpType.REQUANTIZE)


def test_wide_layernorm_outputs_beat_8_bit_ones():
    # the same tiny BERT with 8-bit LayerNorm outputs (the previous transformer-int8): the
    # residual adds then read 8-bit codes; wide outputs are closer to float and to fake-quant
    results = {}
    for name, extra in (("wide", ""), ("8-bit", "rule type:LayerNorm optional { output = a8 }\n")):
        torch.manual_seed(0)
        model = TinyBert(pooler=False, softmax_module=True).eval()
        ids = torch.randint(0, 50, (16, 12))
        with torch.no_grad():
            want = model(ids).numpy()
        qdsl.apply(model, bert_int8_spec(extra))
        qdsl.calibrate(model, [{"input_ids": ids[:8]}, {"input_ids": ids[8:]}])
        qdsl.freeze(model)
        with torch.no_grad():
            fq = model(ids).numpy()
        graph = qdsl.export(model, {"input_ids": ids[:1]})
        got = np.asarray(run_graph(graph, ids.numpy(), backend="reference"))
        results[name] = (cos(got, want), cos(got, fq))
        print(f"\n{name} LayerNorm outputs: cos(graph, float) {results[name][0]:.6f}  "
              f"cos(graph, fq) {results[name][1]:.7f}")
    assert results["wide"][0] >= results["8-bit"][0]
    # the wide sums on the finest grid their worst case allows (lower_attn.wide_sum_grid): graph and
    # fake-quant agree either way (at an accumulator's unit: wide 0.9999987, 8-bit 0.9999948)
    assert results["wide"][1] >= 0.9999999 and results["8-bit"][1] >= 0.9999999


@pytest.mark.skipif(not rt.available(), reason="C++ runtime not built")
def test_tiny_bert_cpp_equals_reference(exported):
    from qdsl.runtime import kernels as K

    graph, ids, _, _ = exported
    want = np.asarray(run_graph(graph, ids, backend="reference"))
    cg = rt.CompiledGraph(graph)
    for path in K.paths()["cpu"]:  # the wide LAYERNORM outputs and their I32 REQUANTIZEs too
        np.testing.assert_array_equal(np.asarray(cg.run(ids, path=path)), want, err_msg=f"path {path}")


def test_layernorm_with_quantized_input_keeps_the_narrow_form():
    # a spec that quantizes the LayerNorm inputs (the previous transformer-int8) still lowers
    # to the one-input LAYERNORM reading 8-bit codes
    torch.manual_seed(1)
    model = TinyBert(pooler=False, softmax_module=True, layers=1).eval()
    ids = torch.randint(0, 50, (8, 12))
    encoder_ln_inputs = "rule re:'encoder\\..*\\.LayerNorm' { input = a8 }\n"
    qdsl.apply(model, bert_int8_spec(encoder_ln_inputs))
    qdsl.calibrate(model, [{"input_ids": ids}])
    qdsl.freeze(model)
    graph = qdsl.export(model, {"input_ids": ids[:1]})
    lns = [op for op in graph.ops if op.type is OpType.LAYERNORM]
    assert len(lns) == 3 and len(lns[0].inputs) == 2  # the embeddings' sum stays wide
    assert all(len(op.inputs) == 1 and graph.tensor(op.inputs[0]).dtype in (DType.U8, DType.I8) for op in lns[1:])


def test_quantized_embedding_sum_is_refused_by_name():
    # a quantizer on word + position + token-type: the graph has no add of a constant
    torch.manual_seed(1)
    model = TinyBert(pooler=False, softmax_module=True, layers=1).eval()
    ids = torch.randint(0, 50, (8, 12))
    qdsl.apply(model, parse_text(SPEC_FILE.read_text() + ATTENTION + "rule embeddings.LayerNorm { input = a8 }\n",
                                 "t.qspec"))
    qdsl.calibrate(model, [{"input_ids": ids}])
    qdsl.freeze(model)
    with pytest.raises(ExportError) as ei:
        qdsl.export(model, {"input_ids": ids[:1]})
    assert ei.value.where == "embeddings.LayerNorm" and "constant" in str(ei.value)


def test_functional_softmax_is_refused_naming_module_and_op():
    # Hugging Face's eager attention calls F.softmax inside the self-attention module: no module
    # returns the scores, so nothing quantizes them, and export says where
    torch.manual_seed(0)
    model = TinyBert(pooler=False).eval()
    ids = torch.randint(0, 50, (8, 12))
    qdsl.apply(model, parse_text(SPEC_FILE.read_text() + ATTENTION.split("rule type")[0], "t.qspec"))
    qdsl.calibrate(model, [{"input_ids": ids}])
    qdsl.freeze(model)
    with pytest.raises(ExportError) as ei:
        qdsl.export(model, {"input_ids": ids[:1]})
    assert ei.value.where == "encoder.layer.0.attention.self"
    assert "softmax" in str(ei.value)


class _TwoNorms(torch.nn.Module):
    """norm1(h) + norm2(h): a residual add of two LayerNorm results, both kept wide."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
        self.norm1, self.norm2, self.norm3 = (torch.nn.LayerNorm(32) for _ in range(3))
        with torch.no_grad():
            for n in (self.norm1, self.norm2):
                n.weight.uniform_(0.5, 3.0)
                n.bias.uniform_(-1.0, 1.0)

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.norm3(self.norm1(h) + self.norm2(h)))


def test_add_of_two_wide_layernorm_outputs():
    # both operands are LAYERNORM I32 outputs, rounded onto the add's grid; C++ == reference
    torch.manual_seed(3)
    model = _TwoNorms().eval()
    x = torch.randn(8, 10, 16)
    qdsl.apply(model, parse_text(SPEC_FILE.read_text() + "rule head { output = a8 }\n", "t.qspec"))
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    with torch.no_grad():
        fq = model(x).numpy()
    graph = qdsl.export(model, x[:1])
    lns = {op.name: op for op in graph.ops if op.type is OpType.LAYERNORM}
    assert all(graph.tensor(lns[n].outputs[0]).dtype is DType.I32 for n in ("norm1", "norm2"))
    got = np.asarray(run_graph(graph, x.numpy(), backend="reference"))
    assert cos(got, fq) >= 0.9999
    if rt.available():
        np.testing.assert_array_equal(np.asarray(run_graph(graph, x.numpy(), backend="cpp")), got)


ROLES = """
rule re:'.*\\.(query|key|value|intermediate\\.dense)' { output = a8 }
rule re:'.*attention\\.self' { scores = a8  probs = a8 }
"""


def _roles_export(mask: bool, layers: int = 2):
    torch.manual_seed(0)
    model = TinyBert(pooler=False, layers=layers).eval()
    ids = torch.randint(0, 50, (16, 12))
    am = torch.ones(16, 12, dtype=torch.long)
    am[::2, 7:] = 0  # padding in every other sentence
    am[1, 2:] = 0

    def kw(sl):
        return {"input_ids": ids[sl], **({"attention_mask": am[sl]} if mask else {})}
    with torch.no_grad():
        want = model(**kw(slice(None))).numpy()
    qdsl.apply(model, parse_text(SPEC_FILE.read_text() + ROLES, "t.qspec"))
    qdsl.calibrate(model, [kw(slice(0, 8)), kw(slice(8, 16))])
    qdsl.freeze(model)
    with torch.no_grad():
        fq = model(**kw(slice(None))).numpy()
    graph = qdsl.export(model, kw(slice(0, 1)))
    inputs = {"input_ids": ids.numpy(), "attention_mask": am.numpy()} if mask else ids.numpy()
    return graph, inputs, want, fq, am.numpy()


@pytest.mark.parametrize("mask", [False, True], ids=["no-mask", "mask"])
def test_functional_softmax_exports_with_scores_probs_roles(mask):
    # Hugging Face's eager attention: F.softmax inside the self-attention module, whose
    # scores/probs roles put the quantizers around it
    graph, inputs, want, fq, am = _roles_export(mask)
    op = OpType.SOFTMAX_MASKED if mask else OpType.SOFTMAX
    assert sum(o.type is op for o in graph.ops) == 2
    got = _out(run_graph(graph, inputs, backend="reference"))
    if mask:  # padded tokens' states are not compared (the model computes them, nobody reads them)
        keep = am.astype(bool)
        got, want, fq = got[keep], want[keep], fq[keep]
    print(f"\n{op.name}: cos(graph, float) {cos(got, want):.6f}  cos(fq, float) {cos(fq, want):.6f}  "
          f"cos(graph, fq) {cos(got, fq):.7f}")
    assert cos(got, want) >= 0.999 and cos(got, fq) >= 0.9999
    if rt.available():
        np.testing.assert_array_equal(_out(run_graph(graph, inputs, backend="cpp")),
                                      _out(run_graph(graph, inputs, backend="reference")))


def _out(result):
    return np.asarray(result["output"] if isinstance(result, dict) else result)


class _OddMask(TinyBert):
    # an additive mask that is not 0 / finfo.min: scaled by 0.5 after the fact
    def forward(self, input_ids, attention_mask=None):
        ext = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * -0.5
        return self.encoder(self.embeddings(input_ids), ext)


def test_a_mask_that_is_not_a_padding_mask_is_refused_naming_module_and_op():
    torch.manual_seed(0)
    model = _OddMask(pooler=False, layers=1).eval()
    ids = torch.randint(0, 50, (4, 12))
    am = torch.ones(4, 12, dtype=torch.long)
    am[0, 6:] = 0
    qdsl.apply(model, parse_text(SPEC_FILE.read_text() + ROLES, "t.qspec"))
    qdsl.calibrate(model, [{"input_ids": ids, "attention_mask": am}])
    qdsl.freeze(model)
    with pytest.raises(ExportError) as ei:
        qdsl.export(model, {"input_ids": ids[:1], "attention_mask": am[:1]})
    assert ei.value.where == "encoder.layer.0.attention.self"
    assert "not a padding mask" in str(ei.value) and "attention_mask" in str(ei.value)


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-6, 1e6), st.integers(1, 8192), st.sampled_from([0.0, 1e-12, 1e-5, 1e-3]))
def test_wide_sum_grid_is_the_finest_power_of_two_the_worst_case_allows(bound, n, eps):
    s = wide_sum_grid(bound, n, eps)
    assert math.frexp(s)[0] == 0.5  # a power of two
    assert bound / s < 2**30 and n**3 * eps / (s * s) < 2**60  # no int32 saturation, eps in int64
    finer = s / 2
    assert bound / finer >= 2**30 or n**3 * eps / (finer * finer) >= 2**60

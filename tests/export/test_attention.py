"""Attention blocks end to end (apply -> calibrate -> freeze -> export): act × act matmuls
with transposes folded in (MATMUL), softmax (SOFTMAX), LayerNorm (LAYERNORM) and GELU (LUT)
in the integer graph; the C++ runtime equals the reference executor bit for bit on every
path; the graph's output is within cosine 0.99 of the float model and agrees with the
fake-quant model (most codes equal, none off by more than a few LSB); the operands of the
products and the softmax/LayerNorm inputs get implied quantizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qdsl
import qdsl.runtime as rt
from qdsl.export.values import ExportError
from qdsl.graph import execute
from qdsl.graph.ir import OpType
from qdsl.parse import parse_text
from qdsl.patch.handle import get_handle
from qdsl.spec.model import Role

from tests.export.attn_models import Attention, EncoderBlock, cos, head_spec

SPEC = head_spec("final")



def _pipeline(model, spec=SPEC, seed=0):
    torch.manual_seed(seed)
    model.eval()
    xt = torch.randn(4, 10, 16)
    with torch.no_grad():
        want_float = model(xt).numpy()
    qdsl.apply(model, parse_text(spec, "t.qspec"))
    calib = torch.randn(64, 10, 16)
    qdsl.calibrate(model, [calib[:32], calib[32:]])
    qdsl.freeze(model)
    graph = qdsl.export(model, xt[:1])
    with torch.no_grad():
        fq = model(xt).numpy()
    return graph, xt, want_float, fq


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("functional", [False, True])
def test_encoder_block_exports_runs_in_cpp_and_agrees(norm_first, functional):
    torch.manual_seed(1)
    model = EncoderBlock(norm_first=norm_first, functional=functional)
    graph, xt, want_float, fq = _pipeline(model)
    types = [op.type for op in graph.ops]
    assert types.count(OpType.MATMUL) == 2 and types.count(OpType.SOFTMAX) == 1
    assert types.count(OpType.LAYERNORM) == 3 and OpType.LUT in types  # GELU: a table
    ref = execute(graph, xt.numpy()).outputs[0]
    if rt.available():
        from qdsl.runtime import kernels as K

        cg = rt.CompiledGraph(graph)
        for path in K.paths()["cpu"]:
            np.testing.assert_array_equal(cg.run(xt.numpy(), path=path), ref, err_msg=f"path {path}")
    cos_float, cos_fq = cos(ref, want_float), cos(ref, fq)
    q = get_handle(model).quantizer("final", "output")
    lsb = np.abs(ref - fq) / float(q.scale)
    print(f"norm_first={norm_first} functional={functional}: cos(graph, float) {cos_float:.5f}, "
          f"cos(graph, fake-quant) {cos_fq:.6f}, output codes equal {np.mean(lsb < 0.5):.4f}, within 1 LSB {np.mean(lsb < 1.5):.4f}, max {lsb.max():.0f} LSB")
    assert cos_float >= 0.99
    # the frozen fake-quant LayerNorms and softmax compute the graph's LAYERNORM and SOFTMAX
    # (qdsl.patch.int_sim): every output code equal (float LayerNorm/softmax: 95.6-99.1%)
    assert cos_fq >= 0.999999
    assert np.mean(lsb < 0.5) == 1.0


def test_products_and_norms_get_implied_quantizers():
    torch.manual_seed(2)
    model = EncoderBlock()
    _pipeline(model)
    plan = get_handle(model).plan
    why = {(lp.fqn, role): p.set_by.label for lp in plan.layers for role in (Role.INPUT, Role.OUTPUT)
           if (p := lp.provenance.get((role, "kind"))) is not None}
    for fqn in ("attn.q", "attn.k", "attn.v", "attn.softmax"):
        assert why[(fqn, Role.OUTPUT)] == "implied by matmul in 'attn'"
    # the scores q @ kᵀ / sqrt(d) and the residual sum are returned by no module: the reader's input
    assert why[("attn.softmax", Role.INPUT)] == "implied by softmax 'attn.softmax'"
    assert why[("norm1", Role.INPUT)] == "implied by layer_norm 'norm1'"
    assert why[("ff1", Role.OUTPUT)] == "implied by gelu 'act'"


class SoftmaxOverQueries(torch.nn.Module):
    def __init__(self, e: int = 32):
        super().__init__()
        self.q, self.k, self.v, self.out = (torch.nn.Linear(e, e) for _ in range(4))
        self.softmax = torch.nn.Softmax(dim=1)  # (B, L, L) scores: over the queries, not the last axis

    def forward(self, x):
        return self.out(self.softmax(self.q(x) @ self.k(x).transpose(1, 2)) @ self.v(x))


class ProductWithWeight(torch.nn.Module):
    def __init__(self, e: int = 32):
        super().__init__()
        self.q, self.k, self.out = (torch.nn.Linear(e, e) for _ in range(3))

    def forward(self, x):
        return self.out(torch.matmul(self.q(x), self.k.weight) + self.k(x))


@pytest.mark.parametrize("model, match", [
    (SoftmaxOverQueries(), r"cannot export 'softmax': softmax along dim 1 has no integer lowering"),
    (ProductWithWeight(), r"cannot export '<model>': the forward reads the tensor attribute 'k.weight'"),
])
def test_unsupported_attention_constructs_name_the_module(model, match):
    model.eval()
    qdsl.apply(model, parse_text(SPEC.replace("rule final", "rule out"), "t.qspec"))
    qdsl.calibrate(model, [torch.randn(8, 10, 32)])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match=match):
        qdsl.export(model, torch.randn(1, 10, 32))


class TokenMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc(x)))


def test_linear_on_a_sequence_exports_to_onnx_as_matmul():
    # Gemm takes 2-D inputs: a LINEAR on N×L×K is MatMul with the transposed weight, then Add
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from qdsl.export.onnx import export_onnx

    torch.manual_seed(0)
    model = TokenMLP().eval()
    qdsl.apply(model, parse_text(SPEC.replace("rule final", "rule fc2"), "t.qspec"))
    x = torch.randn(16, 5, 8)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    basic = ort.SessionOptions()
    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    runs = []
    for example in (x, x.reshape(-1, 8)):  # the sequence export and the 2-D (Gemm) one
        proto = export_onnx(model, example[:1])
        sess = ort.InferenceSession(proto.SerializeToString(), basic)
        runs.append(sess.run(None, {sess.get_inputs()[0].name: example.numpy()})[0])
    assert {n.op_type for n in export_onnx(model, x[:1]).graph.node} >= {"MatMul", "Transpose", "Add"}
    np.testing.assert_array_equal(runs[0].reshape(-1, 3), runs[1])
    with torch.no_grad():
        fq = model(x).numpy()
    assert np.abs(runs[0] - fq).max() <= 0.01 * np.abs(fq).max()

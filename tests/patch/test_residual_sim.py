"""Frozen fake quantization adds a post-norm residual sum as the integer graph does
(qdsl.patch.residual_sim): exact Linear sums on codes, the exporter's wide-sum grid and term
rescales, the embeddings' lookup plus folded constant, the REQUANTIZE of a wide LayerNorm
output and a Linear's one-rounding output stage.  So a post-norm encoder's fake-quant output
equals the graph's (reference executor) code for code, end to end and per block (MiniLM:
tests/export/test_bert_trace.py::test_minilm_exports_with_its_attention_mask)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import qdsl
from qdsl.graph import execute
from qdsl.graph.ops.layernorm import layernorm_constants
from qdsl.parse import parse_text
from qdsl.patch.handle import get_handle
from qdsl.patch.int_sim import mark_graph_value

from tests.export.attn_models import TEL_SPEC, bert_int8_spec
from tests.export.bert_models import TinyBert


def _unit(ln: nn.LayerNorm) -> np.float32:
    """The float32 unit of a LayerNorm's wide output (its accumulator's real value)."""
    w, b = ln.weight.detach().double().numpy(), ln.bias.detach().double().numpy()
    return np.float32(layernorm_constants(ln.normalized_shape[0], w, b, ln.eps, 1.0)[2])


@pytest.fixture(scope="module")
def tiny_bert():
    torch.manual_seed(0)
    model = TinyBert(pooler=False, softmax_module=True).eval()
    ids = torch.randint(0, 50, (16, 12))
    qdsl.apply(model, bert_int8_spec())
    qdsl.calibrate(model, [{"input_ids": ids[:8]}, {"input_ids": ids[8:]}])
    qdsl.freeze(model)
    graph = qdsl.export(model, {"input_ids": ids[:1]})
    return model, graph, ids


def test_post_norm_bert_fake_quant_equals_the_graph_end_to_end(tiny_bert):
    # the embeddings' wide sum, every LayerNorm(dense(h) + x) and the 8-bit reads of the wide
    # outputs as the graph computes them: the hidden states (the last LAYERNORM's wide output,
    # dequantized) are equal to the bit (before: 99.5% of the values, a few LSB of the 8-bit
    # q/k/v codes apart at near-ties of the float32 sums)
    model, graph, ids = tiny_bert
    with torch.no_grad():
        fq = model(ids).numpy()
    np.testing.assert_array_equal(fq, execute(graph, ids.numpy()).outputs[0])


def test_post_norm_bert_blocks_fed_the_graph_input_equal_it(tiny_bert):
    # each encoder block fed the graph's own input (the previous LAYERNORM's accumulator,
    # marked so the residual sums read it as the graph does): its output equals the graph's
    model, graph, ids = tiny_bert
    env = execute(graph, ids.numpy(), keep_values=True).values
    handle, layers = get_handle(model), model.encoder.layer
    masks = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: masks.__setitem__(i, a[1:]))
             for i, layer in enumerate(layers)]
    with torch.no_grad():
        model(ids)
    for hk in hooks:
        hk.remove()
    prev = ("embeddings.LayerNorm", model.embeddings.LayerNorm)
    for i, layer in enumerate(layers):
        acc = env[f"{prev[0]}:layernorm"]
        x = torch.from_numpy(acc.astype(np.float32) * _unit(prev[1]))
        mark_graph_value(handle, x, prev[1], acc)
        with torch.no_grad():
            out = layer(x, *masks[i]).numpy()
        prev = (f"encoder.layer.{i}.output.LayerNorm", layer.output.LayerNorm)
        want = env[f"{prev[0]}:layernorm"].astype(np.float32) * _unit(prev[1])
        np.testing.assert_array_equal(out, want, err_msg=f"block {i}")


def test_simulated_residual_sum_keeps_the_float_gradient(tiny_bert):
    # straight-through: the gradient reaches the Linears under the simulated sums
    model, graph, ids = tiny_bert
    dense = model.encoder.layer[0].attention.output.dense
    model.zero_grad()
    model(ids[:2]).square().sum().backward()
    grad = dense.weight_float.grad if hasattr(dense, "weight_float") else None
    grad = grad if grad is not None else next(p.grad for n, p in dense.named_parameters() if "weight" in n)
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


class _Encoder(nn.Module):
    """embed -> two post-norm nn.TransformerEncoderLayers -> head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.layers = nn.Sequential(*(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
                                      for _ in range(2)))
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.layers(self.embed(x)))


def test_post_norm_encoder_layers_equal_codes():
    # nn.TransformerEncoderLayer(norm_first=False), stacked: its residual sums reach the norms'
    # (implied) 8-bit input quantizers (ADD in the graph); the Linears' outputs and the wide
    # LayerNorm output's 8-bit reads follow the graph's integer stages
    torch.manual_seed(1)
    model = _Encoder().eval()
    torch.manual_seed(0)
    x, calib = torch.randn(8, 10, 16), torch.randn(64, 10, 16)
    qdsl.apply(model, parse_text(TEL_SPEC, "t.qspec"))
    qdsl.calibrate(model, [calib[:32], calib[32:]])
    qdsl.freeze(model)
    with torch.no_grad():
        fq = model(x).numpy()
    ref = execute(qdsl.export(model, x[:1]), x.numpy()).outputs[0]
    s = float(get_handle(model).quantizer("head", "output").scale)
    np.testing.assert_array_equal(np.rint(fq / s), np.rint(ref / s))


@pytest.mark.parametrize("rounding", ["HALF_AWAY", "HALF_EVEN", "FLOOR"])
@pytest.mark.parametrize("pot", [False, True])
def test_rescale_codes_equals_the_reference(rounding, pot):
    # the binary64 rescale (near-ties handed to the reference) against qdsl.graph.requant's
    # apply_rescale, per channel, on random accumulators and on exact ties of power-of-two factors
    from qdsl.graph.requant import apply_rescale, make_rescale
    from qdsl.graph.schema import Rounding
    from qdsl.patch.residual_sim import rescale_codes

    rng = np.random.default_rng(int(pot) * 3 + len(rounding))
    for _ in range(40):
        c = int(rng.integers(1, 6))
        f = 2.0 ** rng.integers(-20, 4, c) if pot else np.exp(rng.uniform(-25, 3, c))
        rescale = make_rescale(f, Rounding[rounding], single=True)
        acc = rng.integers(-2**31, 2**31, (50, c))
        acc[:10] = rng.integers(-64, 64, (10, c)) * 2 ** int(rng.integers(0, 20))
        got = rescale_codes(torch.from_numpy(acc).double(), rescale).numpy()
        np.testing.assert_array_equal(got, apply_rescale(acc, rescale, axis=1))

"""nn.TransformerEncoderLayer traces (fx could not: "input to _none_or_dtype() must be None
or torch.Tensor", and its fast-path checks branch on the input's rank), as the root model
or inside one, both norm orders; its norm/linear children are then seen by apply's checks,
and it exports (its MultiheadAttention through qdsl.patch.attention / qdsl.export.lower_mha)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import qdsl
from qdsl.export.values import ExportError
from qdsl.parse import parse_text
from qdsl.patch.trace import trace_model

from tests.export.attn_models import INT8_SPEC

SPEC = INT8_SPEC


class Nested(nn.Module):
    def __init__(self, norm_first: bool):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, norm_first=norm_first)

    def forward(self, x):
        return self.layer(self.embed(x))


def _models(norm_first):
    torch.manual_seed(0)
    return [("", nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, norm_first=norm_first), 32),
            ("layer.", Nested(norm_first), 16)]


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_traces_root_or_nested(norm_first):
    before = torch.backends.mha.get_fastpath_enabled()
    for prefix, model, _ in _models(norm_first):
        trace = trace_model(model.eval())
        assert trace.traced, trace.error
        called = {str(n.target) for n in trace.graph.nodes if n.op == "call_module"}
        assert {f"{prefix}{m}" for m in ("self_attn", "norm1", "norm2", "linear1", "linear2")} <= called
        assert [n.op for n in trace.graph.nodes].count("placeholder") == 1  # the masks were fixed to None
    assert torch.backends.mha.get_fastpath_enabled() == before  # the switch is restored


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_exports_nested_and_the_root_names_its_float_input(norm_first):
    """self_attn exports now (qdsl.export.lower_mha; figures in tests/export/test_mha.py);
    as the root, the first residual add reads the model's float input, which is named."""
    for prefix, model, features in _models(norm_first):
        model.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error", qdsl.LeftFloatWarning)  # self_attn is quantized (qdsl.patch.attention)
            # the layer's output (a pre-norm layer's: the residual sum) quantized by the layer's output
            qdsl.apply(model, parse_text(SPEC + ("rule layer { output = a8 }" if prefix else ""), "t.qspec"))
        x = torch.randn(8, 10, features)
        qdsl.calibrate(model, [x])
        qdsl.freeze(model)
        if prefix:
            assert qdsl.export(model, x[:1]).ops
        else:
            with pytest.raises(ExportError, match=r"the residual add reads a value from '<input>'"):
                qdsl.export(model, x[:1])

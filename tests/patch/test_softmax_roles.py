"""``scores``/``probs`` on any module (qdsl/patch/softmax_roles.py): the input and result of
the softmax a module's forward computes (``F.softmax``, ``torch.softmax``, ``Tensor.softmax``,
``F.scaled_dot_product_attention``), quantized on the unmodified model; masked positions
(``<= finfo.min / 2``) stay out of the ``scores`` quantizer."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdsl
from qdsl.parse import parse_text
from qdsl.spec.diagnostics import SpecError

from tests.export.bert_models import TinyBert

ROLES = """
version 1
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
rule re:'.*attention\\.self' { scores = a8  probs = a8 }
"""


def _mask(n: int, length: int) -> torch.Tensor:
    m = torch.ones(n, length, dtype=torch.long)
    m[0, length // 2:] = 0  # padding in the first sentence
    m[1, 3:] = 0
    return m


def test_roles_quantize_inside_the_forward_and_remove_restores():
    torch.manual_seed(0)
    model = TinyBert(pooler=False).eval()
    ids = torch.randint(0, 50, (4, 10))
    mask = _mask(4, 10)
    with torch.no_grad():
        want = model(ids, mask)
    handle = qdsl.apply(model, parse_text(ROLES, "t.qspec"))
    qs = handle.quantizers()
    keys = sorted(f"{f}:{r.value}" for f, r in qs)
    assert keys == [f"encoder.layer.{i}.attention.self:{r}" for i in range(2) for r in ("probs", "scores")]
    qdsl.calibrate(model, [{"input_ids": ids, "attention_mask": mask}])
    qdsl.freeze(model)
    with torch.no_grad():
        got = model(ids, mask)
    assert not torch.equal(got, want) and F.cosine_similarity(got.flatten(), want.flatten(), 0) > 0.99
    # with the quantizers off the mode is the float model
    for q in qs.values():
        q.enabled = False
    with torch.no_grad():
        off = model(ids, mask)
    assert (off - want).abs().max() < 1e-6
    qdsl.remove(model)
    with torch.no_grad():
        assert torch.equal(model(ids, mask), want)


def test_masked_positions_are_left_out_of_the_scores_observer():
    torch.manual_seed(0)
    model = TinyBert(pooler=False, layers=1).eval()
    ids = torch.randint(0, 50, (4, 10))
    handle = qdsl.apply(model, parse_text(ROLES, "t.qspec"))
    qdsl.calibrate(model, [{"input_ids": ids, "attention_mask": _mask(4, 10)}])
    qdsl.freeze(model)
    sq = {(f, r.value): q for (f, r), q in handle.quantizers().items()}[("encoder.layer.0.attention.self", "scores")]
    # the scores of a random tiny BERT are O(1): a range that saw finfo.min would span 1e38
    assert float(sq.scale) * 255 < 100


def test_fully_masked_row_gives_zero_probabilities():
    from qdsl.patch.softmax_roles import quantized_softmax
    x = torch.randn(2, 5)
    x[1] = torch.finfo(torch.float32).min
    x[0, 3] = float("-inf")
    p = quantized_softmax(x, -1, None, None, "m")
    assert torch.all(p[1] == 0) and p[0, 3] == 0 and torch.allclose(p[0].sum(), torch.tensor(1.0))


class _Sdpa(nn.Module):
    def __init__(self, e: int = 16, heads: int = 2):
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(e, 3 * e)

    def forward(self, x, mask=None, causal=False):
        b, length, e = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


@pytest.mark.parametrize("kind", ["none", "bool", "float", "causal"])
def test_sdpa_is_decomposed_float_equal(kind):
    torch.manual_seed(0)
    model = _Sdpa().eval()
    x = torch.randn(3, 7, 16)
    mask = None
    if kind == "bool":
        mask = torch.ones(3, 1, 1, 7, dtype=torch.bool)
        mask[0, ..., 4:] = False
    elif kind == "float":
        mask = torch.zeros(3, 1, 1, 7)
        mask[1, ..., 2:] = torch.finfo(torch.float32).min
    with torch.no_grad():
        want = model(x, mask, kind == "causal")
    spec = "version 1\nquantizer a8 = int(bits=8, unsigned, asymmetric, observer=minmax)\n" \
           "rule <model> { scores = a8  probs = a8 }\n"
    handle = qdsl.apply(model, parse_text(spec.replace("<model>", "type:_Sdpa"), "t.qspec"))
    for q in handle.quantizers().values():
        q.enabled = False
    with torch.no_grad():
        got = model(x, mask, kind == "causal")
    assert (got - want).abs().max() < 1e-6
    for q in handle.quantizers().values():
        q.enabled = True
    qdsl.calibrate(model, [(x, mask, kind == "causal")], inputs="all")
    qdsl.freeze(model)
    with torch.no_grad():
        fq = model(x, mask, kind == "causal")
    assert not torch.equal(fq, want) and F.cosine_similarity(fq.flatten(), want.flatten(), 0) > 0.99


def test_input_on_a_block_does_not_reach_its_softmax():
    torch.manual_seed(0)
    model = TinyBert(pooler=False, layers=1).eval()
    spec = ROLES.replace("scores = a8  probs = a8", "output = a8")
    handle = qdsl.apply(model, parse_text(spec, "t.qspec"))
    assert sorted(r.value for (_, r) in handle.quantizers()) == ["output"]


def test_scores_on_a_leaf_is_an_error():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(SpecError) as ei:
        qdsl.apply(model, parse_text("version 1\nrule 0 { scores = int(bits=8) }\n", "t.qspec"))
    assert "scores" in str(ei.value)


def _static_a8(x: torch.Tensor):
    from qdsl.quantizers import TensorQuantizer
    from qdsl.resolve.plan import QuantizerRecipe
    from qdsl.spec.model import Granularity, Kind, ObserverSpec, Role

    r = QuantizerRecipe(Kind.INT, 8, False, False, False, "float", Granularity(), ObserverSpec("minmax", ()),
                        "half_even", False)
    q = TensorQuantizer(r, Role.SCORES)
    q.observing = True
    q(x)
    q.observing = False
    return q


def _padded_scores():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 5, 6) * 4
    x[0, :, :, 4:] = torch.finfo(torch.float32).min  # Hugging Face's padding
    x[1, 0, 2, :] = float("-inf")  # a fully masked row
    x[2, 1, 1, 3] = float("nan")
    return x


@pytest.mark.parametrize("frozen", [False, True])
def test_masked_softmax_in_eval_equals_the_gathering_path(monkeypatch, frozen):
    from qdsl.patch import softmax_roles as R

    x = _padded_scores()
    sq, pq = _static_a8(x.clamp(-10, 10).nan_to_num()), _static_a8(torch.rand(10))
    if frozen:
        sq.freeze()
        pq.freeze()
    with torch.no_grad():
        fast = R.quantized_softmax(x, -1, sq, pq, "m")
        monkeypatch.setattr(R, "_elementwise", lambda q, x: False)
        general = R.quantized_softmax(x, -1, sq, pq, "m")
    assert torch.equal(fast.view(torch.int32), general.view(torch.int32))
    assert torch.equal(fast[1, 0, 2], torch.zeros(6))


def test_masked_scores_in_eval_need_no_gather(monkeypatch):
    # evaluation quantizes the whole padded tensor and keeps the masked entries (a where),
    # instead of gathering the kept entries (nonzero + index + masked_scatter: ~6x the cost)
    from qdsl.patch import softmax_roles as R

    x = _padded_scores().nan_to_num()
    sq = _static_a8(x.clamp(-10, 10))

    def no_scatter(*args, **kwargs):
        raise AssertionError("masked_scatter called")

    monkeypatch.setattr(torch.Tensor, "masked_scatter", no_scatter)
    with torch.no_grad():
        p = R.quantized_softmax(x, -1, sq, None, "m")
    assert p.shape == x.shape

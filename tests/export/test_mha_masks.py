"""Masked nn.MultiheadAttention and nn.TransformerEncoderLayer end to end: the masks become
graph inputs (or constants) read by SOFTMAX_MASKED; C++ equals the reference executor bit for
bit on every path; cosine(graph, float) >= 0.99; the graph agrees with the fake-quant model as
closely as unmasked (tests/export/test_mha.py; `-s` prints the figures); a fully masked
sample gives the same (finite) output in the graph and the fake-quant model; float masks
other than 0/-inf are refused naming the module and the op."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import qdsl
import qdsl.runtime as rt
from qdsl.export.values import ExportError
from qdsl.graph import execute
from qdsl.graph.ir import OpType
from qdsl.graph.ops.softmax_masked import MaskError
from qdsl.parse import parse_text
from qdsl.patch.handle import get_handle

from tests.export.attn_models import TEL_SPEC as SPEC, cos

N, L, HEADS = 4, 10, 4


def _kpm(float_: bool = False) -> torch.Tensor:
    m = torch.zeros(N, L, dtype=torch.bool)
    m[1, 6:] = True
    m[2, 3:] = True
    return torch.zeros(N, L).masked_fill(m, float("-inf")) if float_ else m


def _causal(float_: bool = False) -> torch.Tensor:
    m = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    return torch.zeros(L, L).masked_fill(m, float("-inf")) if float_ else m


def _window3d() -> torch.Tensor:
    # (N·H, L, S): each head of each sample sees its own band of keys
    g = torch.Generator().manual_seed(3)
    m = torch.rand(N * HEADS, L, L, generator=g) < 0.4
    m[..., 0] = False  # no fully masked row (torch's float model gives NaN there)
    return m


class Mha(nn.Module):
    """embed -> MHA called with the masks (inputs, or a buffer) -> head."""

    def __init__(self, inputs: tuple[str, ...], buffer: torch.Tensor | None = None, is_causal: bool = False):
        super().__init__()
        self.inputs, self.is_causal = inputs, is_causal
        self.embed, self.attn, self.head = nn.Linear(16, 32), nn.MultiheadAttention(32, HEADS, batch_first=True), \
            nn.Linear(32, 8)
        if buffer is not None:
            self.register_buffer("mask", buffer)

    def forward(self, x, m1=None, m2=None):
        h = self.embed(x)
        given = dict(zip(self.inputs, (m1, m2)))
        if hasattr(self, "mask"):
            given["attn_mask"] = self.mask
        out = self.attn(h, h, h, need_weights=False, is_causal=self.is_causal, **given)[0]
        return self.head(out)


class SeqFirstMha(nn.Module):
    """A batch_first=False attention fed transpose(0, 1) of batch-first values."""

    def __init__(self):
        super().__init__()
        self.embed, self.attn, self.head = nn.Linear(16, 32), nn.MultiheadAttention(32, HEADS), nn.Linear(32, 8)

    def forward(self, x, m1=None):
        h = self.embed(x).transpose(0, 1)
        return self.head(self.attn(h, h, h, key_padding_mask=m1, need_weights=False)[0].transpose(0, 1))


class Encoder(nn.Module):
    def __init__(self, norm_first: bool, batch_first: bool = True):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Linear(16, 32)
        self.enc = nn.TransformerEncoderLayer(32, HEADS, 64, dropout=0.0, batch_first=batch_first,
                                              norm_first=norm_first)
        self.head = nn.Linear(32, 8)

    def forward(self, x, kpm, mask):
        h = self.embed(x)
        if self.batch_first:
            return self.head(self.enc(h, src_mask=mask, src_key_padding_mask=kpm))
        # seq-first: the layer's LayerNorms, linears and adds run on the batch-first values
        return self.head(self.enc(h.transpose(0, 1), src_mask=mask, src_key_padding_mask=kpm).transpose(0, 1))


CASES = {
    "kpm-bool": (lambda: Mha(("key_padding_mask",)), lambda: (_kpm(),)),
    "kpm-float": (lambda: Mha(("key_padding_mask",)), lambda: (_kpm(True),)),
    "attn-bool-input": (lambda: Mha(("attn_mask",)), lambda: (_causal(),)),
    "attn-float-buffer-causal": (lambda: Mha((), _causal(True), is_causal=True), lambda: ()),
    "attn-3d-input": (lambda: Mha(("attn_mask",)), lambda: (_window3d(),)),
    "kpm+attn": (lambda: Mha(("key_padding_mask", "attn_mask")), lambda: (_kpm(), _causal())),
    "encoder-post-norm": (lambda: Encoder(False), lambda: (_kpm(), _causal())),
    "encoder-pre-norm": (lambda: Encoder(True), lambda: (_kpm(), _causal())),
    "seq-first-kpm": (SeqFirstMha, lambda: (_kpm(),)),
    "seq-first-encoder-post-norm": (lambda: Encoder(False, batch_first=False), lambda: (_kpm(), _causal())),
    "seq-first-encoder-pre-norm": (lambda: Encoder(True, batch_first=False), lambda: (_kpm(), _causal())),
}


def _pipeline(case, requant="single"):
    make_model, make_masks = CASES[case]
    torch.manual_seed(1)
    model = make_model().eval()
    masks = make_masks()
    xt = torch.randn(N, L, 16)
    with torch.no_grad():
        want = model(xt, *masks).numpy()
    qdsl.apply(model, parse_text(SPEC, "t.qspec"))
    calib = torch.randn(2 * N, L, 16)
    # keyword batches: a tuple fills only forward's required parameters (the rest are targets)
    names = ("kpm", "mask") if isinstance(model, Encoder) else ("m1", "m2")
    qdsl.calibrate(model, [{"x": c, **dict(zip(names, masks))} for c in (calib[:N], calib[N:])])
    qdsl.freeze(model)
    # a 3-D (N·H, L, S) mask is declared with its static shape: export at the batch it is run at
    example = (xt, *masks) if case == "attn-3d-input" else (xt[:1], *(m[:1] if m.shape == (N, L) else m for m in masks))
    graph = qdsl.export(model, example, requant=requant)
    with torch.no_grad():
        fq = model(xt, *masks).numpy()
    return model, graph, (xt, *masks), want, fq


def _run_all(graph, inputs):
    arrays = [t.numpy() for t in inputs]
    ref = execute(graph, arrays).outputs[0]
    if rt.available():
        from qdsl.runtime import kernels as K

        cg = rt.CompiledGraph(graph)
        for path in K.paths()["cpu"]:
            np.testing.assert_array_equal(cg.run(*arrays, path=path), ref, err_msg=f"path {path}")
    return ref


@pytest.mark.parametrize("requant", ["single", "gemmlowp"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_masked_attention_exports_runs_in_cpp_bit_identical_and_agrees(case, requant):
    model, graph, inputs, want, fq = _pipeline(case, requant)
    types = [op.type for op in graph.ops]
    assert types.count(OpType.SOFTMAX_MASKED) == 1 and OpType.SOFTMAX not in types
    ref = _run_all(graph, inputs)
    lsb = np.abs(ref - fq) / float(get_handle(model).quantizer("head", "output").scale)
    cos_float, cos_fq = cos(ref, want), cos(ref, fq)
    print(f"{case} ({requant}): cos(graph, float) {cos_float:.5f}, cos(graph, fake-quant) {cos_fq:.6f}, codes equal "
          f"{np.mean(lsb < 0.5):.4f}, within 1 LSB {np.mean(lsb < 1.5):.4f}, max {lsb.max():.0f} LSB")
    assert cos_float >= 0.99
    if case.endswith("encoder-pre-norm"):  # the float first residual sum (test_mha.py); 320 codes here
        assert cos_fq >= 0.999 and np.mean(lsb < 1.5) >= 0.97 and lsb.max() <= 2.5
    elif requant == "gemmlowp":  # two roundings per stage, as unmasked (test_mha.py)
        assert np.mean(lsb < 1.5) >= 0.98 and lsb.max() <= 2.5
    else:
        assert cos_fq >= 0.9999 and np.mean(lsb < 0.5) >= 0.97 and np.mean(lsb < 1.5) >= 0.999


def test_graph_inputs_are_named_and_typed():
    _, graph, _, _, _ = _pipeline("kpm+attn")
    decl = {t.name: (t.dtype.name, t.shape) for t in graph.tensors if t.name in graph.inputs}
    # the key mask is batched; the (L, S) attention mask is not (its first dim is the queries)
    assert decl == {"x": ("F32", (-1, L, 16)), "m1": ("I32", (-1, L)), "m2": ("I32", (L, L))}
    op = next(op for op in graph.ops if op.type is OpType.SOFTMAX_MASKED)
    assert tuple(op.inputs[1:]) == ("m1", "m2") and op.attrs["mask_dims"] == (0, -1, -1, 1, -1, -1, 0, 1)
    assert op.attrs["mask_attend"] == (0, 0)


def test_a_fully_masked_sample_is_finite_and_equal_to_fake_quant():
    torch.manual_seed(1)
    model = Mha(("key_padding_mask",)).eval()
    kpm = _kpm()
    kpm[3] = True  # every key of sample 3 masked: torch's float model gives NaN there
    xt = torch.randn(N, L, 16)
    qdsl.apply(model, parse_text(SPEC, "t.qspec"))
    qdsl.calibrate(model, [{"x": xt, "m1": _kpm()}])
    qdsl.freeze(model)
    graph = qdsl.export(model, (xt[:1], kpm[:1]))
    ref = _run_all(graph, (xt, kpm))
    with torch.no_grad():
        fq = model(xt, kpm).numpy()
    assert np.isfinite(ref).all()
    np.testing.assert_array_equal(ref[3], fq[3])
    assert (ref[3] == ref[3, :1]).all()  # context 0 for every query: out_proj's bias, then the head


def test_float_buffer_mask_other_than_minus_inf_is_refused_naming_module_and_op():
    model = Mha((), torch.triu(torch.full((L, L), -1e9), 1)).eval()
    qdsl.apply(model, parse_text(SPEC, "t.qspec"))
    qdsl.calibrate(model, [torch.randn(N, L, 16)])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match=r"cannot export 'attn': the float attn_mask 'mask' holds -1e\+09: "
                                          r"SOFTMAX_MASKED \('attn.softmax'\) reads additive masks of 0"):
        qdsl.export(model, torch.randn(1, L, 16))


def test_float_input_mask_other_than_minus_inf_fails_the_run_naming_the_op():
    _, graph, (xt, kpm), _, _ = _pipeline("kpm-float")
    bad = kpm.clone()
    bad[1, 6:] = -1e4
    with pytest.raises(MaskError, match="SOFTMAX_MASKED 'attn.softmax': mask 'm1' holds -10000 at index \\[1, 6\\]"):
        execute(graph, [xt.numpy(), bad.numpy()])
    if rt.available():
        with pytest.raises(Exception, match="SOFTMAX_MASKED 'attn.softmax': mask 'm1' holds -10000"):
            rt.CompiledGraph(graph).run(xt.numpy(), bad.numpy())


def test_a_mask_computed_inside_the_model_names_the_module():
    class Computed(Mha):
        def forward(self, x, m1=None, m2=None):
            h = self.embed(x)
            return self.head(self.attn(h, h, h, need_weights=False, key_padding_mask=x[..., 0] > 0)[0])

    model = Computed(()).eval()
    qdsl.apply(model, parse_text(SPEC, "t.qspec"))
    qdsl.calibrate(model, [torch.randn(N, L, 16)])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match="cannot export '"):
        qdsl.export(model, torch.randn(1, L, 16))


def test_an_integer_key_padding_mask_input_names_the_module():
    # torch's MultiheadAttention reads bool or float masks; an int64 input would be token ids
    model = Mha(("key_padding_mask",)).eval()
    qdsl.apply(model, parse_text(SPEC, "t.qspec"))
    qdsl.calibrate(model, [{"x": torch.randn(N, L, 16), "m1": _kpm()}])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match="cannot export 'attn': the key_padding_mask 'm1' is an integer tensor"):
        qdsl.export(model, (torch.randn(1, L, 16), _kpm()[:1].long()))

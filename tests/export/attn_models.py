"""Hand-written attention blocks (the form Hugging Face models use: nn.Linear projections,
``view``/``transpose`` head split, ``q @ kᵀ / sqrt(d)``, softmax, ``p @ v``, LayerNorm, GELU MLP)
for the export tests, and what those tests (and benchmarks/fq_agreement.py) share: the 8-bit
spec text (:data:`INT8_SPEC`, :func:`head_spec`), the BERT spec (:func:`bert_int8_spec`) and
:func:`cos`."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from qdsl.parse import parse_text

INT8_SPEC = """
version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
defaults {
  weight = w8
  input = a8
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
"""
"""w8 per-channel symmetric weights, a8 asymmetric per-tensor inputs, int32 biases at input·weight."""


def head_spec(layer: str = "head") -> str:
    """:data:`INT8_SPEC` plus an 8-bit output for ``layer`` (the model's last Linear)."""
    return INT8_SPEC + f"rule {layer} {{ output = a8 }}\n"


TEL_SPEC = head_spec()
"""The encoder tests' spec: embed -> attention/encoder layer -> ``head`` with an 8-bit output."""

SPEC_FILE = Path(__file__).resolve().parents[2] / "specs" / "transformer-int8.qspec"
# the attention's pieces that have a module to carry their quantizer (an nn.Softmax here; no
# apply-time trace implies them, as BertEmbeddings' slicing stops a plain fx trace)
BERT_ATTENTION = """
rule re:'.*\\.(query|key|value|intermediate\\.dense)' { output = a8 }
rule type:Softmax optional { input = a8  output = a8 }
"""


def bert_int8_spec(extra: str = ""):
    """specs/transformer-int8.qspec plus :data:`BERT_ATTENTION` (and ``extra`` rules), parsed."""
    return parse_text(SPEC_FILE.read_text() + BERT_ATTENTION + extra, "transformer-int8+attention.qspec")


def cos(a, b) -> float:
    """Cosine similarity of two arrays (flattened, binary64)."""
    a, b = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


class Attention(nn.Module):
    def __init__(self, e: int = 32, heads: int = 4, functional: bool = False):
        super().__init__()
        self.h, self.d, self.functional = heads, e // heads, functional
        self.q, self.k, self.v, self.out = (nn.Linear(e, e) for _ in range(4))
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        b, l, e = x.shape
        q = self.q(x).view(b, l, self.h, self.d).transpose(1, 2)
        k = self.k(x).view(b, l, self.h, self.d).permute(0, 2, 3, 1)  # already kᵀ
        v = self.v(x).view(b, l, self.h, self.d).transpose(1, 2)
        scores = torch.matmul(q, k) * (1.0 / math.sqrt(self.d)) if self.functional else q @ k / math.sqrt(self.d)
        p = self.softmax(scores)
        ctx = (p @ v).transpose(1, 2).contiguous().reshape(b, l, e)
        return self.out(ctx)


class _FunctionalGelu(nn.Module):
    """``F.gelu`` called in a forward (a function, not the nn.GELU module)."""

    def forward(self, x):
        return torch.nn.functional.gelu(x)


class PreNormResidual(nn.Module):
    """``x + fn(norm(x))``: the residual stream is this module's result, so a quantizer can sit
    on it (the add of the next block reads it: "implied by add")."""

    def __init__(self, norm: nn.Module, fn: nn.Module):
        super().__init__()
        self.norm, self.fn = norm, fn

    def forward(self, x):
        return x + self.fn(self.norm(x))


class EncoderBlock(nn.Module):
    """embed -> (pre- or post-norm) attention and GELU MLP with residual adds -> LayerNorm."""

    def __init__(self, features: int = 16, e: int = 32, heads: int = 4, norm_first: bool = False,
                 functional: bool = False):
        super().__init__()
        self.norm_first = norm_first
        self.embed = nn.Linear(features, e)
        self.attn = Attention(e, heads, functional)
        self.norm1, self.norm2 = nn.LayerNorm(e), nn.LayerNorm(e)
        self.ff1, self.ff2 = nn.Linear(e, 2 * e), nn.Linear(2 * e, e)
        self.act = _FunctionalGelu() if functional else nn.GELU()
        self.final = nn.LayerNorm(e)
        if norm_first:
            self.pre1 = PreNormResidual(self.norm1, self.attn)
            self.pre2 = PreNormResidual(self.norm2, nn.Sequential(self.ff1, self.act, self.ff2))
        with torch.no_grad():  # non-trivial affine parameters
            for n in (self.norm1, self.norm2, self.final):
                n.weight.uniform_(0.5, 1.5)
                n.bias.uniform_(-0.3, 0.3)

    def forward(self, x):
        x = self.embed(x)
        if self.norm_first:
            x = self.pre1(x)
            x = self.pre2(x)
        else:
            x = self.norm1(x + self.attn(x))
            x = self.norm2(x + self.ff2(self.act(self.ff1(x))))
        return self.final(x)

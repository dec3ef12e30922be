"""A tiny BERT written the way Hugging Face's ``BertModel`` (eager attention) computes, for the
export tests without the optional ``transformers`` package: the same module names
(``embeddings.word_embeddings``, ``encoder.layer.0.attention.self.query``, ...), word +
position + token-type embeddings summed and LayerNorm'ed, dropout (identity in eval), the
additive attention mask ``(1 - mask) * finfo.min`` on the scores, post-norm residuals, a GELU
MLP and the tanh pooler."""

from __future__ import annotations

import math

import torch
from torch import nn


class Embeddings(nn.Module):
    def __init__(self, vocab: int, e: int, max_pos: int, types: int = 2):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, e)
        self.position_embeddings = nn.Embedding(max_pos, e)
        self.token_type_embeddings = nn.Embedding(types, e)
        self.LayerNorm = nn.LayerNorm(e, eps=1e-12)
        self.dropout = nn.Dropout(0.1)
        self.register_buffer("position_ids", torch.arange(max_pos).unsqueeze(0), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, max_pos, dtype=torch.long), persistent=False)

    def forward(self, input_ids):
        length = input_ids.shape[1]
        x = self.word_embeddings(input_ids)
        x = x + self.token_type_embeddings(self.token_type_ids[:, :length])
        x = x + self.position_embeddings(self.position_ids[:, :length])
        return self.dropout(self.LayerNorm(x))


class SelfAttention(nn.Module):
    def __init__(self, e: int, heads: int, softmax_module: bool = False):
        super().__init__()
        self.h, self.d = heads, e // heads
        self.query, self.key, self.value = nn.Linear(e, e), nn.Linear(e, e), nn.Linear(e, e)
        self.dropout = nn.Dropout(0.1)
        # an nn.Softmax module (older BERT ports) gives the scores and probabilities a module
        # to carry their quantizers; Hugging Face's eager attention calls the function
        self.softmax = nn.Softmax(dim=-1) if softmax_module else None

    def forward(self, x, mask):
        b, l, e = x.shape
        q = self.query(x).view(b, l, self.h, self.d).transpose(1, 2)
        k = self.key(x).view(b, l, self.h, self.d).transpose(1, 2)
        v = self.value(x).view(b, l, self.h, self.d).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.d))
        if mask is not None:
            scores = scores + mask
        p = self.softmax(scores) if self.softmax is not None else nn.functional.softmax(scores, dim=-1)
        p = self.dropout(p)
        return torch.matmul(p, v).transpose(1, 2).reshape(b, l, e)


class SelfOutput(nn.Module):
    def __init__(self, e: int, inner: int | None = None):
        super().__init__()
        self.dense = nn.Linear(inner or e, e)
        self.LayerNorm = nn.LayerNorm(e, eps=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, h, x):
        return self.LayerNorm(self.dropout(self.dense(h)) + x)


class Attention(nn.Module):
    def __init__(self, e: int, heads: int, softmax_module: bool = False):
        super().__init__()
        self.self, self.output = SelfAttention(e, heads, softmax_module), SelfOutput(e)

    def forward(self, x, mask):
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, e: int, inner: int):
        super().__init__()
        self.dense, self.intermediate_act_fn = nn.Linear(e, inner), nn.GELU()

    def forward(self, x):
        return self.intermediate_act_fn(self.dense(x))


class Layer(nn.Module):
    def __init__(self, e: int, heads: int, inner: int, softmax_module: bool = False):
        super().__init__()
        self.attention = Attention(e, heads, softmax_module)
        self.intermediate = Intermediate(e, inner)
        self.output = SelfOutput(e, inner)

    def forward(self, x, mask):
        a = self.attention(x, mask)
        return self.output(self.intermediate(a), a)


class Encoder(nn.Module):
    def __init__(self, layers: int, e: int, heads: int, inner: int, softmax_module: bool = False):
        super().__init__()
        self.layer = nn.ModuleList(Layer(e, heads, inner, softmax_module) for _ in range(layers))

    def forward(self, x, mask):
        for layer in self.layer:
            x = layer(x, mask)
        return x


class Pooler(nn.Module):
    def __init__(self, e: int):
        super().__init__()
        self.dense, self.activation = nn.Linear(e, e), nn.Tanh()

    def forward(self, x):
        return self.activation(self.dense(x[:, 0]))


class TinyBert(nn.Module):
    """``forward(input_ids, attention_mask=None) -> (last_hidden_state, pooler_output)``."""

    def __init__(self, vocab: int = 50, e: int = 32, heads: int = 4, layers: int = 2, inner: int = 64,
                 max_pos: int = 16, pooler: bool = True, softmax_module: bool = False):
        super().__init__()
        self.embeddings = Embeddings(vocab, e, max_pos)
        self.encoder = Encoder(layers, e, heads, inner, softmax_module)
        self.pooler = Pooler(e) if pooler else None

    def forward(self, input_ids, attention_mask=None):
        ext = None
        if attention_mask is not None:
            ext = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
        h = self.encoder(self.embeddings(input_ids), ext)
        return (h, self.pooler(h)) if self.pooler is not None else h

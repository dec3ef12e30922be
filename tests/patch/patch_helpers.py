"""Helpers for patch tests: inline specs and state-dict snapshots."""

import torch

from qdsl.parse import parse_text

INT8 = """
version 1
fold_bn
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
defaults {
  weight = w8
  input = a8
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
rule type:BasicBlock optional { output = a8 }
"""


def spec(text: str = INT8, name: str = "test.qspec"):
    return parse_text(text, name)


def snapshot(model):
    return [(k, v.detach().clone()) for k, v in model.state_dict().items()]


def same_state(a, b) -> bool:
    return [k for k, _ in a] == [k for k, _ in b] and all(
        ta.dtype == tb.dtype and torch.equal(ta, tb) for (_, ta), (_, tb) in zip(a, b)
    )

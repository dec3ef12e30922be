"""Quantization-aware training: straight-through estimators, learned scales, BN folding.

* :mod:`qdsl.qat.ste` - pure-torch autograd pieces (clipping-mask STE, LSQ/LSQ+,
  learned power-of-two scale, binary/ternary/power-of-two weights).
"""

from qdsl.qat import ste

__all__ = ["ste"]

"""Quantizer parts and proxies (torch).

* :mod:`~qdsl.quantizers.functional` - pure quantization arithmetic, bit-exact with torch.
* :mod:`~qdsl.quantizers.parts` - ``default_registries()`` and how parts are built.
* :mod:`~qdsl.quantizers.observers`, :mod:`~qdsl.quantizers.scales`,
  :mod:`~qdsl.quantizers.rounding` - the built-in parts.
* :mod:`~qdsl.quantizers.range_search` - bit-aware MSE / histogram / percentile searches.
* :mod:`~qdsl.quantizers.proxy` - ``TensorQuantizer``, the module patched onto models.
"""

from qdsl.quantizers.observers import Observer
from qdsl.quantizers.parts import PartContext, default_registries
from qdsl.quantizers.proxy import TensorQuantizer, code_range

__all__ = ["default_registries", "PartContext", "Observer", "TensorQuantizer", "code_range"]

"""Quantizer parts and proxies (torch).

* :mod:`qdsl.quantizers.functional` - pure quantization arithmetic (bit-exact with torch).
"""

__all__: list[str] = []

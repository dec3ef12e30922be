"""Number formats, torch side: one module per built-in kind (int, binary, ternary, pot, minifloat).

Each module holds a :class:`~qdsl.quantizers.formats.base.FormatOps` subclass that a
:class:`~qdsl.quantizers.proxy.TensorQuantizer` delegates to for everything that differs
between kinds; the torch-free facts (code range, default bits/observer, accumulator
operand range) are in :mod:`qdsl.spec.formats`.  Registered in ``Registries.formats``
(``qdsl.spec.builtins``); a user format registers its own pair with
:func:`qdsl.spec.formats.register_format`.
"""

from qdsl.quantizers.formats.base import FormatOps, NotExportable, WeightInts

__all__ = ["FormatOps", "NotExportable", "WeightInts"]

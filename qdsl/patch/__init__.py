"""Patching an unmodified model: ``apply``/``remove``, calibration, freezing, integer
tensors out, state.  See :mod:`qdsl.patch.handle` for where qdsl keeps things on a
model and :mod:`qdsl.patch.layer` for what a patched layer does.
"""

from qdsl.patch.apply import apply, remove
from qdsl.patch.calibrate import calibrate, calibrating, freeze
from qdsl.patch.handle import QdslHandle, State, get_handle, state_of
from qdsl.patch.ints import LayerInts, int_tensors
from qdsl.patch.state import load, save

__all__ = [
    "apply",
    "remove",
    "calibrate",
    "calibrating",
    "freeze",
    "int_tensors",
    "LayerInts",
    "save",
    "load",
    "get_handle",
    "state_of",
    "State",
    "QdslHandle",
]

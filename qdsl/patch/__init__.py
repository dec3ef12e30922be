"""Patching an unmodified model: ``apply``/``remove``, integer tensors out, state
(calibration and freezing are the layer above: :mod:`qdsl.calibration`).

::

    handle = qdsl.apply(model, "model.qspec", overrides=["weight.bits=4"])
    qdsl.calibrate(model, loader, num_batches=32)    # or: with qdsl.calibrating(model): ...
    qdsl.freeze(model)                               # scales fixed in buffers
    ints = qdsl.int_tensors(model)                   # {fqn: LayerInts} integer weights, int32 bias
    qdsl.save(model, "q.pt")                         # later: apply + qdsl.load(model, "q.pt")
    handle.remove()                                  # the original model, bit for bit

* :mod:`qdsl.patch.apply` - apply/remove and what they guarantee;
* :mod:`qdsl.patch.handle` - where qdsl keeps things on a model, the handle export and
  QAT use (``get_handle``), the lifecycle (``state_of``, :class:`State`);
* :mod:`qdsl.patch.layer` - what a patched layer does (hooks, int32 bias, BN folding);
* :mod:`qdsl.patch.fold` - which Conv/Linear -> BatchNorm pairs are folded;
* :mod:`qdsl.patch.coverage` - what the spec reaches but stays float (apply's warning,
  ``strict=True``), and modules one observer shares; :mod:`qdsl.patch.trace` - the one
  torch.fx trace folding, coverage and lint share;
* :mod:`qdsl.patch.ints`, :mod:`qdsl.patch.state` - integer tensors out, save/load.
"""

from qdsl.patch.apply import apply, remove
from qdsl.patch.handle import QdslHandle, State, get_handle, state_of
from qdsl.patch.ints import LayerInts, int_tensors
from qdsl.patch.state import load, save

__all__ = [
    "apply",
    "remove",
    "int_tensors",
    "LayerInts",
    "save",
    "load",
    "get_handle",
    "state_of",
    "State",
    "QdslHandle",
]

"""Calibration and freezing: the layer between ``qdsl.patch`` and ``qdsl.ptq``/``qdsl.qat``.

* :mod:`qdsl.calibration.run` - ``calibrating``, ``calibrate`` and ``freeze`` (what each
  guarantees); the PTQ steps (:mod:`qdsl.ptq.pipeline`) plug into ``calibrate`` as
  ``steps=``, which the façade ``qdsl.calibrate`` passes;
* :mod:`qdsl.calibration.batches` - how a batch (tensor, tuple, dict) becomes a call of
  the model, for every place qdsl forwards user batches;
* :mod:`qdsl.calibration.distributed` - :func:`sync_observers`, merging observer
  statistics across DDP ranks (``calibrate`` calls it under ``torch.distributed``).

This layer imports ``qdsl.patch`` and below, never ``ptq``, ``qat`` or anything above.
"""

from qdsl.calibration.batches import BatchError, forward_batch
from qdsl.calibration.distributed import sync_observers
from qdsl.calibration.run import calibrate, calibrating, freeze

__all__ = ["BatchError", "forward_batch", "calibrate", "calibrating", "freeze", "sync_observers"]

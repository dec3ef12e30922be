"""Quantization-aware training: straight-through estimators, learned scales, BN folding.

* :mod:`qdsl.qat.ste` - pure-torch autograd pieces (clipping-mask STE, LSQ/LSQ+,
  learned power-of-two scale, binary/ternary/power-of-two weights), closed forms there.
* :mod:`qdsl.qat.learned` - the ``learned`` and ``learned_pot`` scale rules.
* :mod:`qdsl.qat.proxy_grad` - the gradient path every ``TensorQuantizer`` trains with
  once ``qdsl.qat`` is imported (values are unchanged; only gradients differ from the
  proxy's plain identity STE).
* :mod:`qdsl.qat.bn_fold` - BatchNorm folding during QAT (:func:`prepare_qat`,
  :func:`freeze_bn_stats`).
* :mod:`qdsl.qat.distributed` - :func:`sync_observers` for DDP calibration.
* :mod:`qdsl.qat.loop` - :func:`fit`, a small seeded QAT fine-tuning loop.
* :mod:`qdsl.qat.ranges` - :func:`research_ranges`: search carried weight ranges again.
* :mod:`qdsl.qat.lean` - :class:`LeanOptimizer`: packed low-bit weights on the module,
  fp32 masters only in the optimizer (memory-lean QAT).

Importing this package installs :func:`qdsl.qat.proxy_grad.qat_grad_path` as
``TensorQuantizer.grad_path``.
"""

from qdsl.qat import ste
from qdsl.qat.bn_fold import freeze_bn_stats, prepare_qat, unfreeze_bn_stats
from qdsl.qat.distributed import sync_observers
from qdsl.qat.lean import LeanOptimizer
from qdsl.qat.learned import LearnedPotScale, LearnedScale
from qdsl.qat.loop import fit
from qdsl.qat.proxy_grad import install as _install, qat_grad_path
from qdsl.qat.ranges import research_ranges

_install()

__all__ = [
    "ste",
    "LearnedScale",
    "LearnedPotScale",
    "qat_grad_path",
    "prepare_qat",
    "fit",
    "LeanOptimizer",
    "sync_observers",
    "freeze_bn_stats",
    "unfreeze_bn_stats",
    "research_ranges",
]

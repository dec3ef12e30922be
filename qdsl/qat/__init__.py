"""Quantization-aware training: BN folding, the training loop, memory-lean QAT.

* :mod:`qdsl.qat.bn_fold` - BatchNorm folding during QAT (:func:`prepare_qat`,
  :func:`freeze_bn_stats`).
* :mod:`qdsl.qat.loop` - :func:`fit`, a small seeded QAT fine-tuning loop.
* :mod:`qdsl.qat.ranges` - :func:`research_ranges`: search carried weight ranges again.
* :mod:`qdsl.qat.lean` - :class:`LeanOptimizer`: packed low-bit weights on the module,
  fp32 masters only in the optimizer (the normal QAT path's values, exactly).
* :mod:`qdsl.qat.lean_adam` - :class:`LeanAdam`: QAT that lowers peak memory (packed codes
  are the weights, block-wise dequantization recomputed in backward, the update applied
  during backward, bf16 gradients, 8-bit Adam moments, bf16 or no master).

The pieces QAT trains with are parts of the quantizer layer, re-exported here:
:mod:`qdsl.quantizers.ste` (``qdsl.qat.ste``: straight-through estimators, LSQ/LSQ+,
closed forms), :mod:`qdsl.quantizers.learned` (the ``learned`` and ``learned_pot`` scale
rules) and :mod:`qdsl.quantizers.proxy_grad` (:func:`qat_grad_path`, the gradient path
a proxy trains with once installed on it).  :func:`sync_observers` (DDP calibration)
lives in :mod:`qdsl.calibration.distributed`.

Importing this package changes nothing: the QAT gradient path is installed per proxy -
on the proxies of the model given to :func:`prepare_qat`, :func:`fit` or
:class:`LeanOptimizer`, and on any proxy whose scale rule is learned - never on
``TensorQuantizer`` itself, so other models in the process keep their gradients.
"""

from qdsl.calibration.distributed import sync_observers
from qdsl.qat.bn_fold import freeze_bn_stats, prepare_qat, unfreeze_bn_stats
from qdsl.qat.lean import LeanOptimizer
from qdsl.qat.lean_adam import LeanAdam
from qdsl.qat.loop import fit
from qdsl.qat.ranges import research_ranges
from qdsl.quantizers import ste
from qdsl.quantizers.learned import LearnedPotScale, LearnedScale
from qdsl.quantizers.proxy_grad import qat_grad_path

__all__ = [
    "ste",
    "LearnedScale",
    "LearnedPotScale",
    "qat_grad_path",
    "prepare_qat",
    "fit",
    "LeanOptimizer",
    "LeanAdam",
    "sync_observers",
    "freeze_bn_stats",
    "unfreeze_bn_stats",
    "research_ranges",
]

"""The handle of an applied model, its lifecycle state, and where qdsl keeps its modules.

Where things live on a patched model
------------------------------------
* ``model._qdsl`` - one :class:`QdslContainer` (marked ``_qdsl_internal`` so
  ``ModelIndex.from_module`` skips it) holding every proxy in an ``nn.ModuleDict``
  ``quantizers`` keyed ``"<fqn with '.' -> '/'>:<role>"`` (``"<model>:input"`` for the
  root; ModuleDict keys cannot contain dots), plus a ``lifecycle`` buffer.  Because it is
  an ordinary child, ``model.state_dict()`` carries scales, zero points, observer
  statistics and the lifecycle state (``_qdsl.quantizers.conv1:weight.scale``, ...),
  and ``model.to(device)`` moves them.  Its ``forward`` is the identity because a root
  ``nn.Sequential`` calls every child in order: while applied, such a model has one more
  element at its end (``len(model)``, ``model[-1]``); ``remove`` takes it away.
* A patched layer's float master weight moves to ``module.weight_float`` (the same
  ``nn.Parameter`` object, so optimizers keep working) and ``module.weight`` becomes a
  plain tensor attribute holding the fake-quantized (and BN-folded) weight, recomputed
  by the layer's forward pre-hook (the scheme of ``torch.nn.utils.weight_norm``).  Same
  for ``bias`` / ``bias_float``.  qdsl does not use ``torch.nn.utils.parametrize``
  because it swaps the module's class, and ``type(module)`` must never change.
  Between forwards ``module.weight`` is the value of the last forward (or of apply;
  with ``apply(..., materialize=False)`` a storage-less tensor that computes that value on
  first use, :mod:`qdsl.patch.lazy_weight`).
  Recurrent layers are the exception: their parameters stay where they are and their
  proxies (one per layer, direction and tensor) are keyed ``"<fqn>:weight_ih_l0"``,
  ``"<fqn>:hidden_l1_reverse"``, ... (:mod:`qdsl.patch.recurrent`); ``quantizer(fqn, role)``
  does not find them, ``handle.layers[fqn].quantizers`` lists them.
* :class:`QdslHandle` (``model._qdsl.handle``, or :func:`get_handle`) is what export,
  lint and QAT use: the plan, the state, and the proxies per ``(fqn, role)``.

Lifecycle: ``PREPARED -> CALIBRATING -> FROZEN -> EXPORTED`` (export sets the last one).

Copying and pickling
--------------------
``copy.deepcopy(model)``, ``pickle.dumps(model)`` and ``torch.save(model, path)`` (load
with ``torch.load(path, weights_only=False)``: a whole model is code, not weights) work
in every state, during QAT too (after a backward and an optimizer step).  The copy
carries its own container, handle, patches and hooks: it gives the same outputs, shares
no tensor or state with the original (observer statistics, scales, QAT caches), and
``qdsl.get_handle(copy)`` / ``qdsl.remove(copy)`` act on the copy alone; the handle
``apply`` returned keeps pointing at the original.  Caches keyed on one model's tensors
are dropped in the copy and rebuilt on its next forward (same values).  Until then, an
unpickled layer's ``module.weight`` is the saved value without its autograd history.
Not covered: a model in :class:`qdsl.qat.LeanOptimizer` form (finish() it first).
``model.state_dict()`` remains the portable form (:mod:`qdsl.patch.state`).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from qdsl.spec.diagnostics import QdslError
from qdsl.spec.model import Role

if TYPE_CHECKING:  # pragma: no cover
    from qdsl.patch.layer import LayerPatch
    from qdsl.quantizers.proxy import TensorQuantizer
    from qdsl.resolve.plan import Plan

__all__ = ["State", "QdslContainer", "QdslHandle", "get_handle", "state_of", "proxy_key", "ROOT_KEY"]

ROOT_KEY = "<model>"


class State(str, enum.Enum):
    """Where an applied model is in its lifecycle."""

    PREPARED = "prepared"
    """Patched; weights fake-quantized, static activations not calibrated (pass through)."""
    CALIBRATING = "calibrating"
    """Calibration ran (or runs): activation statistics exist, scales still move."""
    FROZEN = "frozen"
    """Scales fixed in buffers (``qdsl.freeze``); ready for export."""
    EXPORTED = "exported"
    """Frozen and exported to an integer graph."""


_STATES = list(State)


def proxy_key(fqn: str, role: Role | str) -> str:
    """The ``ModuleDict`` key of the proxy for ``(fqn, role)``."""
    return f"{fqn.replace('.', '/') if fqn else ROOT_KEY}:{Role(role).value}"


class QdslContainer(nn.Module):
    """The one module qdsl attaches (as ``model._qdsl``)."""

    _qdsl_internal = True

    def __init__(self) -> None:
        super().__init__()
        self.quantizers = nn.ModuleDict()
        self.register_buffer("lifecycle", torch.zeros((), dtype=torch.int8))
        self.handle: QdslHandle | None = None
        self.generation = 0
        # ``lifecycle`` as a Python int, read by forwards (a compiled one guards on it and
        # recompiles when it changes, instead of reading the buffer)
        self.state_index = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The identity: a root ``nn.Sequential`` calls every child, this one included."""
        return args[0] if len(args) == 1 and not kwargs else (args, kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        # loaded scales invalidate every cached fake-quantized weight
        self.generation += 1
        self.state_index = int(self.lifecycle)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "state_index" not in state:  # pickled before the mirror existed
            self.state_index = int(self.lifecycle)

    def extra_repr(self) -> str:
        return f"state={_STATES[int(self.lifecycle)].value}"


class QdslHandle:
    """What ``qdsl.apply`` returns; ``remove()`` restores the model bit for bit."""

    def __init__(self, model: nn.Module, plan: "Plan", container: QdslContainer, registries: Any):
        self.model = model
        self.plan = plan
        self.registries = registries
        self.container = container
        self.layers: dict[str, "LayerPatch"] = {}
        self.removed = False
        self.ptq_report: Any = None
        """The ``qdsl.ptq.PtqReport`` of the last calibration that ran PTQ steps (set by qdsl.ptq)."""

    # ----------------------------------------------------------------- state
    @property
    def state(self) -> State:
        return _STATES[self.container.state_index]

    @state.setter
    def state(self, value: State) -> None:
        i = _STATES.index(State(value))
        self.container.lifecycle.fill_(i)
        self.container.state_index = i
        self.container.generation += 1

    @property
    def generation(self) -> int:
        return self.container.generation

    # --------------------------------------------------------------- proxies
    def quantizer(self, fqn: str, role: Role | str) -> "TensorQuantizer | None":
        """The proxy for ``(fqn, role)``, or None if that tensor stays float."""
        key = proxy_key(fqn, role)
        return self.container.quantizers[key] if key in self.container.quantizers else None

    def quantizers(self) -> dict[tuple[str, Role], "TensorQuantizer"]:
        """Every proxy, keyed by ``(fqn, role)``, in plan order."""
        out = {}
        for fqn, patch in self.layers.items():
            for role, q in patch.proxies().items():
                out[(fqn, role)] = q
        return out

    def layer(self, fqn: str) -> "LayerPatch":
        """The patch of one module (float/folded weight and bias, folded BN, proxies)."""
        try:
            return self.layers[fqn]
        except KeyError:
            raise QdslError(f"layer '{fqn}' is not patched by qdsl; patched: {', '.join(self.layers) or 'none'}") from None

    def __iter__(self) -> Iterator["LayerPatch"]:
        return iter(self.layers.values())

    def remove(self) -> None:
        """Undo ``apply``: hooks, moved parameters, BN folding, the container."""
        from qdsl.patch.apply import remove

        remove(self.model)

    def __repr__(self) -> str:
        return f"QdslHandle(state={self.state.value}, layers={len(self.layers)})"


def _eager(model: Any) -> bool:
    # a TorchScript module is an nn.Module whose _modules has no .get (qdsl is never applied to one)
    return isinstance(model, nn.Module) and not isinstance(model, torch.jit.ScriptModule)


def get_handle(model: nn.Module) -> QdslHandle:
    """The handle of a model qdsl was applied to (a clear error otherwise)."""
    container = model._modules.get("_qdsl") if _eager(model) else None
    if not isinstance(container, QdslContainer) or container.handle is None:
        raise QdslError(
            f"qdsl was not applied to this {type(model).__name__}: call qdsl.apply(model, spec) first"
        )
    return container.handle


def state_of(model: nn.Module) -> State | None:
    """The lifecycle state of an applied model, or None if qdsl is not applied."""
    container = model._modules.get("_qdsl") if _eager(model) else None
    if not isinstance(container, QdslContainer) or container.handle is None:
        return None
    return container.handle.state

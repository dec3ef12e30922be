"""The hook pair of layers qdsl computes itself (recurrent layers, multi-head attention).

torch runs ``nn.LSTM``/``nn.GRU``/``nn.MultiheadAttention`` as fused kernels on their
parameters, so no hook can reach the per-step states or the q/k/v/scores a quantizer must
see.  Without replacing the class or rebinding its forward (DESIGN §4), the layer is
computed by a float-equal re-implementation with the quantizers inside: a forward
pre-hook computes the result and stashes it, hands torch's own forward an empty batch (no
work), and a forward hook returns the stashed result.  Parameters never move, so
``state_dict`` keys and torch's flat-weight bookkeeping are untouched, and ``remove()``
only takes the two hooks off.  Subclasses define ``_pre`` (compute, stash, return the
empty call) and keep their proxies; this base holds the rest of the LayerPatch interface
they share.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from qdsl.patch.handle import proxy_key

__all__ = ["ComputedPatch"]


class ComputedPatch:
    """Base of :class:`~qdsl.patch.recurrent.RecurrentPatch` and
    :class:`~qdsl.patch.attention.AttentionPatch` (see the module docstring)."""

    def __init__(self, handle, plan: Any, module: Any):
        self.handle = handle
        self.fqn = plan.fqn
        self.plan = plan
        self.module = module
        # LayerPatch's one-proxy-per-role slots stay empty, so generic weight code skips the
        # layer: it has one proxy per tensor instead (``quantizers``, made by ``_proxy``)
        self.wq = self.bq = self.iq = self.oq = None
        self.bn = self.bn_fqn = None
        self.quantizers: dict[str, Any] = {}
        self._hooks: list[Any] = []
        self._stash: list[Any] = []

    def _proxy(self, make: Callable[[Any, str], Any], role: Any, suffix: str) -> Any:
        """The proxy ``make`` gives for ``role`` (None: not quantized), kept in ``quantizers``
        under its key plus ``suffix`` (one per layer/direction, q/k/v block...).  ``make`` is
        apply's closure: passed, not kept, so the patch stays picklable."""
        q = make(role, suffix)
        if q is not None:
            self.quantizers[proxy_key(self.fqn, role) + suffix] = q
        return q

    def proxies(self) -> dict:
        """Empty: the one-proxy-per-role view does not fit; see ``quantizers``."""
        return {}

    def master(self, name: str) -> torch.Tensor | None:
        return self.module._parameters.get(name)

    def float_params(self) -> tuple[None, None]:
        """No single ``weight``/``bias`` (the tensors' proxies are in ``quantizers``)."""
        return None, None

    def _cacheable(self, w, b) -> None:
        return None

    def install(self) -> None:
        m = self.module
        self._hooks.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
        self._hooks.append(m.register_forward_hook(self._post, prepend=True))

    def install_bn_skip(self) -> None:
        pass

    def uninstall(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._stash.clear()

    def refresh_now(self) -> None:
        pass  # nothing cached: the weights are fake-quantized on every forward

    def _pre(self, module, args, kwargs):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def _post(self, module, args, output):
        return self._stash.pop()

    # ---------------------------------------------------------- pickle, copy
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_stash"] = []
        return state

    def __deepcopy__(self, memo: dict) -> "ComputedPatch":
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__getstate__(), memo))
        return new

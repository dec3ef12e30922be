"""``module.weight`` before the first forward of ``qdsl.apply(..., materialize=False)``.

``qdsl.apply`` normally computes each patched layer's fake-quantized weight and bias at
install, so ``module.weight`` can be read at once.  That copy is as large as the float
master: for lean training (``qdsl.qat.LeanAdam``, which takes the weight out of the module
before any forward) it only raised the process's peak memory.  With ``materialize=False``
the install stores a :class:`LazyQuantized` instead:

* a ``torch.Tensor`` (``isinstance`` holds) with the real shape, dtype and device and **no
  storage**: reading ``.shape``/``.dtype``/``.device``/``.dim()``/``.numel()`` computes
  nothing;
* **any other use** (an operation, a method, ``repr``, ``copy.deepcopy``, ``pickle``)
  computes the layer's fake-quantized weight and bias exactly as install would have
  (``LayerPatch.refresh_now``: no autograd history), stores them on the module as install
  would have, and runs on the real tensor; after that ``module.weight`` is that real
  tensor;
* the layer's first forward recomputes ``module.weight``/``bias`` anyway (the patch's
  pre-hook), so the forward, its gradients and everything after it are those of an eager
  install bit for bit;
* ``type(module)`` never changes (the reason qdsl does not use a property or
  ``torch.nn.utils.parametrize``, which swap the module's class).

A ``LazyQuantized`` kept by the user after its layer computed (or left lean form, or was
removed) no longer names the module's value: it raises a ``QdslError`` when used.
"""

from __future__ import annotations

import copy

import torch
from torch.utils._pytree import tree_map

from qdsl.spec.diagnostics import QdslError

__all__ = ["LazyQuantized"]

# attribute reads answered from the wrapper's own metadata (nothing to compute)
_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndim.__get__,
    torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.numel, torch.Tensor.nelement,
    torch.Tensor.layout.__get__, torch.Tensor.is_floating_point, torch.Tensor.element_size,
    torch.Tensor.is_cuda.__get__,
}  # (not requires_grad: before calibration an input*weight bias is its master parameter itself)


class LazyQuantized(torch.Tensor):
    """The fake-quantized ``name`` (``weight``/``bias``) of ``patch``'s module, computed on
    first use (module docstring)."""

    @staticmethod
    def __new__(cls, patch, name: str, shape: torch.Size, like: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=like.dtype, device=like.device,
                                                requires_grad=False)
        t._patch, t._name, t._value = patch, name, None
        return t

    def __init__(self, *args, **kwargs) -> None:  # (``__new__`` did everything)
        super().__init__()

    def materialize(self) -> torch.Tensor:
        """The real value: the one install would have computed (computed now, and stored on
        the module, if this is still the module's attribute)."""
        if self._value is not None:
            return self._value
        patch = self._patch
        d = patch.module.__dict__
        if d.get(self._name) is self:
            # weight and bias are computed together: each lazy sibling keeps its value (a
            # copy of the module reads them one after the other)
            lazy = {n: t for n in ("weight", "bias") if isinstance(t := d.get(n), LazyQuantized)}
            patch.refresh_now()
            for n, t in lazy.items():
                t._value = d.get(n)
            return self._value
        raise QdslError(
            f"'{patch.fqn or '<model>'}.{self._name}' was read before the layer computed it "
            "(qdsl.apply(..., materialize=False)) and used after the module's attribute changed "
            f"(a forward, lean form or qdsl.remove): read module.{self._name} again")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        real = lambda a: a.materialize() if isinstance(a, LazyQuantized) else a  # noqa: E731
        return func(*tree_map(real, args), **tree_map(real, kwargs))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # reached only by a path that skipped __torch_function__ (C++ callers): same answer
        real = lambda a: a.materialize() if isinstance(a, LazyQuantized) else a  # noqa: E731
        return func(*tree_map(real, args), **tree_map(real, kwargs or {}))

    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(self.materialize())

    # pickle and deepcopy store the value (computed without autograd history; before
    # calibration an ``input*weight`` bias is the master parameter itself, which deepcopy's
    # memo then maps to the copy's master, as for an eager install)
    def __reduce_ex__(self, proto):
        return self.materialize().__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self.materialize(), memo)

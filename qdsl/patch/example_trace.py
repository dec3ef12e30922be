"""Tracing with the example input's values alongside the proxies (export's fixed shapes).

torch.fx traces with proxies, so code that reads a shape as a Python value fails: Hugging
Face's ``BertEmbeddings`` slices a buffer by ``input_ids.size()[1]``, ``create_bidirectional_mask``
branches on ``attention_mask.ndim``, eager attention asks ``query.size(-1)`` and
``torch.finfo(x.dtype)``.  Export lowers one example call at fixed shapes anyway (the
integer graph's batch stays free; every other size is the example's), so a tracer that
runs the example through each node as it records it (as the old ``transformers.utils.fx``
tracer did with meta tensors) can answer those questions with concrete values:

* every proxy carries its node's example value (``node.meta["qdsl_example"]``);
* ``.shape``, ``.size()``, ``.dim()``, ``.ndim``, ``.dtype``, ``.device`` and ``len()`` of a
  proxy are the example's (Python ints, a ``torch.Size``, a dtype), so shape arithmetic
  folds into constants; ``bool()`` of a proxy (data-dependent control flow) is still fx's
  error, and so is everything else;
* a tensor the model builds from constants (``self.position_ids[:, :seq_length]``: a
  buffer sliced by a now-concrete length) becomes a :func:`tensor_constant` node holding
  the value, not a ``_tensor_constant`` attribute fx would set on the user's model; the
  exporter folds what reads only constants (the position and token-type lookups).

:func:`unwrapped_forward` also lets the trace read through a ``forward`` decorator that
takes ``*args, **kwargs`` (transformers' ``merge_with_config_defaults``/``capture_outputs``
write into ``kwargs``, which fx passes as one proxy).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch
import torch.fx
from torch import nn
from torch.fx import _symbolic_trace as _fx

__all__ = ["ExampleTracing", "tensor_constant", "TensorBox", "unwrapped_forward"]

_EXAMPLE = "qdsl_example"


class TensorBox:
    """A constant tensor held by a :func:`tensor_constant` node (fx args hold no tensors)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"TensorBox({tuple(self.value.shape)})"


def tensor_constant(box: TensorBox) -> torch.Tensor:
    """A constant the traced code computed from buffers and concrete sizes."""
    return box.value


class _NoValue:
    pass


_NONE = _NoValue()


def _value(a: Any) -> Any:
    if isinstance(a, torch.fx.Proxy):
        return a.node.meta.get(_EXAMPLE, _NONE)
    if isinstance(a, torch.fx.Node):
        return a.meta.get(_EXAMPLE, _NONE)
    return a


class _ExampleProxy(torch.fx.Proxy):
    """A proxy whose shape queries answer with its example value's (module doc)."""

    def _example(self) -> torch.Tensor | None:
        v = self.node.meta.get(_EXAMPLE, _NONE)
        return v if isinstance(v, torch.Tensor) else None

    def _or_proxy(self, attr: str, fn):
        v = self._example()
        return fn(v) if v is not None else torch.fx.proxy.Attribute(self, attr)

    @property
    def shape(self):
        return self._or_proxy("shape", lambda v: v.shape)

    @property
    def ndim(self):
        return self._or_proxy("ndim", lambda v: v.ndim)

    @property
    def dtype(self):
        return self._or_proxy("dtype", lambda v: v.dtype)

    @property
    def device(self):
        return self._or_proxy("device", lambda v: v.device)

    def size(self, *dim):
        v = self._example()
        if v is None:
            return self.tracer.create_proxy("call_method", "size", (self, *dim), {})
        return v.size(*dim)

    def dim(self):
        v = self._example()
        return v.dim() if v is not None else self.tracer.create_proxy("call_method", "dim", (self,), {})

    def __len__(self):
        v = self._example()
        if v is None:
            return super().__len__()
        return len(v)


class ExampleTracing:
    """Mixin for a ``torch.fx.Tracer``: with :attr:`examples` set (forward parameter name ->
    example value), proxies carry example values (module doc); without, fx as usual."""

    examples: dict[str, Any] | None = None

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        if self.examples is None:
            return super().proxy(node)
        return _ExampleProxy(node, self)

    def create_arg(self, a: Any) -> Any:
        if self.examples is not None and isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter):
            if not any(a is b for b in self.root.buffers()):
                node = self.create_node("call_function", tensor_constant, (TensorBox(a),), {})
                node.meta[_EXAMPLE] = a
                return node
        return super().create_arg(a)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if self.examples is not None and isinstance(proxy, torch.fx.Proxy):
            proxy.node.meta[_EXAMPLE] = self._run(kind, target, args, kwargs)
        return proxy

    def _run(self, kind: str, target: Any, args, kwargs) -> Any:
        """The node's value on the example (``_NONE`` when it cannot be computed)."""
        if kind == "placeholder":
            return self.examples.get(str(target).lstrip("*"), _NONE)
        vals = torch.fx.node.map_aggregate(args, _value)
        kvals = torch.fx.node.map_aggregate(kwargs, _value)
        found: list[bool] = []
        torch.fx.node.map_aggregate((vals, kvals), lambda v: found.append(v is _NONE) or v)
        if any(found):
            return _NONE
        try:
            with torch.no_grad():
                if kind == "call_function":
                    return target(*vals, **kvals)
                if kind == "call_method":
                    return getattr(vals[0], target)(*vals[1:], **kvals)
                if kind == "call_module":
                    with _untraced():
                        return self.root.get_submodule(target)(*vals, **kvals)
                if kind == "get_attr":
                    obj = self.root
                    for part in str(target).split("."):
                        obj = getattr(obj, part)
                    return obj
        except Exception:  # noqa: BLE001 - the trace itself reports what cannot be traced
            return _NONE
        return _NONE


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    # fx routes nn.Module.__call__/__getattr__ through the tracer while it traces: a leaf
    # module run on the example values must take the plain path (no nodes, real weights)
    call, get = nn.Module.__call__, nn.Module.__getattr__
    nn.Module.__call__, nn.Module.__getattr__ = _fx._orig_module_call, _fx._orig_module_getattr
    try:
        yield
    finally:
        nn.Module.__call__, nn.Module.__getattr__ = call, get


def _has_var_kwargs(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params)


@contextlib.contextmanager
def unwrapped_forward(model: nn.Module) -> Iterator[dict[str, Any]]:
    """While tracing, ``model`` runs its undecorated ``forward`` when a decorator hides its
    parameters behind ``*args, **kwargs`` (module doc): the instance's class is swapped for a
    same-named subclass (fx traces ``type(root).forward``) and restored afterwards.  Yields
    the concrete arguments the undecorated forward then needs: its own ``**kwargs`` empty
    (fx would pass it as one proxy)."""
    cls = type(model)
    fn = cls.forward
    inner = inspect.unwrap(fn)
    if inner is fn or not _has_var_kwargs(fn) or "self" not in inspect.signature(inner).parameters:
        yield {}
        return
    extra = {"**" + p.name: {} for p in inspect.signature(inner).parameters.values() if p.kind is p.VAR_KEYWORD}
    model.__class__ = type(cls.__name__, (cls,), {"forward": inner, "__module__": cls.__module__,
                                                   "__qualname__": cls.__qualname__})
    try:
        yield extra
    finally:
        model.__class__ = cls

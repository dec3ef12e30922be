"""One torch.fx trace of a model, shared by every stage that needs its graph.

:func:`trace_model` traces an (unpatched or patched: fx bypasses forward hooks) model
once and returns a :class:`ModelTrace`:

* ``graph``: the ``torch.fx.Graph`` (no ``GraphModule``: code generation would double the
  cost), or ``None`` when fx cannot trace the model; then ``error`` says why
  (``"TraceError: symbolically traced variables cannot be used as inputs to control
  flow"``) so callers can tell the user what was not checked instead of skipping it;
* ``calls``: how many times each module was called during the trace, by fqn.  fx routes
  every ``module(...)`` call through ``Tracer.call_module``, leaf or not, so a block
  called twice counts 2 even though its body is inlined; the root counts 1;
* ``leaves``: the fqns fx kept as ``call_module`` nodes.  Their children are invisible
  to the trace (``nn.MultiheadAttention`` and every other ``torch.nn`` class is a leaf),
  so :meth:`ModelTrace.seen` tells a module fx watched from one it could not see into.

Users: BatchNorm folding (:mod:`qdsl.patch.fold`), the coverage check of ``apply``
(:mod:`qdsl.patch.coverage`) and lint's op graph (:mod:`qdsl.lint.graph`).

The export variant, :class:`MarkingTracer`, traces a *patched* model for
:mod:`qdsl.export.lower`: it bypasses qdsl's hooks (hooks do not belong in a graph), keeps
every layer with a weight quantizer as a leaf, inserts a :func:`quantizer_mark` node
wherever a patched module's input or output quantizer acts, and records in
``node.meta["qdsl_scope"]`` the module each node was traced in.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import attrs
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from qdsl.patch.example_trace import ExampleTracing, unwrapped_forward
from qdsl.patch.softmax_roles import TracingRoles

__all__ = ["ModelTrace", "trace_model", "trace_graph", "MarkingTracer", "quantizer_mark"]

# torch.nn classes traced through rather than kept as leaves: their forward guards a fused
# fast path with checks fx cannot trace (``src.dim() != 3`` on a proxy, ``_none_or_dtype`` of
# a mask); with the fast path switched off and the masks None (the concrete arguments of a
# root layer) the rest is plain module calls (self_attn, norm1, linear1, ...)
_TRANSPARENT: tuple[type, ...] = (nn.TransformerEncoderLayer,)
_CONCRETE: dict[type, dict[str, Any]] = {
    nn.TransformerEncoderLayer: {"src_mask": None, "src_key_padding_mask": None, "is_causal": False},
}


def _pass_mask(canonical):
    # TransformerEncoderLayer.forward turns a bool mask into an additive float one
    # (F._canonical_mask), asking the other mask's dtype first (F._none_or_dtype); on a proxy
    # both raise.  A traced mask goes to the MultiheadAttention call as it is: a bool mask
    # (True = masked) means what its -inf/0 form does (qdsl.patch.attention reads either).
    def wrapped(mask, *args, **kwargs):
        if isinstance(mask, torch.fx.Proxy):
            return mask
        return canonical(mask, *args, **kwargs)
    return wrapped


def _none_or_dtype(x):
    return None if isinstance(x, torch.fx.Proxy) else _NONE_OR_DTYPE(x)


_NONE_OR_DTYPE = getattr(F, "_none_or_dtype", None)
_CANONICAL_MASK = getattr(F, "_canonical_mask", None)


@contextlib.contextmanager
def _slow_paths() -> Iterator[None]:
    # torch's process-wide switch and the two mask helpers above, restored when the trace
    # ends (fx runs no other code meanwhile)
    prev = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    patched = _NONE_OR_DTYPE is not None and _CANONICAL_MASK is not None
    if patched:
        F._none_or_dtype, F._canonical_mask = _none_or_dtype, _pass_mask(_CANONICAL_MASK)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(prev)
        if patched:
            F._none_or_dtype, F._canonical_mask = _NONE_OR_DTYPE, _CANONICAL_MASK


def _drop_concrete(graph: torch.fx.Graph) -> None:
    """Remove the placeholders of concrete arguments (the masks fixed to None) and the
    assertions fx hangs on them: the traced model has one tensor input."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for ph in placeholders[1:]:
        if not ph.args:  # no default: a real input
            continue
        doomed, todo = [], [ph]
        while todo:
            n = todo.pop()
            if n not in doomed:
                doomed.append(n)
                todo.extend(n.users)
        for n in reversed([n for n in graph.nodes if n in doomed]):
            graph.erase_node(n)


def trace_graph(tracer: torch.fx.Tracer, model: nn.Module, concrete: dict[str, Any] | None = None,
                examples: dict[str, Any] | None = None) -> torch.fx.Graph:
    """``tracer.trace(model)``, through the classes of ``_TRANSPARENT`` (root or not).
    ``concrete``: the caller's forward parameters specialized to a non-tensor value (export's
    unset or ``None`` inputs), on top of the ones a known root class needs.  ``examples``
    (forward parameter -> example value; an :class:`ExampleTracing` tracer): when the plain
    trace fails, trace again with the example's values and concrete shapes, through a
    ``**kwargs`` forward decorator (:mod:`qdsl.patch.example_trace`); its error is the one
    raised if that fails too."""
    known = next((c for t, c in _CONCRETE.items() if isinstance(model, t)), None)
    merged = {**(known or {}), **(concrete or {})}
    with _slow_paths():
        try:
            graph = tracer.trace(model, concrete_args=merged or None)
        except Exception:
            if examples is None or not isinstance(tracer, ExampleTracing):
                raise
            tracer.examples = examples
            try:
                with unwrapped_forward(model) as extra:
                    graph = tracer.trace(model, concrete_args={**merged, **extra} or None)
            finally:
                tracer.examples = None
    if known is not None:
        _drop_concrete(graph)
    return graph


@attrs.frozen
class ModelTrace:
    """See the module docstring."""

    model_type: str
    graph: Any = attrs.field(eq=False, repr=False)
    calls: dict[str, int] = attrs.field(factory=dict)
    leaves: frozenset[str] = frozenset()
    error: str | None = None

    @property
    def traced(self) -> bool:
        return self.graph is not None

    def seen(self, fqn: str) -> bool:
        """Whether the trace watched calls of ``fqn``: traced, and not inside a leaf."""
        if self.graph is None:
            return False
        parts = fqn.split(".")
        return not any(".".join(parts[:i]) in self.leaves for i in range(1, len(parts)))


class _CountingTracer(ExampleTracing, torch.fx.Tracer):
    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {"": 1}

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return not isinstance(m, _TRANSPARENT) and super().is_leaf_module(m, qualname)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            fqn = self.path_of_module(m)
        except NameError:  # a module built inside forward: not part of the model's tree
            fqn = None
        if fqn is not None:
            self.calls[fqn] = self.calls.get(fqn, 0) + 1
        return super().call_module(m, forward, args, kwargs)


def trace_model(model: nn.Module, concrete: dict[str, Any] | None = None,
                examples: dict[str, Any] | None = None) -> ModelTrace:
    """Trace ``model`` with torch.fx (default leaves); never raises for an untraceable model.
    ``concrete``: forward parameters specialized to a value (export's unset inputs);
    ``examples``: see :func:`trace_graph`."""
    tracer = _CountingTracer()
    try:
        graph = trace_graph(tracer, model, concrete, examples)
    except Exception as exc:  # noqa: BLE001 - fx raises many types (TraceError, TypeError, ...)
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ModelTrace(type(model).__name__, None, error=f"{type(exc).__name__}: {msg}"[:300])
    leaves = frozenset(str(n.target) for n in graph.nodes if n.op == "call_module")
    return ModelTrace(type(model).__name__, graph, tracer.calls, leaves)


@contextlib.contextmanager
def _entered(mode, item) -> Iterator[None]:
    if not mode.stack:
        mode.__enter__()
    mode.stack.append(item)
    try:
        yield
    finally:
        mode.stack.pop()
        if not mode.stack:
            mode.__exit__(None, None, None)


def quantizer_mark(x, fqn: str, role: str):
    """Marker for 'the quantizer of (fqn, role) acts here' in a :class:`MarkingTracer`
    graph; identity when run."""
    return x


class MarkingTracer(ExampleTracing, torch.fx.Tracer):
    """Export's variant: bypasses hooks; inserts :func:`quantizer_mark` nodes for the
    patched input/output quantizers of ``handle`` (a ``qdsl.patch`` handle)."""

    def __init__(self, handle) -> None:
        super().__init__()
        self.handle = handle
        self._scopes: list[str] = [""]
        self._roles = TracingRoles(
            lambda x, fqn, role: self.create_proxy("call_function", quantizer_mark, (x, fqn, role), {}))

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        patch = self.handle.layers.get(qualname)
        if patch is not None and patch.wq is not None:
            return True
        return not isinstance(m, _TRANSPARENT) and super().is_leaf_module(m, qualname)

    def _roles_for(self, fqn: str, scores: bool, probs: bool):
        return _entered(self._roles, (fqn, scores, probs))

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        node.meta["qdsl_scope"] = self._scopes[-1]
        return node

    def call_module(self, m, forward, args, kwargs):
        fqn = self.path_of_module(m)
        patch = self.handle.layers.get(fqn)
        if patch is not None and patch.iq is not None and args:
            args = (self.create_proxy("call_function", quantizer_mark, (args[0], fqn, "input"), {}),) + tuple(args[1:])
        self._scopes.append(fqn)
        sq, pq = getattr(patch, "sq", None), getattr(patch, "pq", None)
        roles = (sq is not None or pq is not None) and not self.is_leaf_module(m, fqn)
        try:
            if self.is_leaf_module(m, fqn):
                out = self.create_proxy("call_module", fqn, args, kwargs)
            elif roles:
                # the softmax this module computes gets its scores/probs markers
                with self._roles_for(fqn, sq is not None, pq is not None):
                    out = m.forward(*args, **kwargs)
            else:
                out = m.forward(*args, **kwargs)  # m(...) would run qdsl's hooks on proxies
        finally:
            self._scopes.pop()
        if patch is not None and patch.oq is not None:
            out = self.create_proxy("call_function", quantizer_mark, (out, fqn, "output"), {})
        return out

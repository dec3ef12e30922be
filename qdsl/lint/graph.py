"""The model's op graph as lint needs it: op types, producers, first and last layers.

:func:`model_graph` traces an ``nn.Module`` with torch.fx (:mod:`qdsl.patch.trace`) so that
functional ops (``x + y``, ``torch.cat``, ``F.relu``) are seen as well as modules.  When
tracing fails (data-dependent control flow) or only a :class:`ModelIndex` is available,
:func:`index_graph` falls back to the leaf modules in registration order, chained one
after another; ``ModelGraph.traced`` says which one was used so lint can tell the user
that functional ops were not checked.

Positions (for profiles' ``first_layer`` / ``last_layer`` allowances): a weighted layer
is *first* when some path from a model input reaches it without passing through another
weighted layer, and *last* when some path from it reaches the model output without
passing through another weighted layer.  In the index fallback: the first and the last
weighted leaf in registration order.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs

from qdsl.lint.ops import (WEIGHTED_OPS, function_lowering, function_op, method_op, module_lowered, module_lowering,
                           module_op)
from qdsl.resolve.plan import ModelIndex

__all__ = ["OpNode", "ModelGraph", "model_graph", "index_graph"]


@attrs.frozen
class OpNode:
    """One op of the model (``op`` is ``None`` for no-ops such as ``Identity``)."""

    name: str
    op: str | None
    module: str | None
    """The module fqn for module calls; ``None`` for functional ops."""
    preds: tuple[str, ...]
    label: str
    """How messages name it: the module fqn, or ``add in layer1.0`` for a functional op."""
    lowered: bool = True
    """Whether export has an integer lowering for the construct (the catalog's ``lowering``;
    export refuses one without, even a no-op such as ``F.dropout``); only a traced graph says
    (the index fallback sees modules it cannot classify)."""
    construct: str = ""
    """The class, function or method name (what export's refusal names)."""


@attrs.frozen
class ModelGraph:
    nodes: tuple[OpNode, ...]
    first: frozenset[str]
    last: frozenset[str]
    traced: bool
    trace: Any = attrs.field(default=None, eq=False, repr=False)
    """The :class:`qdsl.patch.trace.ModelTrace` the nodes came from (a traced ``nn.Module``)."""
    by_name: dict[str, OpNode] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "by_name", {n.name: n for n in self.nodes})

    def producers(self, node: OpNode, skip_ops: frozenset[str] = frozenset()) -> list[OpNode]:
        """The ops whose results feed ``node``, looking through no-ops and ``skip_ops``."""
        out: list[OpNode] = []
        todo = list(node.preds)
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name in seen or name not in self.by_name:
                continue
            seen.add(name)
            p = self.by_name[name]
            if p.op is None or p.op in skip_ops:
                todo.extend(p.preds)
            else:
                out.append(p)
        return out


def _recurrent_result(node: Any, modules: dict) -> bool:
    """``node`` is (an item of) a recurrent layer's tuple result: export reads ``out``,
    ``h_n[k]`` and ``out[:, -1]`` from it (qdsl/export/lower_recurrent.py)."""
    while getattr(node, "op", "") == "call_function" and _fn_name(node.target) == "getitem":
        node = node.args[0]
    if getattr(node, "op", "") != "call_module":
        return False
    return module_lowering(type(modules.get(str(node.target))).__name__) == "recurrent"


def _positions(nodes: list[OpNode], inputs: list[str], output_preds: list[str]) -> tuple[frozenset, frozenset]:
    by = {n.name: n for n in nodes}
    users: dict[str, list[str]] = {}
    for n in nodes:
        for p in n.preds:
            users.setdefault(p, []).append(n.name)

    def walk(starts, step) -> frozenset[str]:
        hit, seen, todo = set(), set(starts), deque(starts)
        while todo:
            name = todo.popleft()
            for nxt in step(name):
                if nxt in seen:
                    continue
                seen.add(nxt)
                node = by.get(nxt)
                if node is not None and node.op in WEIGHTED_OPS and node.module is not None:
                    hit.add(node.module)
                else:
                    todo.append(nxt)
        return frozenset(hit)

    first = walk(inputs, lambda n: users.get(n, ()))
    last = walk(["<output>"], lambda n: output_preds if n == "<output>" else (by[n].preds if n in by else ()))
    return first, last


def _fn_name(target: Any) -> str:
    return getattr(target, "__name__", str(target)).strip("_") or str(target)


def model_graph(model: Any) -> ModelGraph:
    """Trace ``model`` with torch.fx; on failure fall back to :func:`index_graph`."""
    from qdsl.patch.trace import trace_model  # torch: only when a model is traced
    import torch.fx

    if torch.fx.Tracer().is_leaf_module(model, ""):
        # the model is one torch.nn layer (a bare nn.Linear): fx would trace its forward
        # into get_attr + F.linear, losing the module; it is one module call, as export sees it
        node = OpNode("root", module_op(type(model).__name__), "", ("x",), "<model>")
        at = frozenset({""}) if node.op in WEIGHTED_OPS else frozenset()
        return ModelGraph((node,), at, at, traced=True)
    trace = trace_model(model)
    graph = trace.graph
    if graph is None:  # any tracing failure means: use the module list
        return index_graph(ModelIndex.from_module(model))
    modules = dict(model.named_modules())
    nodes: list[OpNode] = []
    inputs: list[str] = []
    output_preds: list[str] = []
    for node in graph.nodes:
        preds = tuple(a.name for a in node.all_input_nodes)
        if node.op == "placeholder":
            inputs.append(node.name)
            continue
        if node.op == "output":
            output_preds = list(preds)
            continue
        if node.op == "get_attr":
            nodes.append(OpNode(node.name, None, None, (), node.name))
            continue
        if node.op == "call_module":
            fqn = str(node.target)
            mod = modules.get(fqn)
            cls = type(mod).__name__
            op = module_op(cls) if mod is not None else None
            nodes.append(OpNode(node.name, op, fqn, preds, fqn, mod is None or module_lowered(cls), cls))
            continue
        name = _fn_name(node.target)
        op = function_op(name) if node.op == "call_function" else method_op(name)
        stack = node.meta.get("nn_module_stack") or {}
        where = ""
        if stack:
            last_entry = list(stack.values())[-1]
            where = last_entry[0] if isinstance(last_entry, tuple) else str(last_entry)
        label = f"{name} in {where or '<root>'}"
        rule = function_lowering(name)
        if rule == "item":  # x.size()[0] is shape arithmetic; indexing a tensor has no lowering
            src = node.args[0] if node.args else None
            rule = rule if (getattr(src, "op", "").startswith("call_") and function_lowering(
                _fn_name(src.target)) == "shape") or _recurrent_result(src, modules) else None
        if rule == "mul":  # two activations, or shape arithmetic; a constant factor has no lowering
            values = [a for a in node.args if hasattr(a, "op")]
            shape = any(a.op.startswith("call_") and function_lowering(_fn_name(a.target)) in ("shape", "item")
                        for a in values)
            rule = rule if len(values) == 2 or shape else None
        nodes.append(OpNode(node.name, op, None, preds, label, rule is not None, name))
    first, last = _positions(nodes, inputs, output_preds)
    return ModelGraph(tuple(nodes), first, last, traced=True, trace=trace)


def index_graph(index: ModelIndex) -> ModelGraph:
    """Leaf modules in registration order, each fed by the previous one."""
    nodes: list[OpNode] = []
    prev: tuple[str, ...] = ()
    weighted: list[str] = []
    for e in index.entries:
        if not e.leaf or e.fqn == "":
            continue
        op = module_op(e.type_name)
        nodes.append(OpNode(e.fqn, op, e.fqn, prev, e.fqn))
        prev = (e.fqn,)
        if op in WEIGHTED_OPS:
            weighted.append(e.fqn)
    first = frozenset(weighted[:1])
    last = frozenset(weighted[-1:])
    return ModelGraph(tuple(nodes), first, last, traced=False)

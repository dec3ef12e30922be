"""Signed binary activations that a ReLU feeds: apply's located warning.

``sign(relu(x))`` is +1 everywhere (``sign(0) = +1``, the tie rule every binary quantizer,
the reference executor and the C++ runtime share), so a signed binary input without a
learned threshold after a ReLU is a constant: the layer sees no information and QAT
cannot learn (a ReLU CNN under the old xnor spec stayed at 10% on digits).  With
``threshold = learned`` the codes are ``x >= t[c]``, which is meaningful after a ReLU.

The producers of each such layer's input are found in apply's torch.fx graph, looking
through ops that keep a non-negative value non-negative (pools, reshapes, dropout,
identity); the warning fires when every producer is a ReLU/ReLU6 (module, inplace module,
``F.relu``/``torch.relu``/``relu_``, ``F.relu6``, ``x.relu()``).  ``qdsl lint`` reports
the same finding as W319 (profile-independent).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.fx
from torch import nn

from qdsl.patch.constructs import functions, methods, module_construct
from qdsl.resolve.plan import Plan
from qdsl.spec.diagnostics import Diagnostic, Span
from qdsl.spec.model import Role

__all__ = ["BinaryAfterReluWarning", "binary_after_relu", "warn_binary_after_relu"]

_NONNEGATIVE = frozenset({"relu", "relu6"})
_KEEPS_SIGN = frozenset({"max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d", "global_avg_pool", "mean", "reshape"})
_FUNCTIONS = functions()
_METHODS = methods()


class BinaryAfterReluWarning(UserWarning):
    """A signed binary input without a threshold reads only ReLU outputs (module doc)."""

    def __init__(self, message: str, diagnostics: list[Diagnostic]):
        super().__init__(message)
        self.diagnostics = diagnostics


def _op(node: torch.fx.Node, modules: dict[str, nn.Module]) -> str | None | bool:
    """The construct table's op of ``node``; False when the node is not in the table."""
    c = None
    if node.op == "call_module":
        c = module_construct(modules.get(str(node.target)))
    elif node.op == "call_function":
        c = _FUNCTIONS.get(node.target)
    elif node.op == "call_method":
        c = _METHODS.get(str(node.target))
    return False if c is None else c.op


def _only_relu(start: Any, modules: dict[str, nn.Module]) -> bool:
    """Every value reaching ``start`` (through sign-keeping ops) is a ReLU's output."""
    todo, seen, found = [start], set(), False
    while todo:
        node = todo.pop()
        if not isinstance(node, torch.fx.Node) or node in seen:
            continue
        seen.add(node)
        op = _op(node, modules)
        if op in _NONNEGATIVE:
            found = True
        elif op is None or op in _KEEPS_SIGN:
            # the value flows through its first argument (pool/reshape/dropout/identity)
            todo.append(node.args[0] if node.args else None)
        else:
            return False  # a placeholder, a layer, an add...: not known to be >= 0
    return found


def _written(plan_layer: Any, fallback: Span) -> Span:
    """Where the layer's input kind is written (the preset's line when it came through one)."""
    p = plan_layer.provenance.get((Role.INPUT, "kind"))
    if p is None:
        return fallback
    if p.via and p.via[-1].span.known:
        return p.via[-1].span
    return p.set_by.span if p.set_by.span.known else fallback


def binary_after_relu(model: nn.Module, graph: torch.fx.Graph | None, plan: Plan) -> list[Diagnostic]:
    """One warning per spec location: the layers whose signed binary input (no threshold)
    only ReLU outputs feed.  Nothing when fx could not trace the model."""
    if graph is None:
        return []
    modules = dict(model.named_modules())
    layers = {}
    for lp in plan.layers:
        r = lp.roles.get(Role.INPUT) if lp.quantized else None
        if r is not None and r.format.activation_lowering(r.signed) == "bin" and r.threshold != "learned":
            layers[lp.fqn] = lp
    hits: dict[tuple, list[str]] = {}
    spans: dict[tuple, Span] = {}
    for node in graph.nodes:
        lp = layers.get(str(node.target)) if node.op == "call_module" else None
        if lp is None or not node.args or not _only_relu(node.args[0], modules):
            continue
        span = _written(lp, Span(getattr(plan.spec, "source", "") or "<spec>"))
        key = (span.file, span.line, span.col)
        spans[key] = span
        if lp.fqn not in hits.setdefault(key, []):
            hits[key].append(lp.fqn)
    return [Diagnostic.warning(
        "W319", "a signed binary input after a ReLU is always +1 (sign(0) = +1): "
        f"{'layer' if len(names) == 1 else 'layers'} {', '.join(names)} see{'s' if len(names) == 1 else ''} "
        "a constant", spans[key],
        "add a learned per-channel threshold: binary(signed, threshold=learned) (TOML: threshold = \"learned\")")
        for key, names in hits.items()]


def warn_binary_after_relu(model: nn.Module, graph: torch.fx.Graph | None, plan: Plan, stacklevel: int = 3) -> None:
    diags = binary_after_relu(model, graph, plan)
    if diags:
        text = "qdsl: " + "\n\n".join(d.render() for d in diags)
        warnings.warn(BinaryAfterReluWarning(text, diags), stacklevel=stacklevel)

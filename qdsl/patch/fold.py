"""Finding the Conv/Linear -> BatchNorm pairs to fold (``fold_bn = true``).

A pair is a BatchNorm whose input is the output of a Conv1d/Conv2d/Linear that nothing
else reads, both modules called exactly once, with ``num_features`` equal to the
layer's output channels and running statistics present.  Found with the ``torch.fx``
trace of :mod:`qdsl.patch.trace`; when tracing fails (data-dependent control flow, ...)
the fallback pairs a layer with the BatchNorm registered right after it in the same
parent (what ``nn.Sequential`` and most hand-written blocks do), with a warning saying so.

The folding arithmetic itself lives in :meth:`qdsl.patch.layer.LayerPatch.float_params`.
"""

from __future__ import annotations

import warnings

from torch import nn

from qdsl.patch.trace import ModelTrace, trace_model
from qdsl.spec.diagnostics import QdslWarning

__all__ = ["find_bn_pairs", "FOLDABLE", "BATCHNORMS"]

FOLDABLE = (nn.Conv1d, nn.Conv2d, nn.Linear)
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


def _compatible(layer: nn.Module, bn: nn.Module) -> bool:
    out = layer.out_channels if isinstance(layer, (nn.Conv1d, nn.Conv2d)) else layer.out_features
    if isinstance(layer, nn.Conv2d) != isinstance(bn, nn.BatchNorm2d):
        return False
    return (bn.num_features == out and bn.track_running_stats
            and bn.running_mean is not None and bn.running_var is not None)


def _by_trace(model: nn.Module, graph) -> dict[str, str]:
    import torch.fx

    modules = dict(model.named_modules())
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    pairs = {}
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), BATCHNORMS):
            continue
        src = node.args[0] if node.args else None
        if not isinstance(src, torch.fx.Node) or src.op != "call_module":
            continue
        layer = modules.get(src.target)
        if (isinstance(layer, FOLDABLE) and len(src.users) == 1 and calls[src.target] == 1
                and calls[node.target] == 1 and _compatible(layer, modules[node.target])):
            pairs[src.target] = node.target
    return pairs


def _by_order(model: nn.Module) -> dict[str, str]:
    pairs = {}
    for parent_name, parent in model.named_modules():
        children = list(parent.named_children())
        for (name_a, a), (name_b, b) in zip(children, children[1:]):
            if isinstance(a, FOLDABLE) and isinstance(b, BATCHNORMS) and _compatible(a, b):
                prefix = f"{parent_name}." if parent_name else ""
                pairs[prefix + name_a] = prefix + name_b
    return pairs


def find_bn_pairs(model: nn.Module, trace: ModelTrace | None = None) -> dict[str, str]:
    """``{layer_fqn: bn_fqn}`` for every foldable pair (see the module docstring);
    ``trace`` is the model's :func:`~qdsl.patch.trace.trace_model` if the caller has it."""
    trace = trace if trace is not None else trace_model(model)
    if trace.graph is not None:
        return _by_trace(model, trace.graph)
    warnings.warn(
        f"qdsl: torch.fx could not trace {trace.model_type} ({trace.error}); "
        "BatchNorm folding pairs each layer with the BatchNorm registered right after it",
        QdslWarning, stacklevel=3,
    )
    return _by_order(model)

"""Which quantizers read a layer's result (for the bias a folded BatchNorm creates).

A folded bias becomes an int32 proxy at scale input × weight when some non-binary
quantizer reads the layer's result: that is the bias the exporter puts in the graph
(rounded half-even), so the fake-quant model and the graph add the same value.  When only
binary quantizers read it, the float bias stays: the exporter lowers it as
``floor(b / s)``, and ``acc + floor(b/s) < 0`` is exactly ``acc·s + b < 0``; a rounded
bias would instead make the integer sum hit 0 on some outputs, where the fake-quant
model's sign is decided by float32 rounding noise, and each flipped sign moves the next
layer by whole accumulator steps (measured on the xnor spec, calibrated: with rounded
biases 1.6e-5 of the binary codes flipped, on 5 of 449 images, up to 20 LSB at the
classifier's input; with float biases none).

Readers are found with ``torch.fx``, looking through BatchNorm, activations, max pools,
dropout and reshapes (what the exporter lets a pending result pass); the layer's own
output quantizer, when it has one, is its only reader.  Anything else on the way (an
add, an average pool, the model output) or a model fx cannot trace counts as a
non-binary reader, which keeps the rounded int32 bias.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
import torch.fx
from torch import nn

from qdsl.patch.constructs import functions, methods, module_classes
from qdsl.spec.formats import NumberFormat

__all__ = ["read_only_by_binary"]

# what a pending layer result passes through: the construct table's ``passes`` rows
_PASS_MODULES = module_classes(lambda c: c.passes)
_PASS_FUNCTIONS = tuple(functions(lambda c: c.passes))
_PASS_METHODS = tuple(methods(lambda c: c.passes))

def read_only_by_binary(model: nn.Module, graph: torch.fx.Graph | None, layers: Iterable[str],
                        input_kinds: Mapping[str, NumberFormat], output_kinds: Mapping[str, NumberFormat]) -> set[str]:
    """The fqns among ``layers`` whose result only binary quantizers read (module doc).

    ``graph``: the model's fx graph (:func:`qdsl.patch.trace.trace_model`), ``None`` when
    fx could not trace it.

    ``input_kinds`` / ``output_kinds``: the number format of each layer's input / output
    quantizer; a *binary* reader is one whose format is a ``sign_reader``."""
    wanted = set(layers)
    binary = {f for f in wanted if _sign(output_kinds.get(f))}
    todo = {f for f in wanted if f not in output_kinds}
    if not todo:
        return binary
    if graph is None:  # untraceable: every reader unknown, keep the int32 bias
        return binary
    modules = dict(model.named_modules())

    def passes(node: torch.fx.Node) -> bool:
        if node.op == "call_module":
            return isinstance(modules.get(str(node.target)), _PASS_MODULES)
        if node.op == "call_function":
            return node.target in _PASS_FUNCTIONS
        return node.op == "call_method" and node.target in _PASS_METHODS

    readers: dict[str, set] = {}  # over every call of the layer
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in todo:
            continue
        kinds = readers.setdefault(str(node.target), set())
        frontier, seen = list(node.users), set()
        while frontier:
            user = frontier.pop()
            if user in seen:
                continue
            seen.add(user)
            target = str(user.target)
            if user.op == "call_module" and target in input_kinds:
                kinds.add(input_kinds[target])
            elif user.op == "call_module" and target in output_kinds:
                kinds.add(output_kinds[target])  # e.g. an activation module with its own output quantizer
            elif passes(user):
                frontier.extend(user.users)
            else:
                kinds.add(None)
    return binary | {f for f, kinds in readers.items() if kinds and all(_sign(k) for k in kinds)}


def _sign(fmt: NumberFormat | None) -> bool:
    return fmt is not None and fmt.sign_reader

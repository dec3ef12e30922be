"""Implied quantizers: integer adds and concats need no hand-written rule.

An integer ADD or CONCAT (docs/qgraph.md) reads int8 operands or a layer's raw
accumulator.  When a spec leaves one of its operands unquantized (torchvision's ResNet
adds the stem's max pool output, a Bottleneck block's output; MobileNetV2 adds the
previous block's sum), the plan gains an *implied* output quantizer of the spec's default
input kind on the module that returns that value, and ``qdsl explain`` reports it as
"implied by <op>".  Chosen over requantizing in the exporter (DESIGN.md §9): the
fake-quant model then computes what the integer graph computes (the quantizer is
observed, calibrated and trained like any other), and a value added twice, or added
and then read by the next block, is quantized once.

The operands are found with the apply trace (:mod:`qdsl.patch.trace`): for each add or
concat (the construct table's ``add``/``concat`` rows), an operand is fine when it is a
weighted layer's or BatchNorm's direct result (the exporter adds the accumulator) or
already quantized (an output quantizer on the module returning it).  Otherwise the
quantizer goes on the outermost module that returns the value (the value has a reader
outside it) and is called once per forward; a value no such module returns (a model
input, a bare function's result at the top level) gets none, and export still names it.
A spec without a ``defaults { input = ... }`` implies nothing.
"""

from __future__ import annotations

import attrs
import torch.fx
from torch import nn

from qdsl.patch.constructs import functions, methods
from qdsl.patch.trace import ModelTrace
from qdsl.resolve.plan import FieldProvenance, LayerPlan, Origin, Plan
from qdsl.spec.model import Role

__all__ = ["implied_outputs", "with_implied"]

_INTEGER_OPS = ("add", "concat")
_FUNCS = functions(lambda c: c.lowering in _INTEGER_OPS)
_METHODS = methods(lambda c: c.lowering in _INTEGER_OPS)
# a direct result of these is an accumulator the exporter adds (or rescales) exactly
_ACCUMULATORS = (nn.Conv1d, nn.Conv2d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d)


def _stack(n: torch.fx.Node) -> list[str]:
    return list(n.meta.get("nn_module_stack", {}).keys())


def _operands(n: torch.fx.Node) -> list[torch.fx.Node]:
    args = n.args[0] if _FUNCS.get(n.target) is not None and isinstance(n.args[0], (list, tuple)) else n.args
    return [a for a in args if isinstance(a, torch.fx.Node)]


def implied_outputs(model: nn.Module, trace: ModelTrace, plan: Plan) -> dict[str, str]:
    """``{module fqn: "implied by <op> in '<where>'"}`` for the values integer adds and concats
    read that the plan leaves unquantized (see the module docstring)."""
    if trace.graph is None:
        return {}
    modules = dict(model.named_modules())
    quantized_out = {lp.fqn for lp in plan.layers if lp.quantized and lp.roles.get(Role.OUTPUT) is not None}
    found: dict[str, str] = {}
    for n in trace.graph.nodes:
        if n.op == "call_function" and n.target in _FUNCS:
            op = "torch.cat" if _FUNCS[n.target].lowering == "concat" else "add"
        elif n.op == "call_method" and n.target in _METHODS:
            op = n.target
        else:
            continue
        where = (_stack(n) or ["<model>"])[-1]
        for a in _operands(n):
            if a.op == "call_module" and isinstance(modules.get(str(a.target)), _ACCUMULATORS):
                continue
            stack = _stack(a)
            returned_by = [m for m in stack if any(m not in _stack(u) for u in a.users)]
            if any(m in quantized_out for m in returned_by):
                continue
            owner = next((m for m in returned_by if trace.calls.get(m, 1) == 1), None)
            if owner is not None:
                found.setdefault(owner, f"implied by {op} in '{where}'")
    return found


def with_implied(model: nn.Module, trace: ModelTrace, plan: Plan) -> Plan:
    """``plan`` with the implied output quantizers of :func:`implied_outputs` added (the spec's
    default input recipe, with its provenance relabelled "implied by ...")."""
    source = next((lp for lp in plan.layers if lp.roles.get(Role.INPUT) is not None
                   and (p := lp.provenance.get((Role.INPUT, "kind"))) is not None and p.set_by.label == "defaults"),
                  None)
    if source is None:
        return plan
    implied = implied_outputs(model, trace, plan)
    if not implied:
        return plan
    recipe = source.roles[Role.INPUT]
    modules = dict(model.named_modules())
    layers = {lp.fqn: lp for lp in plan.layers}
    for fqn, why in implied.items():
        prov = {}
        for (role, field), fp in source.provenance.items():
            if role is Role.INPUT:
                prov[(Role.OUTPUT, field)] = FieldProvenance(fp.value, Origin(why, fp.set_by.span),
                                                             (fp.set_by, *fp.via))
        lp = layers.get(fqn)
        if lp is None:
            lp = LayerPlan(fqn, type(modules[fqn]).__name__, {Role.OUTPUT: recipe}, provenance=prov)
        else:
            lp = attrs.evolve(lp, roles={**lp.roles, Role.OUTPUT: recipe}, provenance={**lp.provenance, **prov})
        layers[fqn] = lp
    return attrs.evolve(plan, layers=tuple(layers.values()))

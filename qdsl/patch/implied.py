"""Implied quantizers: integer adds, concats and lookup tables need no hand-written rule.

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
concat (the construct table's ``add``/``concat`` rows), and each average pool reading a sum
(through ReLU and other pass-through ops: a ResNet-50's last block), an operand is fine when it is a
weighted layer's or BatchNorm's direct result read by an add or pool (the exporter adds the
accumulator; a concat reads int8 values only: a U-Net's ConvTranspose up step) or
already quantized (an output quantizer on the module returning it, or, except after a
max pool or of a sum, an integer input quantizer of a layer reading it: the exporter then materializes
the value at that grid and the add reads it, as for the digits ResNet's stem).  A sum a binary
input reads (xnor-binary on MobileNetV2) is quantized too: the graph binarizes int8, not a sum
(nor a lookup table's or an average pool's result).  An elementwise activation that lowers to a
lookup table (Hardswish, SiLU, Sigmoid...: the construct table's ``lut`` rows) indexes 8-bit
codes, so the value it reads gets one unless a layer's integer input already materializes it
(MobileNetV3's BN -> Hardswish: "implied by hardswish 'features.0.2'"), and so does a table's
result an average pool reads (EfficientNet's squeeze-excitation).  A LayerNorm's result an add
reads gets none: the exporter keeps it wide (LAYERNORM's I32 output; post-norm blocks).  An implied
quantizer goes on the outermost module that returns the value (the value has a reader
outside it) and is called once per forward; a value no such module returns (a model
input, a bare function's result at the top level) gets none, and export still names it.
The implied recipe is the spec's default input when that is an integer format.  When it
is not (xnor-binary: an integer add cannot read a binary value), it is the first integer
activation quantizer the plan already uses (module order: an input or output a rule set,
e.g. the 8-bit first layer's input or a ``type:BasicBlock`` output); a plan with none
implies nothing, and export names the value.

A product of two activations (MUL: squeeze-excitation's ``scale * x``) multiplies 8-bit
codes, so each operand gets one unless it is already quantized, a layer's accumulator too
("implied by mul in 'se'"); a product's or table's result is never taken as materialized
at a reader's integer input grid (the exporter's add reads only a pending accumulator).

A product of two activations (MATMUL: attention's ``q @ kᵀ``, ``p @ v``) likewise gets an
output quantizer on each operand's module, found through the transposes and reshapes
between them ("implied by matmul in 'attn'").  Softmax and LayerNorm read 8-bit codes as
tables do; when no module returns the value they read (the scores ``q @ kᵀ / sqrt(d)``, a
residual sum inside a block), the ``nn.Softmax``/``nn.LayerNorm`` module gets an input
quantizer instead ("implied by softmax 'attn.softmax'").
"""

from __future__ import annotations

import attrs
import torch.fx
from torch import nn

from qdsl.patch.constructs import functions, methods, module_classes, module_construct
from qdsl.patch.example_trace import tensor_constant
from qdsl.patch.trace import ModelTrace
from qdsl.patch.unplaced import Unplaced, unplaced
from qdsl.resolve.plan import FieldProvenance, LayerPlan, Origin, Plan
from qdsl.spec.model import Role

__all__ = ["ImpliedOperands", "analyse_operands", "implied_outputs", "view_source", "with_implied"]

_INTEGER_OPS = ("add", "concat")
_FUNCS = functions(lambda c: c.lowering in _INTEGER_OPS)
_METHODS = methods(lambda c: c.lowering in _INTEGER_OPS)
# average pools take a layer's accumulator (through ReLU) but not an unquantized sum
_POOL_MODULES = module_classes(lambda c: c.lowering == "pool" and c.op in ("avg_pool", "global_avg_pool"))
_POOL_FUNCS = functions(lambda c: c.lowering == "pool" and c.op in ("avg_pool", "global_avg_pool"))
# elementwise lookup tables, softmax and LayerNorm read 8-bit codes: neither a sum nor an accumulator will do
_CODE_READERS = ("lut", "softmax", "layer_norm")
_LUT_FUNCS = functions(lambda c: c.lowering in _CODE_READERS)
# MATMUL multiplies two 8-bit codes, read through transposes and reshapes (views)
_MATMUL_FUNCS = functions(lambda c: c.lowering == "matmul")
_MATMUL_METHODS = methods(lambda c: c.lowering == "matmul")
_VIEW_FUNCS = functions(lambda c: c.lowering in ("transpose", "reshape"))
_VIEW_METHODS = methods(lambda c: c.lowering in ("transpose", "reshape", "pass"))
# MUL multiplies two 8-bit codes: both operands need a quantizer, an accumulator too
_MUL_FUNCS = functions(lambda c: c.lowering == "mul")
_MUL_METHODS = methods(lambda c: c.lowering == "mul")
# size queries and indexing into them: a product of these is shape arithmetic
_SHAPE_FUNCS = functions(lambda c: c.lowering in ("shape", "item"))
_SHAPE_METHODS = methods(lambda c: c.lowering == "shape")
_PASS_MODULES = module_classes(lambda c: c.passes)
_PASS_FUNCS = functions(lambda c: c.passes)
_ALL_FUNCS = functions()
_ALL_METHODS = methods()
# ReLU and clamps fold into a pending accumulator's output stage; Identity/Dropout vanish
_CLAMPS = ("relu", "relu6", "hardtanh", "pass")
_CLAMP_MODULES = module_classes(lambda c: c.lowering in _CLAMPS)
_CLAMP_FUNCS = functions(lambda c: c.lowering in _CLAMPS)
_CLAMP_METHODS = methods(lambda c: c.lowering in _CLAMPS)
# a direct result of these is an accumulator the exporter adds (or rescales) exactly
_ACCUMULATORS = (nn.Conv1d, nn.Conv2d, nn.Linear, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.BatchNorm1d,
                 nn.BatchNorm2d)


def _stack(n: torch.fx.Node) -> list[str]:
    # fx keys the second and later calls of one module "<fqn>@<k>": it is the same module
    # (counted in trace.calls under its fqn)
    return [k.split("@", 1)[0] for k in n.meta.get("nn_module_stack", {})]


def _operands(n: torch.fx.Node) -> list[torch.fx.Node]:
    args = n.args[0] if _FUNCS.get(n.target) is not None and isinstance(n.args[0], (list, tuple)) else n.args
    return [a for a in args if isinstance(a, torch.fx.Node)]


def _is_pool(n: torch.fx.Node, modules: dict) -> bool:
    if n.op == "call_module":
        return isinstance(modules.get(str(n.target)), _POOL_MODULES)
    return n.op == "call_function" and n.target in _POOL_FUNCS


def _passes(n: torch.fx.Node, modules: dict) -> bool:
    return (n.op == "call_module" and isinstance(modules.get(str(n.target)), _PASS_MODULES)
            or n.op == "call_function" and n.target in _PASS_FUNCS)


def _lut_op(n: torch.fx.Node, modules: dict) -> str | None:
    """The profile op name (``hardswish``, ...) of an elementwise function export lowers to a table."""
    if n.op == "call_module":
        c = module_construct(modules.get(str(n.target)))
        return c.op if c is not None and c.lowering in _CODE_READERS else None
    if n.op == "call_function":
        c = _LUT_FUNCS.get(n.target)
        return c.op if c is not None else None
    return None


def _is_matmul(n: torch.fx.Node) -> bool:
    return (n.op == "call_function" and n.target in _MATMUL_FUNCS
            or n.op == "call_method" and n.target in _MATMUL_METHODS)


def view_source(a: torch.fx.Node) -> torch.fx.Node:
    """The value a chain of transposes/reshapes reads (``k.view(..).transpose(1, 2)`` -> ``k``)."""
    while (isinstance(a, torch.fx.Node) and a.args and isinstance(a.args[0], torch.fx.Node)
           and (a.op == "call_method" and a.target in _VIEW_METHODS
                or a.op == "call_function" and a.target in _VIEW_FUNCS)):
        a = a.args[0]
    return a


def _is_mul(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target in _MUL_FUNCS or n.op == "call_method" and n.target in _MUL_METHODS


def _mul_operands(n: torch.fx.Node) -> list[torch.fx.Node]:
    """The two activations a product reads; none for a constant factor or shape arithmetic."""
    args = [a for a in n.args if isinstance(a, torch.fx.Node)]
    shape = any(a.op == "call_function" and a.target in _SHAPE_FUNCS
                or a.op == "call_method" and a.target in _SHAPE_METHODS for a in args)
    return args if len(args) == 2 and not shape else []


def _sum_behind(a, modules: dict) -> bool:
    """Whether ``a`` is an add's or concat's result, seen through pass-through ops (ReLU, ...)."""
    return _behind(a, modules, lambda n: n.op == "call_function" and n.target in _FUNCS
                   or n.op == "call_method" and n.target in _METHODS)


def _behind(a, modules: dict, pred) -> bool:
    """Whether ``pred`` holds for ``a`` or for what it passes through (ReLU, Dropout, ...)."""
    while isinstance(a, torch.fx.Node):
        if pred(a):
            return True
        if not _passes(a, modules) or not a.args:
            return False
        a = a.args[0]
    return False


def _read_by_int_input(a: torch.fx.Node, modules: dict, int_inputs: set[str]) -> bool:
    """The exporter materializes a layer's (activated) result at the grid of an integer input quantizer that
    reads it and the add then reads that value (digits ResNet's stem); not through a max pool."""
    if a.op == "call_module" and isinstance(modules.get(str(a.target)), (nn.MaxPool1d, nn.MaxPool2d)):
        return False
    if _sum_behind(a, modules):  # a sum (or ReLU of one) is not materialized that way
        return False
    # nor a table's or a product's result: no accumulator, the add cannot read it pending
    # (EfficientNet's stem SiLU read by the first block's conv and its residual add)
    if _behind(a, modules, lambda m: _lut_op(m, modules) is not None or _is_mul(m)):
        return False
    return any(u.op == "call_module" and str(u.target) in int_inputs for u in a.users)


def _imply(a: torch.fx.Node, why: str, trace: ModelTrace, quantized_out: set[str], found: dict[str, str],
          modules: dict | None = None) -> bool:
    """An output quantizer on the outermost module returning ``a`` (called once per forward).
    With ``modules``, a value no module returns (``torch.relu`` at the top level) passes the
    quantizer back to the module whose result it passes through: the graph clamps the codes.
    False when no module can carry it (:mod:`qdsl.patch.unplaced`)."""
    stack = _stack(a)
    returned_by = [m for m in stack if any(m not in _stack(u) for u in a.users)]
    if any(m in quantized_out for m in returned_by):
        return True
    owner = next((m for m in returned_by if trace.calls.get(m, 1) == 1), None)
    if owner is not None:
        found.setdefault(owner, why)
        return True
    if modules is not None and _passes(a, modules) and a.args and isinstance(a.args[0], torch.fx.Node):
        return _imply(a.args[0], why, trace, quantized_out, found, modules)
    return False


def _refused_itself(a: torch.fx.Node) -> bool:
    """A function or method export has no lowering for (``y * 2``, ``torch.softmax``): it refuses
    the model there, before any reader (lint's W321 for the construct names it)."""
    if a.op == "call_function":
        c = _ALL_FUNCS.get(a.target)
    elif a.op == "call_method":
        c = _ALL_METHODS.get(a.target)
    else:
        return False
    if c is None or c.lowering is None or (c.lowering == "mul" and not _mul_operands(a)):
        return True
    # a product with a parameter (``x @ self.k.weight``): export refuses the attribute read
    return c.lowering == "matmul" and any(isinstance(x, torch.fx.Node) and x.op == "get_attr" for x in a.args[:2])


def _layer_norm_result(a, modules: dict) -> bool:
    """A LayerNorm's result, seen through Dropout/Identity: a residual add reads it wide (post-norm
    blocks: ``norm2(x + ff(x))`` with ``x = norm1(...)``; lower_attn.layernorm_pending)."""
    while isinstance(a, torch.fx.Node) and a.op == "call_module":
        m = modules.get(str(a.target))
        if isinstance(m, nn.LayerNorm):
            return True
        c = module_construct(m)
        if c is None or c.lowering != "pass" or not a.args:
            return False
        a = a.args[0]
    return False


def _clamped_accumulator(a, modules: dict) -> bool:
    """A layer's accumulator seen through ReLU/clamps and no-ops: an add (or pool) reads it pending."""
    while isinstance(a, torch.fx.Node):
        if a.op == "call_module" and isinstance(modules.get(str(a.target)), _ACCUMULATORS):
            return True
        if not (a.op == "call_module" and isinstance(modules.get(str(a.target)), _CLAMP_MODULES)
                or a.op == "call_function" and a.target in _CLAMP_FUNCS
                or a.op == "call_method" and a.target in _CLAMP_METHODS) or not a.args:
            return False
        a = a.args[0]
    return False


@attrs.frozen
class ImpliedOperands:
    """What the operands of the model's integer ops need (see the module docstring)."""

    outputs: dict[str, str]
    """``{module fqn: "implied by <op> in '<where>'"}``: the implied output quantizers."""
    unplaced: tuple[Unplaced, ...] = ()
    """Operands that need one no module can carry (:mod:`qdsl.patch.unplaced`), in graph order:
    export refuses the model at the first."""
    inputs: dict[str, str] = attrs.field(factory=dict)
    """``{module fqn: why}``: the softmax and LayerNorm modules whose (unquantized) input no
    module returns, quantized at their own input instead (the scores ``q @ kᵀ / sqrt(d)``, a
    residual sum)."""


def implied_outputs(model: nn.Module, trace: ModelTrace, plan: Plan) -> dict[str, str]:
    """``{module fqn: "implied by <op> in '<where>'"}`` for the values integer adds and concats
    read that the plan leaves unquantized (see the module docstring)."""
    return analyse_operands(model, trace, plan).outputs


def _constant(a: torch.fx.Node, depth: int = 0) -> bool:
    """A value computed from constants only (example_trace's ``tensor_constant``: BERT's
    position ids at the exported length) - the lookup it feeds folds to a constant."""
    if a.op == "call_function" and a.target is tensor_constant:
        return True
    args = [x for x in a.all_input_nodes]
    return depth < 16 and a.op in ("call_module", "call_function", "call_method") and bool(args) and all(
        _constant(x, depth + 1) for x in args)


def _offset(a: torch.fx.Node) -> bool:
    """``x + constant`` (the word embedding plus the token-type embedding)."""
    add = (a.op == "call_function" and a.target in _FUNCS and _FUNCS[a.target].lowering == "add") or (
        a.op == "call_method" and a.target in _METHODS)
    return add and any(_constant(x) for x in a.all_input_nodes)


def analyse_operands(model: nn.Module, trace: ModelTrace, plan: Plan) -> ImpliedOperands:
    """The implied output quantizers and the operands no module can carry one for."""
    if trace.graph is None:
        return ImpliedOperands({})
    modules = dict(model.named_modules())
    int_inputs = {lp.fqn for lp in plan.layers if lp.quantized and (r := lp.roles.get(Role.INPUT)) is not None
                  and r.format.activation_lowering(r.signed) == "int"}
    quantized_out = {lp.fqn for lp in plan.layers if lp.quantized and lp.roles.get(Role.OUTPUT) is not None}
    bin_inputs = {lp.fqn for lp in plan.layers if lp.quantized and (r := lp.roles.get(Role.INPUT)) is not None
                  and not _is_int(r)}
    found: dict[str, str] = {}
    missing: list[Unplaced] = []
    inputs: dict[str, str] = {}

    def from_input(a) -> bool:  # the graph's QUANTIZE of the model input feeds it (through max pool, ...)
        return "" in int_inputs and _behind(a, modules, lambda m: m.op == "placeholder")

    def norm_input(a) -> bool:
        # a pre-norm block's sum x + attn(norm1(x)), quantized as a LayerNorm's input (a rule's or
        # implied): the exporter's next residual add reads it at that grid (lower_layers.add_pending)
        return _sum_behind(a, modules) and any(
            u.op == "call_module" and isinstance(modules.get(str(u.target)), nn.LayerNorm)
            and (str(u.target) in int_inputs or str(u.target) in inputs) for u in a.users)

    def imply(op: str, where: str, a, why: str, pass_back: bool, readable=lambda a: False) -> None:
        if a.op == "get_attr" or _refused_itself(a):  # export stops at the value's own op first
            return
        if any(m in int_inputs and m not in _stack(a) for m in _stack(n)):
            # the value enters a module with an integer input quantizer around the op: export
            # reads it quantized when it is that module's input (not decided here: no refusal)
            return
        if not _imply(a, why, trace, quantized_out, found, modules if pass_back else None) \
                and not from_input(a) and not readable(a):
            missing.append(unplaced(op, where, a, trace.calls))

    for n in trace.graph.nodes:
        # BINARIZE reads int8 or a layer's accumulator, not a sum, a table's or a pool's result
        if n.op == "call_module" and str(n.target) in bin_inputs and n.args and isinstance(n.args[0], torch.fx.Node):
            if _behind(n.args[0], modules, lambda m: _sum_behind(m, modules) or _lut_op(m, modules) is not None
                       or _is_pool(m, modules) or _is_mul(m)):
                _imply(n.args[0], f"implied by the binary input of '{n.target}'", trace, quantized_out, found)
        if n.op == "call_function" and n.target in _FUNCS:
            op = "torch.cat" if _FUNCS[n.target].lowering == "concat" else "add"
        elif n.op == "call_method" and n.target in _METHODS:
            op = n.target  # add, add_
        elif _is_matmul(n):
            where = (_stack(n) or [""])[-1]
            for a in [x for x in n.args[:2] if isinstance(x, torch.fx.Node)]:
                imply("matmul", where, view_source(a), f"implied by matmul in '{where or '<model>'}'", True)
            continue
        elif _is_mul(n):
            where = (_stack(n) or [""])[-1]
            for a in _mul_operands(n):  # not even a layer's accumulator: MUL reads 8-bit codes
                imply("mul", where, a, f"implied by mul in '{where or '<model>'}'", True)
            continue
        elif _is_pool(n, modules):
            op = "average pool"
            # a pool reads a layer's accumulator, not a sum nor a table's or product's (unquantized) result
            if not (_sum_behind(n.args[0], modules)
                    or _behind(n.args[0], modules, lambda m: _lut_op(m, modules) or _is_mul(m))):
                continue
        elif (lut := _lut_op(n, modules)) is not None:
            a = n.args[0] if n.args else None
            if isinstance(a, torch.fx.Node) and not _read_by_int_input(a, modules, int_inputs):
                where = f"'{n.target}'" if n.op == "call_module" else f"in '{(_stack(n) or ['<model>'])[-1]}'"
                why = f"implied by {lut} {where}"
                m = modules.get(str(n.target)) if n.op == "call_module" else None
                if lut in ("softmax", "layer_norm") and m is not None and not _has_input(plan, str(n.target)):
                    # no module returns the value: the nn.Softmax/nn.LayerNorm quantizes its own input
                    if not _imply(a, why, trace, quantized_out, found, modules):
                        inputs.setdefault(str(n.target), why)
                else:
                    imply(lut, (_stack(n) or [""])[-1], a, why, True)
            continue
        else:
            continue
        if op.startswith("add") and any(_constant(a) or _offset(a) for a in _operands(n)):
            continue  # a constant added to an activation (export: quantized + constant, read by a LayerNorm)
        where = (_stack(n) or [""])[-1]
        for a in _operands(n)[:1] if op == "average pool" else _operands(n):
            # an add or pool reads a layer's accumulator; CONCAT reads int8 values only
            if op != "torch.cat" and a.op == "call_module" and isinstance(modules.get(str(a.target)), _ACCUMULATORS):
                continue
            if op.startswith("add") and _layer_norm_result(a, modules):
                continue  # the exporter keeps a LayerNorm's result wide (LAYERNORM's I32 output) for the add
            if _read_by_int_input(a, modules, int_inputs):
                continue
            # what the op reads without a quantizer: an add a (clamped) accumulator, a concat any
            # pending result (it lands on the concat's own grid), but neither a float input
            readable = (lambda a: not _behind(a, modules, lambda m: m.op == "placeholder")) if op == "torch.cat" \
                else (lambda a: False) if op == "average pool" \
                else (lambda a: _clamped_accumulator(a, modules) or norm_input(a))
            imply(op.rstrip("_"), where, a, f"implied by {op} in '{where or '<model>'}'", False, readable)
    return ImpliedOperands(found, tuple(missing), inputs)


def _has_input(plan: Plan, fqn: str) -> bool:
    return any(lp.fqn == fqn and lp.quantized and lp.roles.get(Role.INPUT) is not None for lp in plan.layers)


def _is_int(recipe) -> bool:
    return recipe is not None and recipe.format.activation_lowering(recipe.signed) == "int"


def _implied_source(plan: Plan) -> tuple[LayerPlan, Role] | None:
    """The layer and role whose recipe (and provenance) implied quantizers copy (module doc)."""
    for lp in plan.layers:
        r = lp.roles.get(Role.INPUT)
        p = lp.provenance.get((Role.INPUT, "kind"))
        if r is not None and p is not None and p.set_by.label == "defaults":
            if _is_int(r):
                return lp, Role.INPUT
            break
    # a binary (or absent) default: the first integer activation quantizer a rule set
    for lp in plan.layers:
        if lp.quantized:
            for role in (Role.INPUT, Role.OUTPUT):
                if _is_int(lp.roles.get(role)):
                    return lp, role
    return None


def with_implied(model: nn.Module, trace: ModelTrace, plan: Plan) -> Plan:
    """``plan`` with the implied output quantizers of :func:`implied_outputs` added (the recipe
    of :func:`_implied_source`, with its provenance relabelled "implied by ...")."""
    found = _implied_source(plan)
    if found is None:
        return plan
    source, source_role = found
    ops = analyse_operands(model, trace, plan)
    implied, inputs = ops.outputs, ops.inputs
    if not implied and not inputs:
        return plan
    recipe = source.roles[source_role]
    modules = dict(model.named_modules())
    layers = {lp.fqn: lp for lp in plan.layers}
    for new_role, table in ((Role.OUTPUT, implied), (Role.INPUT, inputs)):
        for fqn, why in table.items():
            prov = {}
            for (role, field), fp in source.provenance.items():
                if role is source_role:
                    prov[(new_role, field)] = FieldProvenance(fp.value, Origin(why, fp.set_by.span),
                                                              (fp.set_by, *fp.via))
            lp = layers.get(fqn)
            if lp is None:
                lp = LayerPlan(fqn, type(modules[fqn]).__name__, {new_role: recipe}, provenance=prov)
            else:
                lp = attrs.evolve(lp, roles={**lp.roles, new_role: recipe}, provenance={**lp.provenance, **prov})
            layers[fqn] = lp
    return attrs.evolve(plan, layers=tuple(layers.values()))

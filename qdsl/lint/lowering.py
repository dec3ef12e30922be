"""Ops the model runs that export has no integer lowering for (W321), found from the traced graph.

Export lowers each traced module, function and method by its row of the one construct table
(:mod:`qdsl.graph.catalog`); a row without a ``lowering`` (``operator.mul`` of two
activations, ``nn.Softmax``) or a ``torch.nn`` class outside the table (``nn.ConvTranspose2d``)
makes ``qdsl.export`` refuse the model.  Lint reads the same rows through
:class:`~qdsl.lint.graph.ModelGraph`, so what it reports here is what export would refuse,
before any calibration.  Independent of the profile (the graph cannot hold the op whatever
the target), and a warning: the model still trains and fake-quantizes.  One finding per op
name, located at its first place in the model, with every place listed.

A weighted layer with a binary (±1) weight or input lowers only where the catalogue names
its binary form (:data:`~qdsl.graph.catalog.BINARY_FORMS`: ``BCONV2D`` for ``conv2d``,
``CONV_TRANSPOSE2D`` on the BIN input for ``conv_transpose2d``): with the plan, a binary
layer of an op without one is a W321 too; and a ``dynamic``
quantizer anywhere but a Linear's input (QUANTIZE_DYNAMIC + LINEAR_DYNAMIC) or an nn.LSTM's
input and hidden state (LSTM_DYNAMIC) is one too.

So is a quantized activation whose number format has no graph tensor type
(``activation_lowering`` None: a minifloat such as ``fp8_e4m3``, ternary, unsigned binary),
named ``<layer>:<role>`` as export names it.

So is an operand of an integer op (a product, an add, a lookup table...) that needs a
quantizer no module can carry (``y * torch.sigmoid(y)``): ``qdsl.patch.implied`` finds these
while placing implied quantizers, and export refuses the model with the same record
(:mod:`qdsl.patch.unplaced`); lint reports each one where export names it, with its words.
"""

from __future__ import annotations

from qdsl.graph.catalog import BINARY_FORMS, LOWERINGS
from qdsl.lint.graph import ModelGraph
from qdsl.lint.ops import WEIGHTED_OPS, module_op
from qdsl.resolve.plan import Plan
from qdsl.spec.diagnostics import Diagnostic, Span
from qdsl.spec.model import Role

__all__ = ["lowering_findings"]


def _binary(layer, role: Role) -> bool:
    r = layer.roles.get(role)
    return r is not None and r.format.activation_lowering(r.signed) == "bin"


def lowering_findings(graph: ModelGraph, model_label: str = "<model>", plan: Plan | None = None,
                      unplaced: tuple = ()) -> list[Diagnostic]:
    where: dict[str, list[str]] = {}
    for node in graph.nodes:
        if graph.traced and not node.lowered:
            where.setdefault(node.op or node.construct, []).append(node.label)
    for layer in plan.layers if plan is not None else ():
        op = module_op(layer.type_name)
        if (op in WEIGHTED_OPS and layer.quantized and op not in BINARY_FORMS
                and (_binary(layer, Role.WEIGHT) or _binary(layer, Role.INPUT))):
            where.setdefault(f"binary {op}", []).append(layer.fqn)
        # a dynamic (run-time scale) quantizer lowers only as a Linear's input (LINEAR_DYNAMIC)
        # and as an nn.LSTM's / nn.GRU's input and hidden state (LSTM_DYNAMIC, GRU_DYNAMIC)
        for role, r in layer.roles.items():
            lstm = role in (Role.INPUT, Role.HIDDEN) and f"{layer.type_name.upper()}_DYNAMIC" in LOWERINGS[
                "recurrent"] and layer.type_name in ("LSTM", "GRU")
            if r is not None and not role.is_param and r.format.quantized and r.format.activation_lowering(
                    r.signed) is None:
                # an activation format the graph has no tensor type for (minifloat, ternary): export
                # refuses at the quantizer ('<layer>:<role>'), whatever the op
                where.setdefault(f"{r.format.name} {role.value} activation", []).append(f"{layer.fqn}:{role.value}")
            if r is not None and r.dynamic and not lstm and (
                    role is not Role.INPUT or "LINEAR_DYNAMIC" not in LOWERINGS["layer"] or op != "linear"):
                where.setdefault(f"dynamic {role.value} of {op or layer.type_name}", []).append(layer.fqn)
    out = []
    for op, labels in where.items():
        shown = ", ".join(labels[:4]) + (f" and {len(labels) - 4} more" if len(labels) > 4 else "")
        out.append(Diagnostic.warning(
            "W321", f"'{op}' has no integer lowering: qdsl.export refuses this model ({shown})",
            Span(model_label, path=labels[0]),
            "the model still trains and fake-quantizes; to export, replace the construct with one the graph "
            "has (README: when an op is missing)"))
    for u in unplaced:  # qdsl.patch.unplaced.Unplaced: export raises E402 with this message and hint
        out.append(Diagnostic.warning("W321", f"qdsl.export refuses this model: {u.message} ({u.label})",
                                      Span(model_label, path=u.label), u.hint))
    return out

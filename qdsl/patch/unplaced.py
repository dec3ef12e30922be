"""Operands of an integer op that need a quantizer no module can carry: export refuses them.

:mod:`qdsl.patch.implied` gives an unquantized operand of an integer op (MUL, ADD, CONCAT,
an average pool, a lookup table) an output quantizer on the module that returns it.  qdsl
quantizes with hooks on an unmodified model, so a value no module returns once per forward
has nowhere to carry one: a bare function's result in the forward that computes the op
(``y * torch.sigmoid(y)``, ``a + b + c``), the model input, the output of a module called
more than once.  When the op cannot read the value unquantized either (which forms each op
reads: docs/qgraph.md; an add also takes a layer's accumulator, a concat any pending result),
the model cannot be exported.

The walk that places implied quantizers (:func:`qdsl.patch.implied.analyse_operands`)
decides this, once, and returns one :class:`Unplaced` record per such operand.
``qdsl.export`` runs it on the eval-mode trace of the model it lowers and refuses the model
with the first record's message and hint; ``qdsl lint --model`` runs it on the resolved
plan and the same eval-mode trace and reports each record as W321 at the same place, with
the same words, before any calibration.
"""

from __future__ import annotations

import operator

import attrs
import torch.fx

from qdsl.graph.catalog import CONSTRUCTS
from qdsl.patch.constructs import functions

__all__ = ["Unplaced", "unplaced"]

_FUNCTIONS = functions()
# a function's module form, by profile op (torch.sigmoid -> nn.Sigmoid): what the hint suggests
_MODULE_FORM = {}
for _c in CONSTRUCTS:
    if _c.kind == "module" and _c.lowering is not None and _c.op is not None:
        _MODULE_FORM.setdefault(_c.op, _c.name)
_SYMBOLS = {operator.add: "+", operator.iadd: "+=", operator.mul: "*", operator.imul: "*="}
_READERS = {"mul": "the product of two activations", "add": "the residual add", "torch.cat": "torch.cat",
            "average pool": "the average pool"}


@attrs.frozen
class Unplaced:
    """An operand of an integer op that no quantizer can be placed on (module doc)."""

    op: str
    """The reading op as :mod:`qdsl.patch.implied` names it: ``mul``, ``add``, ``torch.cat``,
    ``average pool``, or a table's op (``sigmoid``)."""
    where: str
    """The module the op runs in (``""``: the model's top level): where export stops."""
    value: str
    """What the operand is, in words (``the result of torch.sigmoid``)."""
    hint: str
    value_at: str | None = None
    """The module a function's result was computed in, when not ``where`` (``""``: the top level)."""

    @property
    def label(self) -> str:
        """``op in place``, as lint lists places."""
        return f"{self.op} in {self.where or '<model>'}"

    @property
    def message(self) -> str:
        reader = _READERS.get(self.op, f"{self.op} (a lookup table over 8-bit codes)")
        value = self.value if self.value_at is None else f"{self.value}{_place(self.value_at)}"
        return (f"{reader}{_place(self.where)} reads {value}, which needs a quantizer, and no module returns that "
                "value once per forward to carry one")


def _place(fqn: str) -> str:
    return f" in '{fqn}'" if fqn else " at the model's top level"


def _scope(n: torch.fx.Node) -> str:
    stack = [k.split("@", 1)[0] for k in n.meta.get("nn_module_stack", {})]
    return stack[-1] if stack else ""


def _function_name(n: torch.fx.Node) -> str:
    if n.op == "call_method":
        return f".{n.target}()"
    if n.target in _SYMBOLS:
        return f"'{_SYMBOLS[n.target]}'"
    c = _FUNCTIONS.get(n.target)
    path = c.path if c is not None else getattr(n.target, "__name__", str(n.target))
    return path.replace("torch.nn.functional.", "F.")


def unplaced(op: str, where: str, a: torch.fx.Node, calls: dict[str, int]) -> Unplaced:
    """The record for operand ``a`` of ``op`` (in module ``where``) that no module carries a
    quantizer for: what it is and the change that lets the plan quantize it."""
    if a.op == "placeholder":
        return Unplaced(op, where, "the model input",
                        "quantizers sit on a module's input or output: compute the operand with a layer, or do the "
                        "op inside a module whose input quantizer then applies to it")
    if a.op == "call_module":
        fqn = str(a.target)
        k = calls.get(fqn, 1)
        return Unplaced(op, where, f"the output of '{fqn}', called {k} times per forward",
                        f"add `output = a8` for '{fqn}' in the spec (one quantizer then serves every call), "
                        "or use one module instance per call")
    name = _function_name(a)
    scope = _scope(a)
    value = f"the result of {name}"
    c = _FUNCTIONS.get(a.target) if a.op == "call_function" else None
    if op.startswith("softmax") and scope:
        # the scores of an attention computed in a function (Hugging Face's eager attention)
        return Unplaced(op, where, value,
                        f"give '{scope}' the softmax roles (qdsl/patch/softmax_roles.py): "
                        f"rule {scope} {{ scores = a8  probs = a8 }}", None if scope == where else scope)
    form = _MODULE_FORM.get(c.op) if c is not None and c.lowering == "lut" else None
    if form is not None:
        hint = (f"a function's result has no module to carry a quantizer: compute it with a module "
                f"(e.g. nn.{form}() instead of {name}) so the plan can quantize it")
    else:
        hint = (f"a function's result has no module to carry a quantizer: compute the {name} inside a small "
                "module (its output then gets a quantizer)")
    return Unplaced(op, where, value, hint, None if scope == where else scope)

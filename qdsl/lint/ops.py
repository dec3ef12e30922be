"""The op vocabulary profiles speak, and how torch modules and functions map onto it.

Profiles name op types (``conv2d``, ``add``, ``relu``...), not torch classes, so one
profile serves any model.  :data:`KNOWN_OPS` is the closed vocabulary the profile loader
accepts; :func:`module_op` and :func:`function_op` map a module class name or a traced
function/method to an op, or to ``None`` for things that compute nothing on the target
(``Identity``, ``Dropout`` in eval, shape queries).  Torch-free: names only.

The vocabulary and the mapping are read from :mod:`qdsl.graph.catalog`, the table
export lowers from, so lint and export cannot disagree about what a construct is.
"""

from __future__ import annotations

from qdsl.graph.catalog import CONSTRUCTS, LINT_ONLY_OPS, OPS, WEIGHTED_OPS, short_name

__all__ = [
    "KNOWN_OPS",
    "LINT_ONLY_OPS",
    "WEIGHTED_OPS",
    "NO_OP",
    "module_op",
    "function_op",
    "method_op",
    "module_lowered",
    "module_lowering",
    "function_lowering",
]

KNOWN_OPS = OPS
"""Every op name a profile may list (in ``ops``, ``op.<name>``, ``fusions``, ``fixed_output``).

Some are lint-only (:data:`LINT_ONLY_OPS`): lint checks them against a profile, but export
has no integer lowering for them."""

NO_OP = None
"""What :func:`module_op` returns for modules that vanish on the target."""

# by name, from the one construct table (qdsl/graph/catalog.py): lint also maps the
# torch-free ModelIndex, which has class names only
_MODULES = {c.name: c.op for c in CONSTRUCTS if c.kind == "module"}
# fx call_function / call_method targets, by ``__name__`` (operator.add, torch.add and
# F.relu all carry one) or method name; lint treats both alike
_FUNCTIONS = {n: c.op for c in CONSTRUCTS if c.kind != "module" for n in (c.name, short_name(c.name))}
# the same rows' export lowering (None: export refuses the construct)
_MODULE_LOWERING = {c.name: c.lowering for c in CONSTRUCTS if c.kind == "module"}
_FUNCTION_LOWERING: dict[str, str | None] = {}
for _c in CONSTRUCTS:
    if _c.kind != "module":
        for _n in (_c.name, short_name(_c.name)):
            # one name, several rows (torch.relu and F.relu): lowered when any row is
            _FUNCTION_LOWERING[_n] = _FUNCTION_LOWERING.get(_n) or _c.lowering


def module_op(type_name: str) -> str | None:
    """The op a leaf module of class ``type_name`` runs as; unknown classes map to their
    lower-cased name (so a profile that restricts ops reports them)."""
    if type_name in _MODULES:
        return _MODULES[type_name]
    return type_name.lower()


def function_op(name: str) -> str | None:
    """The op of a traced function call (``operator.add`` -> ``add``), by function name."""
    if name in _FUNCTIONS:
        return _FUNCTIONS[name]
    return name


def method_op(name: str) -> str | None:
    """The op of a traced tensor method call (``x.view(...)`` -> ``reshape``)."""
    return function_op(name)


def module_lowering(type_name: str) -> str | None:
    """Export's rule name for a leaf module of class ``type_name`` (None: no lowering)."""
    return _MODULE_LOWERING.get(type_name)


def module_lowered(type_name: str) -> bool:
    """Whether export lowers a leaf module of class ``type_name`` (a class outside the
    construct table, ``nn.ConvTranspose2d``, has no lowering)."""
    return _MODULE_LOWERING.get(type_name) is not None


def function_lowering(name: str) -> str | None:
    """Export's lowering rule for a traced function or method call named ``name`` (``None``:
    export refuses it; ``item``, ``operator.getitem``, only on a shape, not on a tensor)."""
    return _FUNCTION_LOWERING.get(name)

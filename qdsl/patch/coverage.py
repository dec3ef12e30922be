"""What the spec reaches but ``apply`` leaves in float, and modules whose observer is shared.

The promise is "every rule takes effect or is an error".  Some modules and ops are
reached by a spec and still cannot be quantized by qdsl's hooks; :func:`check_coverage`
lists them so ``apply`` can warn (:class:`LeftFloatWarning`, ``W505``) or, with
``strict=True``, refuse (:class:`LeftFloatError`, ``E505``) before touching the model.
``qdsl check --model`` and ``qdsl explain`` print the same list.

Left float (one finding each, named, with the reason and the spec line that reaches it):

* a module holding a weight kernel (a parameter of 2+ dimensions: ``nn.Embedding``'s ``weight``,
  a user module's own ``nn.Parameter``)
  that gets no weight quantizer: its class is not one qdsl patches (``defaults`` apply
  to ``Linear``, ``Conv1d``, ``Conv2d``, ``ConvTranspose1d/2d`` and the recurrent layers
  ``LSTM``, ``GRU``, ``RNN`` and their cells, and ``MultiheadAttention`` by exact class name), or the forward reads the
  parameter directly;
* a planned module whose ``forward`` never runs, so its hooks never do:
  the ``out_proj`` of a ``MultiheadAttention`` the spec leaves float or skips
  (``F.multi_head_attention_forward`` reads its weight and bias directly; a patched one
  calls it as a module), or any module the fx trace never calls;
* a functional product in a forward the spec reaches: ``F.linear``, ``F.conv*``,
  ``F.conv_transpose*``, ``F.embedding``, ``torch.matmul``/``bmm``/``mm``/``einsum``/...,
  ``@`` and the ``Tensor`` methods of the same names, with parameter or activation
  operands (not a ``matmul``/``bmm``/``@`` of two modules' results, seen through transposes
  and reshapes: export lowers it to MATMUL and the plan implies the operands' quantizers).  Found in the fx trace (:mod:`qdsl.patch.trace`); when fx cannot trace the
  model they are not checked and the warning says so (``Coverage.untraced``).

"Reached" (so a spec that says nothing about a module stays quiet): a ``skip`` on the
module, or a winning rule that sets the role to ``kind = float``, means not reached;
otherwise the most specific rule matching the module that sets ``weight`` (modules) or
``weight``/``input`` (functional ops, matched on the module whose forward calls them),
else ``defaults`` when they set that role.  Parameter-free modules (ReLU, pooling) and
normalization layers (1-D affine parameters) are never listed.

Shared (``W506``, a warning even under ``strict``: the quantizers do run): a module with
an input or output quantizer called more than once per forward, whose one observer then
sees every call site and gives them one scale.  Call counts come from the fx trace (every
``module(...)`` call, containers included); when fx cannot trace the model, ``apply``
counts the calls of its ``example_input`` forward instead (:func:`count_calls`), and
without either they are not checked (said in the warning).
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from typing import Any, Iterator, Mapping

import attrs
from torch import nn

from qdsl.graph.catalog import CONSTRUCTS, short_name
from qdsl.patch.constructs import module_classes
from qdsl.patch.implied import view_source
from qdsl.patch.layer import MASTER_SUFFIX
from qdsl.patch.attention import is_attention
from qdsl.patch.recurrent import is_recurrent
from qdsl.patch.trace import ModelTrace
from qdsl.resolve.check import Body, prepare
from qdsl.resolve.plan import WEIGHTED_TYPES, LayerPlan, Plan
from qdsl.resolve.positions import positions
from qdsl.spec.diagnostics import Diagnostic, QdslWarning, Span, SpecError, UNKNOWN_SPAN
from qdsl.spec.formats import is_float
from qdsl.spec.model import Role, TargetKind

__all__ = [
    "Finding",
    "Coverage",
    "check_coverage",
    "count_calls",
    "LeftFloatWarning",
    "SharedModuleWarning",
    "LeftFloatError",
]

ROOT = "<model>"

# functional products that read a weight or multiply activations; qdsl lowers none of
# them when called as functions (fx call_function/call_method targets, by __name__):
# the construct table's ``product`` rows, and the layer classes it patches
_PRODUCTS = frozenset(short_name(c.name) for c in CONSTRUCTS if c.product)
# products of two activations export lowers (MATMUL: both operands get implied quantizers)
_ACT_PRODUCTS = frozenset(short_name(c.name) for c in CONSTRUCTS if c.product and c.lowering)
_F_NAMES = frozenset(c.name for c in CONSTRUCTS if c.product and c.path.startswith("torch.nn.functional."))
_SUPPORTED_BASES = module_classes(lambda c: c.lowering == "layer")


class LeftFloatWarning(QdslWarning):
    """``apply`` found modules or ops the spec reaches that stay float; ``.coverage`` has them."""

    def __init__(self, message: str, coverage: "Coverage"):
        super().__init__(message)
        self.coverage = coverage


class SharedModuleWarning(QdslWarning):
    """A quantized module is called from several places: one observer sees all of them."""

    def __init__(self, message: str, coverage: "Coverage"):
        super().__init__(message)
        self.coverage = coverage


class LeftFloatError(SpecError):
    """``apply(..., strict=True)`` / ``qdsl check --strict``: the spec reaches something
    that would stay float; ``.diagnostics`` lists every one (``E505``)."""


@attrs.frozen
class Finding:
    """One module or op: ``name`` (fqn, ``<model>``, or ``torch.matmul in attn``), why."""

    name: str
    reason: str
    reached_by: str
    """The source that reaches it: ``defaults weight``, ``rule type:LSTM weight``..."""
    span: Span = UNKNOWN_SPAN
    hint: str = ""

    def diagnostic(self, code: str, error: bool = False) -> Diagnostic:
        make = Diagnostic.error if error else Diagnostic.warning
        notes = (f"reached by {self.reached_by}",) if self.reached_by else ()
        return make(code, f"{self.name}: {self.reason}", self.span, *((self.hint,) if self.hint else ()),
                    notes=notes)

    def line(self) -> str:
        where = f" ({self.reached_by} at {self.span.location()})" if self.span.known else (
            f" ({self.reached_by})" if self.reached_by else "")
        return f"  {self.name}: {self.reason}{where}"


@attrs.frozen
class Coverage:
    """The result of :func:`check_coverage`."""

    floats: tuple[Finding, ...] = ()
    shared: tuple[Finding, ...] = ()
    untraced: str | None = None
    """Why functional ops (and, without example input, call counts) were not checked."""
    calls_checked: bool = True

    def diagnostics(self, strict: bool = False) -> list[Diagnostic]:
        out = [f.diagnostic("E505" if strict else "W505", strict) for f in self.floats]
        out += [f.diagnostic("W506") for f in self.shared]
        return out

    def report(self) -> str:
        """The text of the warning (also what ``qdsl check --model`` prints)."""
        parts = []
        if self.floats:
            n = len(self.floats)
            parts.append(f"{n} module{'s' if n > 1 else ''}/op{'s' if n > 1 else ''} that the spec reaches "
                         "stay in float (qdsl.apply(..., strict=True) or qdsl check --strict refuses this):")
            parts += [f.line() for f in self.floats]
        if self.untraced:
            what = "functional ops (F.linear, torch.matmul, @, ...)"
            if not self.calls_checked:
                what += " and modules called more than once"
            parts.append(f"not checked: {what}, because torch.fx could not trace the model ({self.untraced})")
        return "\n".join(parts)

    def shared_report(self) -> str:
        lines = ["modules called more than once per forward share one observer (give each call site "
                 "its own module instance for its own scale):"]
        return "\n".join(lines + [f.line() for f in self.shared])

    def error(self) -> LeftFloatError:
        return LeftFloatError(self.diagnostics(strict=True)[: len(self.floats)])

    def warn(self, stacklevel: int = 3) -> None:
        if self.floats or self.untraced:
            warnings.warn(LeftFloatWarning("qdsl: " + self.report(), self), stacklevel=stacklevel)
        if self.shared:
            warnings.warn(SharedModuleWarning("qdsl: " + self.shared_report(), self), stacklevel=stacklevel)


class _Reach:
    """Which spec source reaches a module for some roles (see the module docstring)."""

    def __init__(self, plan: Plan, registries: Any):
        self.prep = prepare(plan.spec, registries)
        self.layers: dict[str, LayerPlan] = {lp.fqn: lp for lp in plan.layers}
        # what @first / @last named when the plan was resolved (no index: they name nothing)
        pos = positions(plan.index) if plan.index is not None else None
        self.named = {w: pos.of(w) for w in ("first", "last")} if pos is not None else {}

    def source(self, fqn: str, type_name: str, roles: tuple[Role, ...]) -> tuple[str, Span] | None:
        lp = self.layers.get(fqn)
        if lp is not None and lp.skip:
            return None
        best: tuple[Any, ...] | None = None
        for body, cts in zip(self.prep.rules, self.prep.targets):
            role = next((r for r in roles if r in body.roles), None)
            if role is None:
                continue
            levels = [ct.level for ct in cts if _hits(ct, fqn, type_name, self.named)]
            if not levels:
                continue
            key = (max(levels), body.priority, body.order)
            if best is None or key > best[0]:
                best = (key, body, role)
        if best is not None:
            return _label(best[1], best[2])
        d = self.prep.defaults
        for role in roles:
            if role in d.roles:
                return _label(d, role)
        return None


def _hits(ct: Any, fqn: str, type_name: str, named: Mapping[str, str | None]) -> bool:
    kind = ct.target.kind
    if kind is TargetKind.POSITION:
        return named.get(ct.target.pattern) == fqn
    if kind is TargetKind.TYPE:
        return type_name == ct.target.pattern
    if kind is TargetKind.EXACT:
        return fqn == ct.target.pattern
    return ct.fullmatch is not None and ct.fullmatch(fqn) is not None


def _label(body: Body, role: Role) -> tuple[str, Span] | None:
    kind = body.roles[role].get("kind")
    if kind is not None and is_float(kind.value):
        return None  # the spec says float: nothing to report
    return f"{body.label} {role.value}", body.role_spans.get(role, body.span)


def _kernels(m: nn.Module) -> list[str]:
    """Names of ``m``'s own parameters with 2+ dims; a master qdsl moved aside while
    patched (``weight`` -> ``weight_float``) counts under its own name."""
    out = []
    for n, p in m._parameters.items():
        if p is not None and p.dim() >= 2:
            moved = n.endswith(MASTER_SUFFIX) and n[: -len(MASTER_SUFFIX)] not in m._parameters
            out.append(n[: -len(MASTER_SUFFIX)] if moved else n)
    return out


def _module_reason(fqn: str, m: nn.Module, kernels: list[str], parent: nn.Module | None) -> tuple[str, str]:
    """Why a module's weights stay float, and a hint."""
    t = type(m).__name__
    if isinstance(parent, nn.MultiheadAttention) and fqn.endswith("out_proj"):
        return ("out_proj is called functionally by MultiheadAttention (F.multi_head_attention_forward "
                "reads its weight and bias; its forward and hooks never run)", "")
    shown = ", ".join(kernels[:4]) + (" ..." if len(kernels) > 4 else "")
    if isinstance(m, _SUPPORTED_BASES) and not type(m).__module__.startswith("torch."):
        base = next(b.__name__ for b in _SUPPORTED_BASES if isinstance(m, b))
        return (f"{t} subclasses {base}, but defaults apply to {', '.join(WEIGHTED_TYPES)} by exact class name",
                f"add 'rule type:{t} {{ weight = ... }}' to quantize it, or 'skip' it")
    if isinstance(m, nn.Embedding):  # quantized (and exported, EMBEDDING) by a rule, not by defaults
        return ("defaults do not apply to nn.Embedding (its table stays float; a rule type:Embedding quantizes it)",
                "add 'rule type:Embedding { weight = ... }' (per tensor, or per_channel: one scale per row) "
                "to quantize and export it, or 'skip' it")
    if type(m).__module__.startswith("torch.nn"):
        return (f"nn.{t} weights are not supported yet ({shown} {'stays' if len(kernels) == 1 else 'stay'} float)",
                "skip it with a rule to silence this, or quantize the model without it")
    return (f"parameter{'s' if len(kernels) > 1 else ''} {shown} read directly by the forward of {t}",
            "wrap the product in an nn.Linear/nn.Conv2d child so qdsl can patch it, or 'skip' the module")


def _fn_display(node: Any) -> str:
    name = getattr(node.target, "__name__", str(node.target)).strip("_")
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.target is operator.matmul:
        return "@"
    return ("F." if name in _F_NAMES else "torch.") + name


def _fn_name(node: Any) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target)).strip("_")


def _owner(node: Any) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    last = list(stack.values())[-1]
    return last[0] if isinstance(last, tuple) else str(last)


def check_coverage(model: nn.Module, plan: Plan, trace: ModelTrace, registries: Any = None,
                   calls: Mapping[str, int] | None = None) -> Coverage:
    """The findings for ``model`` under ``plan`` (see the module docstring).

    ``calls`` (fqn -> calls in one real forward, from :func:`count_calls`) replaces the
    trace's counts; it is what ``apply`` passes when fx could not trace the model.
    """
    reach = _Reach(plan, registries)
    modules = _user_modules(model)
    floats: list[Finding] = []
    consumed: set[str] = set()  # "fqn.param" read by a functional op already reported

    def quantized_weight(fqn: str) -> bool:
        lp = reach.layers.get(fqn)
        return lp is not None and lp.quantized and lp.recipe(Role.WEIGHT) is not None

    def quantized_kernel(fqn: str, m: nn.Module, name: str) -> bool:
        if name == "weight":
            return quantized_weight(fqn)
        lp = reach.layers.get(fqn)
        if is_attention(m) and name == "in_proj_weight":
            return lp is not None and lp.quantized and lp.recipe(Role.WEIGHT) is not None
        if not is_recurrent(m) or lp is None or not lp.quantized:
            return False
        # a recurrent layer's weight_ih_l0 / weight_hh_l1_reverse (not weight_hr: E511)
        role = {"weight_ih": Role.WEIGHT_IH, "weight_hh": Role.WEIGHT_HH}.get(name[:9])
        return role is not None and lp.recipe(role) is not None

    if trace.graph is not None:
        for node in trace.graph.nodes:
            if node.op not in ("call_function", "call_method") or _fn_name(node) not in _PRODUCTS:
                continue
            owner = _owner(node)
            om = modules.get(owner)
            if isinstance(om, _SUPPORTED_BASES):
                # a Linear/Conv subclass's own product: patched with the module, or
                # reported below as a module (with the rule that would quantize it)
                continue
            params = [str(a.target) for a in node.all_input_nodes if a.op == "get_attr"]
            # a patched module's forward using its own quantized weight: the hooks cover it
            if f"{owner + '.' if owner else ''}weight" in params and quantized_weight(owner):
                continue
            src = reach.source(owner, type(om).__name__ if om is not None else "", (Role.WEIGHT, Role.INPUT))
            if src is None:
                continue
            if not params and _fn_name(node) in _ACT_PRODUCTS and all(
                    view_source(a).op == "call_module" for a in node.args[:2] if hasattr(a, "op")):
                continue  # act x act of module results: quantized by the quantizers the matmul implies
            fn = _fn_display(node)
            if params:
                why = f"functional {fn} (fx node {node.name}) reads parameter {', '.join(params)} directly: not quantized"
            else:
                why = f"functional {fn} (fx node {node.name}) of activations is not quantized"
            consumed.update(params)
            floats.append(Finding(f"{fn} in {owner or ROOT}", why, src[0], src[1],
                                  "qdsl quantizes Linear/Conv1d/Conv2d modules; use one (or skip this module)"))
    parents = {fqn: modules.get(fqn.rpartition(".")[0]) for fqn in modules if fqn}
    for fqn, m in modules.items():
        lp = reach.layers.get(fqn)
        kernels = [k for k in _kernels(m) if not quantized_kernel(fqn, m, k)]
        # out_proj of an MHA qdsl patches is called as a module (qdsl.patch.attention)
        out_proj = isinstance(parents.get(fqn), nn.MultiheadAttention) and not quantized_weight(fqn.rpartition(".")[0])
        if out_proj and lp is not None and lp.quantized:
            kernels = kernels or ["weight"]  # a rule reached it, but its hooks never run
        kernels = [k for k in kernels if f"{fqn + '.' if fqn else ''}{k}" not in consumed]
        if kernels:
            roles = (Role.WEIGHT,) if not out_proj else (Role.WEIGHT, Role.INPUT, Role.OUTPUT)
            if is_recurrent(m):
                roles = (Role.WEIGHT, Role.WEIGHT_IH, Role.WEIGHT_HH)
            src = reach.source(fqn, type(m).__name__, roles)
            if src is not None:
                why, hint = _module_reason(fqn, m, kernels, parents.get(fqn))
                floats.append(Finding(fqn or ROOT, why, src[0], src[1], hint))
                continue
        if lp is not None and lp.quantized and not out_proj:
            if _count(fqn, trace, calls) == 0:
                src = reach.source(fqn, type(m).__name__, tuple(r for r, q in lp.roles.items() if q is not None))
                floats.append(Finding(fqn or ROOT, "is never called by the model's forward, so its quantizers "
                                      "never run", *(src or ("", UNKNOWN_SPAN))))
    shared = _shared(plan, reach, modules, trace, calls)
    checked = calls is not None or trace.traced
    return Coverage(tuple(floats), tuple(shared), None if trace.traced else trace.error or "unknown", checked)


def _user_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``named_modules()`` without qdsl's own (``_qdsl_internal``) modules and their children."""
    out: dict[str, nn.Module] = {}
    internal: list[str] = []
    for fqn, m in model.named_modules():
        if any(fqn.startswith(p + ".") for p in internal):
            continue
        if getattr(m, "_qdsl_internal", False):
            internal.append(fqn)
            continue
        out[fqn] = m
    return out


def _count(fqn: str, trace: ModelTrace, calls: Mapping[str, int] | None) -> int | None:
    """Calls of ``fqn`` per forward: counted in a real forward, else traced, else unknown."""
    if calls is not None:
        return calls.get(fqn, 0)
    return trace.calls.get(fqn, 0) if trace.seen(fqn) else None


def _shared(plan: Plan, reach: _Reach, modules: dict[str, nn.Module], trace: ModelTrace,
            calls: Mapping[str, int] | None) -> list[Finding]:
    out = []
    for lp in plan.layers:
        if not lp.quantized or lp.fqn not in modules:
            continue
        acts = [r for r in (Role.INPUT, Role.OUTPUT, Role.HIDDEN, Role.CELL) if lp.roles.get(r) is not None]
        if not acts:
            continue
        n = _count(lp.fqn, trace, calls) or 0
        if n > 1:
            what = " and ".join(r.value for r in acts)
            src = reach.source(lp.fqn, lp.type_name, tuple(acts))
            out.append(Finding(lp.fqn or ROOT, f"called {n} times per forward: its one {what} observer sees all "
                               f"{n} call sites, which share one scale", *(src or ("", UNKNOWN_SPAN))))
    return out


@contextlib.contextmanager
def count_calls(model: nn.Module) -> Iterator[dict[str, int]]:
    """Count every module's calls (by fqn) while the block runs a real forward."""
    counts: dict[str, int] = {}
    hooks = []
    for fqn, m in model.named_modules():
        def pre(module, args, fqn=fqn):
            counts[fqn] = counts.get(fqn, 0) + 1
        hooks.append(m.register_forward_pre_hook(pre, prepend=True))
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()

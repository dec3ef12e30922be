"""``qdsl.apply`` and ``qdsl.remove``: patch an unmodified model from a plan, and undo it.

Guarantees
----------
* ``type(module)`` never changes; no ``forward`` is rebound.  Everything is hooks, a
  moved parameter (``weight`` -> ``weight_float``, same ``nn.Parameter``) and one child
  module ``model._qdsl`` (see :mod:`qdsl.patch.handle`).
* ``remove(model)`` restores the model: ``state_dict()`` has the same keys in the same
  order with bit-identical values (BatchNorm buffers included), the parameters are the
  same objects, and outputs are bit-identical.
* Applying to an already applied model, a plan naming modules the model lacks, a weight
  quantizer on a module without a weight, a group size that does not divide the weight
  rows, an ``input*weight`` bias without per-tensor input and weight scales: each is a
  :class:`~qdsl.spec.diagnostics.QdslError` (a located :class:`SpecError` where the plan
  knows the spec line), raised before the model is touched.

Supported modules: any module for input/output roles (activations, containers such as a
residual block, the model itself via fqn ``""`` for the model input); any module with a
``weight``/``bias`` parameter for the weight/bias roles (Linear, Conv1d, Conv2d with
groups and dilation are what export understands).  With ``fold_bn``, a folded layer
whose model has no bias gets the folded bias quantized as int32 with scale
``input × weight`` when both its input and weight are quantized (an integer graph needs
an integer bias; any weight kind, the same codes the exporter writes), and left float
otherwise, or when only binary quantizers read the layer's result (the exporter then
lowers the float bias exactly as a sign threshold; :mod:`qdsl.patch.consumers`).
``nn.LSTM``/``GRU``/``RNN`` and their cells get a :class:`~qdsl.patch.recurrent.RecurrentPatch`
(weights, bias, input, hidden and cell state per time step; their parameters do not move);
``nn.MultiheadAttention`` an :class:`~qdsl.patch.attention.AttentionPatch` (the same way:
in_proj weight and bias per q/k/v slice, inputs, q, k, v, scores, probs, output; its
``out_proj`` is patched as a Linear).
Whatever else the spec reaches (an
``nn.Embedding``, a functional ``torch.matmul``, ...) is listed by :mod:`qdsl.patch.coverage`
in a warning, or refused with ``strict=True``.

Dtypes: float32, float64, float16 and bfloat16 models; the proxies compute in float32
and keep float32 state, module outputs keep the model's dtype (see
:mod:`qdsl.quantizers.proxy`).  TorchScript models (and an eager model's scripted layer
that the plan quantizes, E510) are refused: they take no Python hooks.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import attrs
import torch
from torch import nn

from qdsl.patch.binary_relu import warn_binary_after_relu
from qdsl.patch.consumers import read_only_by_binary
from qdsl.patch.coverage import check_coverage, count_calls
from qdsl.patch.fold import find_bn_pairs
from qdsl.patch.implied import with_implied
from qdsl.patch.int_sim import install_layernorm_sims
from qdsl.patch.handle import QdslContainer, QdslHandle, State, get_handle, proxy_key, state_of
from qdsl.patch.layer import LayerPatch
from qdsl.patch.attention import AttentionPatch, is_attention, unsupported_attention
from qdsl.patch.recurrent import RecurrentPatch, is_recurrent
from qdsl.patch.trace import trace_model
from qdsl.quantizers import functional as F
from qdsl.quantizers.parts import channel_axis, default_registries
from qdsl.quantizers.proxy import TensorQuantizer
from qdsl.resolve.invariants import bias_scale_problem
from qdsl.resolve.plan import LayerPlan, Plan, QuantizerRecipe
from qdsl.spec.diagnostics import Diagnostic, QdslError, Span, SpecError, UNKNOWN_SPAN
from qdsl.spec.model import DERIVED_BIAS_SCALE, Granularity, GranularityKind, Kind, ObserverSpec, Role

__all__ = ["apply", "remove", "folded_bias_recipe", "plan_for"]


def folded_bias_recipe() -> QuantizerRecipe:
    """int32, symmetric, scale ``input*weight``: the bias a folded BN adds to a bias-less layer."""
    return QuantizerRecipe(Kind.INT, 32, True, False, True, DERIVED_BIAS_SCALE, Granularity(),
                           ObserverSpec("minmax"), "half_even", False)


# A folded BN's bias (or bias correction's) gets an int32 proxy at scale input × weight for
# every kind whose accumulator has that scale (the number formats' ``accumulator_input`` /
# ``accumulator_weight``: int or binary inputs; int, binary, ternary or power-of-two
# weights). The exporter puts the same codes in the graph, so the fake-quant
# model and the graph add the same bias (a float bias would be rounded to the accumulator
# grid by the exporter alone: up to half an accumulator LSB, several output LSBs for the
# coarse accumulator of a binary layer). Layers read only by binary quantizers are the
# exception (qdsl.patch.consumers).
def _to_plan(model: nn.Module, spec: Any, overrides: Any, registries: Any) -> Plan:
    if isinstance(spec, Plan):
        if overrides:
            raise QdslError("overrides= needs a spec (file or QuantSpec), not an already resolved Plan")
        return spec
    from qdsl.resolve import resolve
    from qdsl.spec.model import QuantSpec

    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, (str, QuantSpec)):
        raise QdslError(
            f"qdsl.apply needs a spec file path, a QuantSpec or a resolved Plan, got {type(spec).__name__}"
        )
    return resolve(model, spec, registries=registries, overrides=overrides)


def _span(layer: LayerPlan, role: Role, field: str) -> Span:
    prov = layer.provenance.get((role, field))
    return prov.set_by.span if prov is not None else UNKNOWN_SPAN


def _check(model: nn.Module, plan: Plan, modules: dict[str, nn.Module]) -> list[Diagnostic]:
    diags: list[Diagnostic] = []
    missing = [lp.fqn for lp in plan.layers if lp.quantized and lp.fqn not in modules]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (" ..." if len(missing) > 5 else "")
        diags.append(Diagnostic.error(
            "E501", f"the plan names modules this {type(model).__name__} does not have: {shown}",
            UNKNOWN_SPAN, "was the plan resolved against a different model? resolve it against this one",
        ))
        return diags
    for lp in plan.layers:
        if not lp.quantized:
            continue
        m = modules[lp.fqn]
        roles = {r: q for r, q in lp.roles.items() if q is not None and q.format.quantized}
        if isinstance(m, torch.jit.ScriptModule):
            # TorchScript modules take no Python hooks and their parameters cannot move
            role = next(iter(roles), Role.INPUT)
            diags.append(Diagnostic.error(
                "E510", f"'{lp.fqn}' is a TorchScript module ({type(m).__name__}); qdsl cannot patch it",
                _span(lp, role, "kind"),
                "apply qdsl to the eager module and script it afterwards, or skip this layer"))
            continue
        if is_recurrent(m):
            if getattr(m, "proj_size", 0):
                role = next((r for r in (Role.WEIGHT_HH, Role.WEIGHT_IH, Role.HIDDEN) if r in roles), next(iter(roles), Role.INPUT))
                diags.append(Diagnostic.error(
                    "E511", f"'{lp.fqn}' is an {type(m).__name__} with proj_size={m.proj_size}: qdsl does not "
                    "quantize LSTM projections (weight_hr) yet", _span(lp, role, "kind"),
                    "skip this layer, or use proj_size=0"))
            continue
        if is_attention(m):
            why = unsupported_attention(m)
            if why is not None:
                role = next((r for r in (Role.WEIGHT, Role.INPUT) if r in roles), next(iter(roles), Role.INPUT))
                diags.append(Diagnostic.error(
                    "E511", f"'{lp.fqn}' is a MultiheadAttention with {why}", _span(lp, role, "kind"),
                    "skip this layer, or build it with kdim = vdim = embed_dim and no bias_k/bias_v/zero_attn"))
            continue
        for role in (Role.WEIGHT, Role.BIAS):
            q = roles.get(role)
            if q is None or (role is Role.BIAS and q.scale == DERIVED_BIAS_SCALE):
                continue
            p = m._parameters.get(role.value)
            if not isinstance(p, torch.Tensor):
                diags.append(Diagnostic.error(
                    "E502", f"'{lp.fqn}' ({type(m).__name__}) has no {role.value} parameter to quantize",
                    _span(lp, role, "kind")))
                continue
            axis, group = channel_axis(q, role)
            try:
                F.param_shape(tuple(p.shape), axis, group)
            except (ValueError, IndexError) as exc:
                diags.append(Diagnostic.error(
                    "E503", f"{role.value} of '{lp.fqn}' (shape {tuple(p.shape)}): {exc}",
                    _span(lp, role, "granularity")))
        # resolve reports this as E214; a Plan built by hand reaches it here
        problem = bias_scale_problem(roles, lp.type_name)
        if problem is not None:
            diags.append(Diagnostic.error(
                "E504", f"the bias of '{lp.fqn}' has scale input*weight, but {problem.reason}",
                _span(lp, Role.BIAS, "scale"),
                "quantize the input and weight of this layer, or give the bias its own quantizer"))
    return diags


def plan_for(model: nn.Module, spec: Any, overrides: Any = None, registries: Any = None) -> tuple[Plan, Any]:
    """``(plan, registries)`` :func:`apply` would patch ``model`` with, after checking the
    model can be patched at all; the façade lints this plan for ``hw=`` before applying."""
    plan, regs, _ = _plan_and_trace(model, spec, overrides, registries)
    return plan, regs


def _plan_and_trace(model: nn.Module, spec: Any, overrides: Any, registries: Any) -> tuple[Plan, Any, Any]:
    """:func:`plan_for` and the model's fx trace it used (apply reuses it: one trace)."""
    if not isinstance(model, nn.Module):
        raise QdslError(f"qdsl.apply needs an nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise QdslError(
            f"qdsl.apply needs an eager nn.Module, got a TorchScript {type(model).__name__} "
            "(torch.jit.script / torch.jit.trace output): TorchScript modules take no Python hooks; "
            "apply qdsl to the eager model before scripting or tracing it"
        )
    st = state_of(model)
    if st is not None:
        raise QdslError(
            f"qdsl is already applied to this {type(model).__name__} (state: {st.value}); "
            "call qdsl.remove(model) before applying again"
        )
    regs = registries if registries is not None else default_registries()
    # integer adds/concats reading an unquantized value imply an output quantizer (qdsl.patch.implied)
    trace = trace_model(model)
    return with_implied(model, trace, _to_plan(model, spec, overrides, regs)), regs, trace


def apply(model: nn.Module, spec: Any, *, overrides: Any = None, registries: Any = None,
          example_input: Any = None, strict: bool = False, check_finite: bool = False,
          materialize: bool = True) -> QdslHandle:
    """Resolve ``spec`` (a path, a ``QuantSpec`` or a ``Plan``) against ``model`` and patch it.

    ``example_input``, if given (a tensor, a tuple of positional arguments or a dict of
    keyword arguments), is run through the patched model once (no grad) so a problem
    shows up here rather than in the first real forward; if it fails, the model is
    restored and the error propagates.

    ``hw=`` (lint the plan against a hardware profile first) is the façade's
    (:func:`qdsl.api.apply`): lint sits above patch.

    Modules and functional ops the spec reaches but qdsl cannot quantize (``nn.Embedding``,
    ``torch.matmul``, ...; :mod:`qdsl.patch.coverage`) are listed in
    a :class:`~qdsl.patch.coverage.LeftFloatWarning`; ``strict=True`` raises
    :class:`~qdsl.patch.coverage.LeftFloatError` instead, with the model untouched.
    Quantized modules called more than once per forward get a ``SharedModuleWarning``;
    a signed binary input without a learned threshold that only ReLU outputs feed (always
    +1) a located :class:`~qdsl.patch.binary_relu.BinaryAfterReluWarning`.
    Both come from one torch.fx trace; when fx cannot trace the model the warning says
    that functional ops were not checked, and the call counts come from the
    ``example_input`` forward if there is one.

    ``check_finite=True``: an input/output quantizer that meets a NaN or an infinity raises
    :class:`~qdsl.spec.diagnostics.NonFiniteError` (naming it) instead of quantizing it by
    the policy the integer graph shares (NaN -> the zero point's code, +inf -> qmax,
    -inf -> qmin; docs/qgraph.md §4.4).

    ``materialize=False``: no layer's fake-quantized weight/bias is computed here (each is
    as large as its float master); ``module.weight`` is a
    :class:`~qdsl.patch.lazy_weight.LazyQuantized` tensor that computes it when first used,
    and the first forward computes it as always.  Values, gradients, ``remove`` and the
    rest are those of ``materialize=True``.  For lean training (``qdsl.qat.LeanAdam`` takes
    the weights out of the modules before any forward, so the copy is never made).
    """
    # one fx trace for the implied quantizers, folding, the coverage and bias-reader checks
    plan, regs, trace = _plan_and_trace(model, spec, overrides, registries)
    modules = dict(model.named_modules())
    diags = _check(model, plan, modules)
    if diags:
        raise SpecError(diags)
    pairs = find_bn_pairs(model, trace) if plan.fold_bn else {}
    coverage = check_coverage(model, plan, trace, regs)
    if strict and coverage.floats:
        raise coverage.error()
    sign_only = functools.cache(lambda: read_only_by_binary(
        model, trace.graph, [lp.fqn for lp in plan.layers if lp.quantized],
        {lp.fqn: r.format for lp in plan.layers if lp.quantized and (r := lp.roles.get(Role.INPUT)) is not None},
        {lp.fqn: r.format for lp in plan.layers if lp.quantized and (r := lp.roles.get(Role.OUTPUT)) is not None}))
    container = QdslContainer()
    handle = QdslHandle(model, plan, container, regs)
    container.handle = handle
    for lp in plan.layers:
        if not lp.quantized:
            continue
        module = modules[lp.fqn]
        if is_recurrent(module) or is_attention(module):
            rec = _fused_patch(handle, lp, module, regs, check_finite)
            if rec.quantizers:
                container.quantizers.update(rec.quantizers)
                handle.layers[lp.fqn] = rec
            continue
        bn_fqn = pairs.get(lp.fqn)
        has_bias = module._parameters.get("bias") is not None or bn_fqn is not None
        proxies: dict[Role, TensorQuantizer] = {}
        for role, recipe in lp.roles.items():
            if recipe is None or not recipe.format.quantized or (role is Role.BIAS and not has_bias):
                continue
            proxies[role] = TensorQuantizer(recipe, role, regs, name=f"{lp.fqn or '<model>'}:{role.value}")
        iq, wq = proxies.get(Role.INPUT), proxies.get(Role.WEIGHT)
        if ((bn_fqn is not None or plan.bias_correction) and Role.BIAS not in lp.roles and iq is not None and wq is not None
                and iq.format.accumulator_input and wq.format.accumulator_weight and iq.axis is None and wq.group_size is None
                and wq.axis in (None, 0)):
            # the model has no bias but folding (or bias correction) creates one: int32 at
            # input × weight scale; a folded bias read only by binary quantizers stays float
            # (consumers.py: the exporter lowers it exactly as a sign threshold)
            if plan.bias_correction or lp.fqn not in sign_only():
                proxies[Role.BIAS] = TensorQuantizer(folded_bias_recipe(), Role.BIAS, regs, name=f"{lp.fqn}:bias")
        if not proxies and bn_fqn is None:
            continue
        for role, q in proxies.items():
            q.check_finite = bool(check_finite)
            container.quantizers[proxy_key(lp.fqn, role)] = q
        bn = modules[bn_fqn] if bn_fqn is not None else None
        handle.layers[lp.fqn] = LayerPatch(handle, lp, module, proxies, bn, bn_fqn)
    model.add_module("_qdsl", container)
    installed: list[LayerPatch] = []
    try:
        for patch in handle.layers.values():
            if isinstance(patch, LayerPatch):
                patch.install(materialize)
            else:
                patch.install()
            installed.append(patch)
        for patch in installed:
            patch.install_bn_skip()
        # frozen LayerNorms compute the graph's LAYERNORM (qdsl.patch.int_sim)
        handle.sim_hooks = install_layernorm_sims(handle, model)
        if example_input is not None:
            with torch.no_grad(), count_calls(model) as calls:
                if isinstance(example_input, (tuple, list)):
                    model(*example_input)
                elif isinstance(example_input, dict):
                    model(**example_input)
                else:
                    model(example_input)
            if not trace.traced:  # fx could not count the calls: this forward did
                coverage = check_coverage(model, plan, trace, regs, calls)
                if strict and coverage.floats:
                    raise coverage.error()
    except BaseException:
        for h in getattr(handle, "sim_hooks", ()):
            h.remove()
        for patch in reversed(installed):
            patch.uninstall()
        del model._modules["_qdsl"]
        container.handle = None
        raise
    handle.state = State.PREPARED
    coverage.warn(stacklevel=3)
    warn_binary_after_relu(model, trace.graph, plan, stacklevel=3)
    return handle


def _fused_patch(handle: QdslHandle, lp: LayerPlan, module: nn.Module, regs: Any,
                     check_finite: bool) -> RecurrentPatch | AttentionPatch:
    def make(role: Role, suffix: str) -> TensorQuantizer | None:
        recipe = lp.roles.get(role)
        if recipe is None or not recipe.format.quantized:
            return None
        if recipe.granularity.kind is GranularityKind.GATE:
            # one scale per gate: per channel over the (gates, rows·cols) view RecurrentPatch hands it
            recipe = attrs.evolve(recipe, granularity=Granularity(GranularityKind.CHANNEL, 0))
        q = TensorQuantizer(recipe, role, regs, name=f"{lp.fqn or '<model>'}:{role.value}{suffix}")
        q.check_finite = bool(check_finite)
        return q
    return (AttentionPatch if is_attention(module) else RecurrentPatch)(handle, lp, module, make)


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply` (see the module docstring); returns the model."""
    handle = get_handle(model)
    lean = [fqn for fqn, p in handle.layers.items() if getattr(p.module, "_qdsl_lean", False)]
    if lean:  # qdsl.qat.lean: the float master lives in an optimizer, not on the module
        raise QdslError(f"layer(s) {', '.join(lean)} hold lean weights: "
                        "call finish() on the LeanOptimizer before qdsl.remove(model)")
    for h in getattr(handle, "sim_hooks", ()):
        h.remove()
    for patch in reversed(list(handle.layers.values())):
        patch.uninstall()
    del model._modules["_qdsl"]
    handle.container.handle = None
    handle.removed = True
    return model

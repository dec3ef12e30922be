"""The QAT gradient path of ``TensorQuantizer``: which STE each kind of quantizer trains with.

``TensorQuantizer`` (qdsl/quantizers/proxy.py) always computes *values* with
``qdsl.quantizers.functional``; when autograd needs a gradient it calls its own hook
``proxy.grad_path(proxy, x, scale, zero_point, threshold)``.  :func:`install` puts
:func:`qat_grad_path` there on the proxies it is given - one proxy, or every proxy of a
model - and nowhere else: importing a module changes no model's gradients.  A proxy
whose scale rule is learned gets it when built (LSQ needs it);
``qdsl.qat.prepare_qat``, ``fit`` and ``LeanOptimizer`` install it on their model's
proxies.  Guarantees:

* the value returned equals the proxy's own fake-quantized value bit for bit (the
  format's surrogates either compute it with the same ``functional`` call or add a term
  that is exactly zero in the forward pass);
* gradients are the number format's (``FormatOps.qat_value`` in qdsl/quantizers/formats/;
  a user format gets the clipping-mask STE unless it overrides it); the built-in ones,
  by kind and role (closed forms in :mod:`qdsl.quantizers.ste`):

  ============  ==========  ======================================================
  kind          role        gradient
  ============  ==========  ======================================================
  int           any         clipping-mask STE to x; LSQ/LSQ+ to a learned scale
  binary        weight      XNOR-Net: α = mean|W| differentiable, sign clipped |W|<=1
  binary        activation  BNN clipped STE (|x| <= s); {0, 1}: mask on [0, s]
  ternary       weight      TWN: codes straight-through, α over kept weights
  ternary       activation  identity inside |x| <= s
  pot           any         identity where |w| <= s, zero where clipped
  ============  ==========  ======================================================

* a learned scale rule is told how many elements share each scale (LSQ's
  ``1/sqrt(numel·qmax)``) on every call, from the tensor actually quantized.
"""

from __future__ import annotations

import torch
from torch import Tensor


__all__ = ["qat_grad_path", "install", "uninstall"]


def qat_grad_path(q, x: Tensor, scale: Tensor, zero_point: Tensor, threshold) -> Tensor:
    """Fake-quantize ``x`` with proxy ``q``'s parameters and the QAT surrogate gradient
    of its number format (``q._ops.qat_value``)."""
    rule = q.scale_rule
    if getattr(rule, "learned", False) and hasattr(rule, "bind"):
        rule.bind(x.shape, per_sample=not q.role.is_param, slots=max(1, scale.numel()))
    return q._ops.qat_value(q, x, scale, zero_point, threshold)


def _proxies(target) -> list:
    from qdsl.quantizers.proxy import TensorQuantizer

    if isinstance(target, TensorQuantizer):
        return [target]
    if isinstance(target, torch.nn.Module):
        return [m for m in target.modules() if isinstance(m, TensorQuantizer)]
    return [q for t in target for q in _proxies(t)]


def install(target) -> int:
    """Make the proxies of ``target`` (a ``TensorQuantizer``, a module such as a patched
    model, or an iterable of them) train with :func:`qat_grad_path`; idempotent.
    Returns how many proxies it set; no other proxy changes.

    Entering QAT drops the proxies' PTQ-only adjustments (``clear_ptq_adjustments``:
    bias-correction offsets, fixed GPTQ codes), which ``qdsl.calibrate`` adds below 8 bits
    by default: they were fitted to the calibrated weights, and fixed codes would stop
    the weight's gradient (``qdsl.qat.prepare_qat`` documents the measured cost)."""
    proxies = _proxies(target)
    for q in proxies:
        q.grad_path = qat_grad_path
        q.clear_ptq_adjustments()
    return len(proxies)


def uninstall(target) -> int:
    """Back to the plain identity STE for the proxies of ``target`` (as in :func:`install`)."""
    proxies = _proxies(target)
    for q in proxies:
        q.grad_path = None
    return len(proxies)

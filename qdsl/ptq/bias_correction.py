"""Empirical bias correction (Nagel et al. 2019, "Data-free quantization", §4.2, the
empirical variant): after calibration, shift each quantized layer's bias by the mean
per-channel difference between its float and its quantized outputs on calibration data.

Algorithm (layers in execution order, so each correction sees the corrected layers
before it)::

    μ_f[L] = mean over batch and positions of layer L's output, float model   (one pass)
    for each layer L:
        μ_q  = the same in the quantized model (pass stops right after L)
        L.bias_correction -= μ_q - μ_f[L]

The correction is a float vector per output channel that the layer's bias proxy adds
to the float bias before quantizing it (``TensorQuantizer.offset``); layers without a
bias get one at apply time when the spec says ``bias_correction = true``.  Because it
lives in the proxy, ``int_tensors``, export and ``state_dict`` include it, and
``qdsl.remove`` still restores the original model bit for bit.

Guard (``heldback`` and ``report`` given, as ``qdsl.ptq.pipeline`` does): the means are
taken on the fit batches only, and each layer's correction is kept only if it lowers the
layer's output MSE against the float model on the held-back batches
(:func:`qdsl.ptq.guard.guarded`; a correction estimated from too few samples, or one
that fights a clipped output, can raise it).  A layer without a bias proxy is skipped
with a note then, instead of failing.

Cost: 1 float pass + one partial quantized pass per layer over the calibration set
(about 0.3 s for the 11-layer digits ResNet on 256 images, 2 cores), plus, guarded,
one float and two quantized partial passes per layer over the held-back batches.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from qdsl.patch.handle import State, get_handle
from qdsl.ptq.guard import guarded
from qdsl.ptq.layers import capture, channel_dim, float_mode, require_batches, run_batches, weighted_layers
from qdsl.ptq.report import LayerDecision, PtqReport
from qdsl.spec.diagnostics import QdslError

__all__ = ["correct_bias", "channel_mean"]


def channel_mean(y: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """``(sum over everything but dim, count)`` in float64, so batches can be pooled."""
    y = y.detach().to(torch.float64).movedim(dim, 0)
    flat = y.reshape(y.shape[0], -1)
    return flat.sum(dim=1), flat.shape[1]


class _Mean:
    def __init__(self, dim: int):
        self.dim, self.total, self.n = dim, None, 0

    def __call__(self, _inp, out) -> None:
        s, n = channel_mean(out, self.dim)
        self.total = s if self.total is None else self.total + s
        self.n += n

    def value(self) -> torch.Tensor:
        return self.total / max(self.n, 1)


def _bias_proxy(fqn: str, patch: Any):
    bq = patch.bq
    if bq is None or not hasattr(bq, "offset"):
        raise QdslError(
            f"bias correction needs a quantized bias on '{fqn}' to correct; quantize its bias "
            "(e.g. bias = int(bits=32, scale=input*weight)), or apply a spec with bias_correction = true "
            "so layers without a bias get one"
        )
    return bq


def correct_bias(model: nn.Module, batches: Iterable[Any], *, layers: Iterable[str] | None = None,
                 heldback: list[Any] | None = None, report: PtqReport | None = None) -> dict[str, torch.Tensor]:
    """Correct the biases of the patched model's quantized Linear/Conv layers (all, or
    the fqns in ``layers``) on ``batches``; returns ``{fqn: correction}`` (the total
    offset now in each bias proxy, for the layers whose correction was kept).  Run it
    after calibration, before freezing.  With ``report``, each correction is guarded on
    ``heldback`` (module docstring) and every layer gets a decision."""
    batches = require_batches(batches, "bias correction")
    if get_handle(model).state in (State.FROZEN, State.EXPORTED):
        raise QdslError("bias correction runs before qdsl.freeze(model): the model is already frozen")
    todo = weighted_layers(model, batches)
    if layers is not None:
        wanted = set(layers)
        unknown = wanted - {f for f, _ in todo}
        if unknown:
            raise QdslError(f"bias correction: no quantized Linear/Conv layer named {', '.join(sorted(unknown))}")
        todo = [(f, p) for f, p in todo if f in wanted]
    if report is not None:
        kept = []
        for f, p in todo:
            if p.bq is None or not hasattr(p.bq, "offset"):
                report.add(LayerDecision(f, "bias_correction", False, float("nan"), float("nan"),
                                         "not run: the layer has no quantized bias"))
            else:
                kept.append((f, p))
        todo = kept
    proxies = {f: _bias_proxy(f, p) for f, p in todo}
    # float means of every layer, in one pass
    ref = {f: _Mean(channel_dim(p.module)) for f, p in todo}
    hooks = [p.module.register_forward_hook(lambda m, a, o, f=f: ref[f](a[0], o)) for f, p in todo]
    try:
        with float_mode(model):
            run_batches(model, batches)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for fqn, patch in todo:
        q = _Mean(channel_dim(patch.module))
        with capture(patch.module, q, stop=True):
            run_batches(model, batches)
        if q.total is None:  # the layer never ran on these batches: nothing to measure
            continue
        shift = (q.value() - ref[fqn].value()).to(torch.float32)
        bq = proxies[fqn]
        if report is None:
            out[fqn] = bq.add_offset(-shift)
            continue
        saved = bq.offset.clone()

        def undo(bq=bq, saved=saved):
            bq.offset = saved.clone()

        if guarded(model, fqn, patch.module, list(heldback or []), "bias_correction",
                   lambda bq=bq, shift=shift: bq.add_offset(-shift), undo, report):
            out[fqn] = bq.offset.clone()
    return out

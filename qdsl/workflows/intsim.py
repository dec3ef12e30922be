"""Integer-accelerator simulation: run a frozen model's dot products on integers, with a hook.

For people simulating integer-only hardware (analog, photonic, approximate adders):
inside ``with simulate(model, accumulate=fn):`` every quantized Conv1d/Conv2d/Linear
computes its output from the integers that :func:`qdsl.int_tensors` reports::

    acc = Σ (x_q − x_zp)·(w_q − w_zp)  + b_q          exact, int64
    acc = fn(acc, layer)                              the user's error model (optional)
    y   = acc · (x_scale · w_scale)                   per output channel, then the
                                                      layer's output quantizer if any

With ``fn=None`` this reproduces the fake-quant model (same integers; the float sum
differs only by float32 rounding), so any accuracy change comes from the hook alone.
``layer`` is the :class:`qdsl.patch.ints.LayerInts` of that layer (scales, bit widths
via ``weight``'s dtype, etc.), so a hook can scale its noise per layer.

How the integer input is recovered: the layer's input pre-hook has already replaced
``x`` by ``x̂ = (q − z)·s`` in float32; ``round(x̂ / s)`` gives back ``q − z`` exactly
(|q − z| < 2^16 ≪ 2^24, so the float32 product and quotient are exact to < 0.5).
Sums are done in float64, exact below 2^53 (asserted per layer from the integer ranges).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from qdsl.spec.diagnostics import QdslError

__all__ = ["simulate", "AccumulateHook", "gaussian_noise"]

AccumulateHook = Callable[[torch.Tensor, Any], torch.Tensor]


def _channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-output-channel vector shaped to broadcast over an ``ndim`` output."""
    if t.numel() == 1:
        return t.reshape(())
    return t.reshape((1, -1) + (1,) * (ndim - 2))


class _LayerSim:
    def __init__(self, fqn: str, module: nn.Module, ints: Any, out_q: Any, hook: AccumulateHook | None):
        self.fqn, self.module, self.ints, self.out_q, self.hook = fqn, module, ints, out_q, hook
        w = ints.weight.to(torch.float64)
        if ints.weight_zero_point is not None:
            zp = ints.weight_zero_point.to(torch.float64)
            w = w - (zp.reshape(()) if zp.numel() == 1 else zp.reshape((-1,) + (1,) * (w.dim() - 1)))
        if w.dim() > 2 and ints.weight_scale is not None and ints.weight_scale.dim() > 1:
            raise QdslError(f"{fqn}: group-wise weight scales are not supported by the simulator")
        self.w = w
        wmax = float(w.abs().max()) if w.numel() else 0.0
        fan_in = w[0].numel()
        qmax_x = 2.0 ** 16
        if wmax * qmax_x * fan_in >= 2.0**53:
            raise QdslError(f"{fqn}: accumulator range exceeds exact float64 simulation")
        self.bias = ints.bias.to(torch.int64) if ints.bias is not None else None
        self.float_bias = ints.float_bias

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        ints = self.ints
        x = args[0]
        s_in = ints.input_scale.to(torch.float32)
        q = torch.round(x / s_in).to(torch.float64)  # = q - z, exactly
        m = self.module
        if isinstance(m, nn.Linear):
            acc = F.linear(q, self.w)
        elif isinstance(m, nn.Conv1d):
            acc = F.conv1d(q, self.w, None, m.stride, m.padding, m.dilation, m.groups)
        else:
            acc = F.conv2d(q, self.w, None, m.stride, m.padding, m.dilation, m.groups)
        acc = torch.round(acc).to(torch.int64)
        if self.bias is not None:
            acc = acc + _channel_view(self.bias, acc.dim())
        if self.hook is not None:
            acc = self.hook(acc, ints)
            if not isinstance(acc, torch.Tensor) or acc.dtype != torch.int64:
                raise QdslError(f"the accumulate hook must return an int64 tensor (layer {self.fqn})")
        scale = (s_in.to(torch.float64) * ints.weight_scale.to(torch.float64)).reshape(-1)
        y = acc.to(torch.float64) * _channel_view(scale, acc.dim())
        y = y.to(torch.float32)
        if self.bias is None and self.float_bias is not None:
            y = y + _channel_view(self.float_bias.to(torch.float32), y.dim())
        if self.out_q is not None:
            y = self.out_q(y)
        return y


@contextlib.contextmanager
def simulate(model: nn.Module, accumulate: AccumulateHook | None = None) -> Iterator[dict[str, Any]]:
    """Within the block, quantized conv/linear layers run as integer dot products.

    Yields ``{fqn: LayerInts}`` of the simulated layers.  Layers whose input or weight is
    not quantized keep their fake-quant forward.  The model must be frozen.
    """
    from qdsl.patch import get_handle, int_tensors
    from qdsl.spec.model import Role

    handle = get_handle(model)
    all_ints = int_tensors(model)
    modules = dict(model.named_modules())
    removers = []
    simulated = {}
    try:
        for fqn, ints in all_ints.items():
            module = modules[fqn]
            if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
                continue
            if ints.weight is None or ints.input_scale is None or ints.weight_scale is None:
                continue
            out_q = handle.quantizer(fqn, Role.OUTPUT)
            sim = _LayerSim(fqn, module, ints, out_q, accumulate)
            removers.append(module.register_forward_hook(sim))
            simulated[fqn] = ints
        if not simulated:
            raise QdslError("no layer has both a quantized input and a quantized weight: nothing to simulate")
        yield simulated
    finally:
        for r in removers:
            r.remove()


def gaussian_noise(sigma_lsb: float, seed: int = 0, relative: bool = False) -> AccumulateHook:
    """A hook adding N(0, σ²) noise to every accumulator, rounded to integers.

    ``relative=False``: σ is in accumulator LSBs.  ``relative=True``: σ is a fraction of
    each layer's RMS accumulator (a signal-to-noise model, as analog MACs behave).
    """
    g = torch.Generator().manual_seed(seed)

    def hook(acc: torch.Tensor, layer: Any) -> torch.Tensor:
        sigma = sigma_lsb
        if relative:
            sigma = sigma_lsb * math.sqrt(float(acc.to(torch.float64).pow(2).mean()))
        noise = torch.randn(acc.shape, generator=g, dtype=torch.float64) * sigma
        return acc + torch.round(noise).to(torch.int64)

    return hook

"""The accumulator simulation as one custom op, for compiled graphs (``torch.compile``).

:class:`qdsl.patch.accumulate.AccumulatorSim` calls :func:`simulate_accumulator` in place of
its eager body while dynamo traces.  The op is opaque to the compiler and runs the eager
code (:mod:`qdsl.patch.accumulator_sums`) on the tensors as they are, so:

* the decision (bias against the width bound, else the exact per-channel extremes) and the
  exact sums are the eager hook's own, bit for bit;
* it **writes the layer output in place** (``y``, the conv/linear output; declared mutated)
  and only when the exact path runs, so the usual step, where no input can overflow,
  costs the weight-sized decision and nothing per activation: no copy of the output, no
  mask, no relayout of a channels-last tensor (``torch.cond`` needed all three: a branch
  may not return an alias of its input, both branches return the same outputs, and its
  operands were flattened to pass inductor's stride checks);
* the saturate gradient mask ``keep`` is written likewise, only when the exact path runs;
  the op returns whether it ran, and the backward reads ``keep`` only then
  (``AccumulatorSim._traced``).

The op has no autograd formula: it runs on detached tensors (the gradient is the float
layer's, carried by ``_Overflowed`` as in eager).  Its fake implementation returns the
flag's metadata; a mutated argument keeps its own.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from qdsl.patch.accumulator_sums import decide, operands, simulate

__all__ = ["simulate_accumulator", "layer_geometry", "layer_sums"]

_CONVS = (None, F.conv1d, F.conv2d, F.conv3d)


def layer_geometry(module) -> tuple[list[int], str, str, list[int]]:
    """``(geometry, padding_name, padding_mode, reversed_padding)``: what
    :func:`layer_sums` needs to repeat ``module``'s own linear/conv (``_conv_forward``) as
    op arguments.  ``geometry`` is ``[0]`` for a Linear, else ``[dims, groups, *stride,
    *dilation, *padding]`` (no padding when it is a string, ``padding_name``)."""
    if isinstance(module, torch.nn.Linear):
        return [0], "", "zeros", []
    nd = len(module.stride)
    named = isinstance(module.padding, str)
    geometry = [nd, module.groups, *module.stride, *module.dilation, *([] if named else module.padding)]
    pad = list(module._reversed_padding_repeated_twice) if module.padding_mode != "zeros" else []
    return geometry, module.padding if named else "", module.padding_mode, pad


def layer_sums(x: Tensor, w: Tensor, geometry: list[int], padding_name: str, padding_mode: str,
               pad: list[int]) -> Tensor:
    """The layer's linear/conv of ``x`` and ``w`` without bias, as ``_conv_forward`` computes it."""
    nd = geometry[0]
    if nd == 0:
        return F.linear(x, w)
    groups, stride, dilation = geometry[1], geometry[2:2 + nd], geometry[2 + nd:2 + 2 * nd]
    conv = _CONVS[nd]
    if padding_mode != "zeros":
        return conv(F.pad(x, pad, mode=padding_mode), w, None, stride, 0, dilation, groups)
    return conv(x, w, None, stride, padding_name or geometry[2 + 2 * nd:], dilation, groups)


@torch.library.custom_op("qdsl::simulate_accumulator", mutates_args=("y", "keep"))
def simulate_accumulator(y: Tensor, keep: Optional[Tensor], x: Tensor, w_hat: Tensor, b_hat: Optional[Tensor],
                         s_w: Tensor, s_x: Tensor, z: Optional[Tensor], x_ranges: list[int], qrange: list[int],
                         step: float, bits: int, saturate: bool, bound: list[int], geometry: list[int],
                         padding_name: str, padding_mode: str, pad: list[int]) -> Tensor:
    """Replace ``y`` (the layer's float output) by the simulated accumulator output where an
    input in range could overflow; returns whether it did (a 0-d bool).

    ``x_ranges``: the input's zero-point-corrected ranges, flattened ``[lo0, hi0, lo1, ...]``
    (used when ``z`` is None); with a frozen per-tensor zero point ``z`` the range is
    ``qrange - z``.  ``bound``: ``[B_lo, B_hi]`` from bit widths and fan-in, or empty.
    ``keep`` (saturate only) receives where the exact sum stayed in range."""
    with torch.no_grad():
        w_int, b_int, s_x64, s_acc = operands(s_w, s_x, w_hat, b_hat, step)
        if z is not None:
            zi = int(z.reshape(-1)[0])
            ranges = [(qrange[0] - zi, qrange[1] - zi)]
        else:
            ranges = [(x_ranges[i], x_ranges[i + 1]) for i in range(0, len(x_ranges), 2)]
        if decide(w_int, b_int, ranges, bits, tuple(bound) if bound else None):
            return torch.zeros((), dtype=torch.bool)
        axis = -1 if geometry[0] == 0 else 1
        out = simulate(lambda xi, wi: layer_sums(xi, wi, geometry, padding_name, padding_mode, pad), axis,
                       x, w_int, b_int, s_x64, s_acc, bits, saturate, y.dtype)
        if out is None:
            return torch.zeros((), dtype=torch.bool)  # beyond exact binary64: not simulated (as eager)
        y.copy_(out[0])
        if keep is not None:
            keep.copy_(out[1])
        return torch.ones((), dtype=torch.bool)


@simulate_accumulator.register_fake
def _simulate_accumulator_fake(y, keep, x, w_hat, b_hat, s_w, s_x, z, x_ranges, qrange, step, bits, saturate,
                               bound, geometry, padding_name, padding_mode, pad):
    return torch.empty((), dtype=torch.bool)

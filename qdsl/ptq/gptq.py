"""GPTQ learned rounding for one layer: integer weight codes that minimise the layer's
output error on calibration inputs, on a *fixed* grid (scale/zero point chosen before).

Why GPTQ rather than AdaRound: both learn the rounding layer by layer from calibration
data, but AdaRound optimises a soft rounding mask by gradient descent (thousands of
steps per layer), while GPTQ (Frantar et al., 2022, "GPTQ: accurate post-training
quantization for generative pre-trained transformers", after Optimal Brain Quantization)
is closed-form: one Cholesky factorisation and one sweep over the input columns per
layer.  On the reference digits ResNet it takes ~0.3 s for the whole network on 2 CPU
cores and at W3A3 / W2A2 it recovers most of what plain rounding loses; codes may move
by more than one step from nearest rounding (errors are pushed onto later columns).

The math (per layer, weight ``W`` as ``[C_out, d]`` rows, inputs ``X`` as ``[d, n]``
columns - for a conv, the im2col patches)::

    minimise  || W X - Ŵ X ||²  over Ŵ on the grid      H = X Xᵀ / n  (+ damp · mean(diag H) · I)
    for each column i (in order; by decreasing diag H with act_order):
        ŵ_i   = fake_quant(w_i)                          (per output channel scale)
        e     = (w_i - ŵ_i) / U_ii                       U = upper Cholesky factor of H⁻¹
        w_j  -= e · U_ij   for j > i                     (spread the error onto the rest)

Cost: ``O(d³)`` for the factorisation plus ``O(C_out · d²)`` for the sweep, per layer
(``d`` = in_channels/groups × kernel taps); memory ``O(d²)``.  Grouped convolutions run
the sweep once per group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qdsl.spec.diagnostics import QdslError

__all__ = ["unfold_inputs", "input_hessian", "gptq_codes", "HessianAccumulator"]


def _explicit_padding(module: nn.Module) -> tuple[int, ...]:
    """A conv's padding as numbers: ``"valid"`` is 0, ``"same"`` (stride 1) is
    ``dilation·(k-1)/2`` per side, which needs an even total (an odd one pads one side more,
    which the unfold here cannot express)."""
    pad = module.padding
    if not isinstance(pad, str):
        return tuple(pad)
    if pad == "valid":
        return (0,) * len(module.kernel_size)
    total = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
    if any(t % 2 for t in total):
        raise QdslError(f"GPTQ does not support padding='same' with an even kernel {tuple(module.kernel_size)} "
                        "(it pads one side more): give the layer explicit padding")
    return tuple(t // 2 for t in total)


def unfold_inputs(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A layer's input as ``[groups, d, n]`` columns such that the layer computes
    ``W_g @ X_g`` per group (im2col for Conv1d/Conv2d; rows for Linear)."""
    if isinstance(module, nn.Linear):
        return x.reshape(-1, x.shape[-1]).T.unsqueeze(0)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        if module.padding_mode != "zeros":
            raise QdslError(f"GPTQ does not support padding_mode={module.padding_mode!r}")
        padding = _explicit_padding(module)
        if isinstance(module, nn.Conv1d):
            x = x.unsqueeze(2)
            k, pad, st, dl = (1, module.kernel_size[0]), (0, padding[0]), (1, module.stride[0]), (1, module.dilation[0])
        else:
            k, pad, st, dl = module.kernel_size, padding, module.stride, module.dilation
        u = F.unfold(x, k, dilation=dl, padding=pad, stride=st)  # [N, Cin·k, L]
        g = module.groups
        u = u.reshape(u.shape[0], g, u.shape[1] // g, u.shape[2])  # channels are group-major
        return u.permute(1, 2, 0, 3).reshape(g, u.shape[2], -1)
    raise QdslError(f"GPTQ supports Linear, Conv1d and Conv2d, not {type(module).__name__}")


class HessianAccumulator:
    """Running ``H = X Xᵀ / n`` per group (float64) over calibration batches."""

    def __init__(self) -> None:
        self.h: torch.Tensor | None = None
        self.n = 0

    def add(self, module: nn.Module, x: torch.Tensor) -> None:
        cols = unfold_inputs(module, x.detach()).to(torch.float64)  # [g, d, n]
        h = cols @ cols.transpose(1, 2)
        self.h = h if self.h is None else self.h + h
        self.n += cols.shape[2]

    def value(self) -> torch.Tensor:
        if self.h is None:
            raise QdslError("no calibration inputs reached this layer")
        return self.h / max(self.n, 1)


def input_hessian(module: nn.Module, inputs) -> torch.Tensor:
    """``[groups, d, d]`` Hessian of the layer's output error from an iterable of inputs."""
    acc = HessianAccumulator()
    for x in inputs:
        acc.add(module, x)
    return acc.value()


def gptq_codes(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    *,
    act_order: bool = True,
    damp: float = 0.01,
) -> torch.Tensor:
    """Integer codes (int64, shape of ``weight``) for a weight with per-output-channel
    (shape ``[C]``) or per-tensor (``[]``) ``scale``/``zero_point`` on ``qmin..qmax``.

    ``hessian`` is ``[groups, d, d]`` (or ``[d, d]``) from :func:`input_hessian`; output
    channel ``c`` belongs to group ``c // (C / groups)``.  Dequantized codes are
    ``(q - zero_point) · scale``.

    >>> g = torch.Generator().manual_seed(0)
    >>> w, x = torch.randn(8, 16, generator=g), torch.randn(16, 500, generator=g)
    >>> s = w.abs().amax(1) / 3
    >>> q = gptq_codes(w, x @ x.T / 500, s, torch.zeros(8), -4, 3)
    >>> rtn = torch.clamp(torch.round(w / s[:, None]), -4, 3)
    >>> err = lambda c: float(((w - c * s[:, None]) @ x).pow(2).sum())
    >>> err(q) < err(rtn), int(q.min()) >= -4, int(q.max()) <= 3
    (True, True, True)
    """
    c_out = weight.shape[0]
    w_all = weight.detach().reshape(c_out, -1).to(torch.float64)
    h_all = hessian if hessian.dim() == 3 else hessian.unsqueeze(0)
    groups, d = h_all.shape[0], h_all.shape[1]
    if c_out % groups or w_all.shape[1] != d:
        raise QdslError(f"weight {tuple(weight.shape)} does not match a Hessian of shape {tuple(h_all.shape)}")
    s_all = torch.as_tensor(scale, dtype=torch.float64).expand(c_out) if torch.as_tensor(scale).dim() == 0 \
        else torch.as_tensor(scale, dtype=torch.float64).reshape(c_out)
    z_all = torch.as_tensor(zero_point, dtype=torch.float64).expand(c_out) if torch.as_tensor(zero_point).dim() == 0 \
        else torch.as_tensor(zero_point, dtype=torch.float64).reshape(c_out)
    per = c_out // groups
    out = torch.empty(c_out, d, dtype=torch.int64)
    for gi in range(groups):
        rows = slice(gi * per, (gi + 1) * per)
        out[rows] = _sweep(w_all[rows].clone(), h_all[gi].to(torch.float64).clone(), s_all[rows], z_all[rows],
                           qmin, qmax, act_order, damp)
    return out.reshape(weight.shape)


def _sweep(w, h, s, z, qmin, qmax, act_order, damp):
    d = h.shape[0]
    dead = torch.diagonal(h) <= 0  # inputs that are always zero: any code is as good
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else torch.arange(d)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diagonal(h).mean() * torch.eye(d, dtype=h.dtype)
    # U: upper Cholesky factor of H⁻¹ (the OBS updates for the remaining columns)
    u = _upper_inverse_cholesky(h)
    s_col, z_col = s.unsqueeze(1), z.unsqueeze(1)
    inv_s = 1.0 / s_col
    q = torch.empty_like(w)
    for i in range(d):
        col = w[:, i : i + 1]
        qi = torch.clamp(torch.round(col * inv_s) + z_col, qmin, qmax)
        q[:, i : i + 1] = qi
        err = (col - (qi - z_col) * s_col) / u[i, i]
        w[:, i + 1 :] -= err * u[i, i + 1 :].unsqueeze(0)
    return q[:, torch.argsort(perm)].to(torch.int64)


def _upper_inverse_cholesky(h: torch.Tensor) -> torch.Tensor:
    # retry with more damping if H is numerically indefinite (tiny calibration sets)
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    extra = 0.0
    for _ in range(6):
        chol, info = torch.linalg.cholesky_ex(h + extra * eye)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(chol)
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                return u
        extra = max(extra * 10, 1e-6 * float(torch.diagonal(h).mean()))
    raise QdslError("GPTQ: the input Hessian is not positive definite even with damping")

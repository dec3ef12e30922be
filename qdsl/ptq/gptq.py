"""GPTQ learned rounding for one layer: integer weight codes that minimise the layer's
output error on calibration inputs, on a *fixed* grid (scale/zero point chosen before).

Why GPTQ rather than AdaRound: both learn the rounding layer by layer from calibration
data, but AdaRound optimises a soft rounding mask by gradient descent (thousands of
steps per layer), while GPTQ (Frantar et al., 2022, "GPTQ: accurate post-training
quantization for generative pre-trained transformers", after Optimal Brain Quantization)
is closed-form: one Cholesky factorisation and one sweep over the input columns per
layer.  Codes may move by more than one step from nearest rounding (errors are pushed
onto later columns).

The math (per layer, weight ``W`` as ``[C_out, d]`` rows, inputs ``X`` as ``[d, n]``
columns - for a conv, the im2col patches)::

    minimise  || W X - Ŵ X ||²  over Ŵ on the grid      H = X Xᵀ / n  (+ damp · mean(diag H) · I)
    for each column i (in order; by decreasing diag H with act_order):
        ŵ_i   = fake_quant(w'_i)                         (the scale of column i's row/group)
        e_i   = (w'_i - ŵ_i) / U_ii                      U = upper Cholesky factor of H⁻¹
        w'_j -= e_i · U_ij   for j > i                   (spread the error onto the rest)

How it is computed here (same result, cheaper).  Unrolling the recurrence gives
``W - Ŵ = E U``, i.e. ``E = (W - Ŵ) U⁻¹``, and ``U⁻¹ = R`` where ``H = R Rᵀ`` with ``R``
upper triangular.  Hence, with ``Δ = W - Ŵ`` on the *original* weights::

    w'_i = w_i + (Σ_{k<i} Δ_k R_ki) / R_ii

so no inverse is needed, only one Cholesky factor.  ``R`` is the lower Cholesky factor
``L`` of ``H`` in *reversed* column order (``R = J L J``), so the columns are stored in
reversed processing order and swept from the last index down; then every read of ``L``
is a plain slice.  The sweep is blocked ("lazy batch"): the contribution of all finished
columns to a block of ``block`` columns is one matrix product ``Δ_done @ L[done, block]``,
and inside the block a rank-1 update per column touches only that block.

Memory, per layer: the Hessian is accumulated per calibration batch (a conv's im2col is
built per chunk of at most ``2^24`` elements, never for all data), then permuted and
factorised *in place* (a blocked left-looking Cholesky that writes only the lower
triangle, so the untouched upper triangle restores ``H`` for a retry with more damping):
one ``d × d`` matrix plus ``O(C_out · d)`` for the weights, deltas and codes.  Precision:
float64 when the matrix is small (``d <= FLOAT64_MAX_D``: it costs nothing there), float32
above (the reference GPTQ runs in float32; the 1 % damping bounds the condition number).
Cost: ``O(n d²)`` for the Hessian, ``d³/3`` for the factorisation, ``O(C_out · d²)`` in
matrix products for the sweep.  Grouped convolutions run it once per group.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from qdsl.quantizers.functional import reciprocal
from qdsl.spec.diagnostics import QdslError

__all__ = ["FLOAT64_MAX_D", "unfold_inputs", "input_hessian", "gptq_codes", "gptq_damped", "HessianAccumulator"]

FLOAT64_MAX_D = 2048
"""Hessians of at most this many inputs (per group) are accumulated and factorised in
float64, larger ones in float32 (half the memory; see the module docstring)."""

_CHUNK_ELEMENTS = 1 << 24
"""Largest im2col chunk built at once (64 MB in float32)."""


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
    ``W_g @ X_g`` per group (im2col for Conv1d/Conv2d; rows for Linear, any leading dims)."""
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


def _column_chunks(module: nn.Module, x: torch.Tensor) -> Iterator[torch.Tensor]:
    """:func:`unfold_inputs` in pieces of at most ``_CHUNK_ELEMENTS`` (split along the rows
    of a Linear's input, along the batch of a conv's), so a big layer never holds the
    im2col of a whole batch."""
    if isinstance(module, nn.Linear):
        rows = x.reshape(-1, x.shape[-1])
        step = max(1, _CHUNK_ELEMENTS // max(rows.shape[1], 1))
        for r in range(0, rows.shape[0], step):
            yield rows[r : r + step].T.unsqueeze(0)
        return
    if x.dim() == module.weight.dim() - 1:  # unbatched conv input
        x = x.unsqueeze(0)
    one = unfold_inputs(module, x[:1])
    step = max(1, _CHUNK_ELEMENTS // max(one.numel(), 1))
    yield one
    for r in range(1, x.shape[0], step):
        yield unfold_inputs(module, x[r : r + step])


class HessianAccumulator:
    """Running ``H = X Xᵀ / n`` per group over calibration batches (float64 up to
    :data:`FLOAT64_MAX_D` inputs, else float32; ``dtype`` overrides).

    Only the lower triangle is accumulated (the matrix is symmetric: about half the
    multiply-adds of ``X Xᵀ``, which dominates GPTQ's cost on wide layers); :meth:`value`
    and :meth:`take` mirror it into the upper one."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.h: torch.Tensor | None = None
        self.n = 0
        self.dtype = dtype

    def add(self, module: nn.Module, x: torch.Tensor) -> None:
        with torch.no_grad():
            for cols in _column_chunks(module, x.detach()):
                if self.h is None:
                    g, d = cols.shape[0], cols.shape[1]
                    dtype = self.dtype or (torch.float64 if d <= FLOAT64_MAX_D else torch.float32)
                    self.h = torch.zeros(g, d, d, dtype=dtype)
                for gi in range(cols.shape[0]):
                    _gram_lower_(self.h[gi], cols[gi].to(self.h.dtype).contiguous())
                self.n += cols.shape[2]

    def value(self) -> torch.Tensor:
        """A copy of the current ``[groups, d, d]`` mean."""
        if self.h is None:
            raise QdslError("no calibration inputs reached this layer")
        h = self.h / max(self.n, 1)
        for hg in h:
            _mirror_lower_(hg)
        return h

    def take(self) -> torch.Tensor:
        """The mean without a copy; the accumulator lets go of it (and is empty after)."""
        if self.h is None:
            raise QdslError("no calibration inputs reached this layer")
        h, self.h = self.h, None
        h /= max(self.n, 1)
        for hg in h:
            _mirror_lower_(hg)
        self.n = 0
        return h


_GRAM_BLOCK = 512


def _gram_lower_(h: torch.Tensor, x: torch.Tensor) -> None:
    """``h += x xᵀ`` on the lower triangle (block columns; the strict upper triangle of
    the diagonal blocks gets values too, the rest of the upper triangle none)."""
    d = x.shape[0]
    for i in range(0, d, _GRAM_BLOCK):
        e = min(i + _GRAM_BLOCK, d)
        h[i:, i:e].addmm_(x[i:], x[i:e].T)


def _mirror_lower_(h: torch.Tensor) -> None:
    """Upper triangle := lower triangle, in place, a block of rows at a time."""
    d = h.shape[0]
    for r in range(0, d, _GRAM_BLOCK):
        e = min(r + _GRAM_BLOCK, d)
        h[r:e, e:] = h[e:, r:e].T
        blk = h[r:e, r:e]
        low = torch.tril(blk, -1)
        blk.copy_(low + low.T + torch.diag(torch.diagonal(blk)))


def input_hessian(module: nn.Module, inputs) -> torch.Tensor:
    """``[groups, d, d]`` Hessian of the layer's output error from an iterable of inputs."""
    acc = HessianAccumulator()
    for x in inputs:
        acc.add(module, x)
    return acc.value()


def _per_row(p, c_out: int, dtype) -> torch.Tensor:
    """A ``[]``/``[C]``/``[C, G]`` scale or zero point as ``[C, G]`` (G = 1 unless groups)."""
    p = torch.as_tensor(p).detach()
    if p.dim() == 0:
        p = p.expand(c_out)
    return p.reshape(c_out, -1).to(dtype)


def gptq_codes(
    weight: torch.Tensor,
    hessian: torch.Tensor | HessianAccumulator,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    *,
    act_order: bool = True,
    damp: float = 0.01,
    block: int = 128,
) -> torch.Tensor:
    """Integer codes (int64, shape of ``weight``) for a weight with a per-tensor (``[]``),
    per-output-channel (``[C]``) or group-wise (``[C, G]``, groups along
    ``weight.reshape(C, -1)`` as in :func:`qdsl.quantizers.functional.group_view`)
    ``scale``/``zero_point`` on ``qmin..qmax``.  Dequantized codes are
    ``(q - zero_point) · scale``; column ``j`` of a row uses its group's ``(s, z)``.

    ``hessian`` is ``[groups, d, d]`` (or ``[d, d]``) from :func:`input_hessian` (left
    unchanged), or a :class:`HessianAccumulator`, whose matrix is then factorised in place
    and released (the low-memory path).  Output channel ``c`` belongs to conv group
    ``c // (C / groups)``.  ``damp``: added to the diagonal, relative to its mean.
    ``block``: columns per lazy-batch block.

    >>> g = torch.Generator().manual_seed(0)
    >>> w, x = torch.randn(8, 16, generator=g), torch.randn(16, 500, generator=g)
    >>> s = w.abs().amax(1) / 3
    >>> q = gptq_codes(w, x @ x.T / 500, s, torch.zeros(8), -4, 3)
    >>> rtn = torch.clamp(torch.round(w / s[:, None]), -4, 3)
    >>> err = lambda c: float(((w - c * s[:, None]) @ x).pow(2).sum())
    >>> err(q) < err(rtn), int(q.min()) >= -4, int(q.max()) <= 3
    (True, True, True)
    """
    with contextlib.closing(gptq_damped(weight, hessian, scale, zero_point, qmin, qmax, (damp,),
                                        act_order=act_order, block=block)) as codes:
        return next(codes)[1]


def gptq_damped(
    weight: torch.Tensor,
    hessian: torch.Tensor | HessianAccumulator,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    damps: Sequence[float],
    *,
    act_order: bool = True,
    block: int = 128,
) -> Iterator[tuple[float, torch.Tensor]]:
    """:func:`gptq_codes` for each relative damping in ``damps`` in turn, lazily, as
    ``(damp, codes)``: a caller searching for the damping stops iterating (and closes the
    iterator) once it has what it wants.

    Why a search: with fewer calibration positions than inputs, ``H`` is singular and GPTQ
    fitted at the usual 1 % damping pushes the rounding error into directions the data
    never showed, so it does worse than nearest rounding on other data.  More damping moves
    GPTQ towards nearest rounding (infinite damping *is* nearest rounding), and somewhere in
    between it beats both; :mod:`qdsl.ptq.rounding` picks the damping on held-back data.

    Cost per candidate: one factorisation and one sweep; the Hessian is permuted once, and
    between candidates its lower triangle is restored from the upper one, which the
    factorisation leaves untouched, so there is still one ``d × d`` matrix per group."""
    owned = isinstance(hessian, HessianAccumulator)
    h_all = hessian.take() if owned else hessian
    h_all = h_all if h_all.dim() == 3 else h_all.unsqueeze(0)
    c_out = weight.shape[0]
    groups, d = h_all.shape[0], h_all.shape[1]
    w_all = weight.detach().reshape(c_out, -1)
    if c_out % groups or w_all.shape[1] != d:
        raise QdslError(f"weight {tuple(weight.shape)} does not match a Hessian of shape {tuple(h_all.shape)}")
    dtype = h_all.dtype if h_all.dtype in (torch.float32, torch.float64) else torch.float32
    # the proxy rounds x · reciprocal(s) (float32): the same multiplier here, so in float32
    # a layer whose inputs are uncorrelated gets exactly its nearest rounding
    s_all, z_all = _per_row(scale, c_out, torch.float32), _per_row(zero_point, c_out, torch.float32)
    inv_all = reciprocal(s_all)
    n_scale_groups = s_all.shape[1]
    if d % n_scale_groups:
        raise QdslError(f"{n_scale_groups} scale groups do not divide the {d} inputs of a row")
    group_size = d // n_scale_groups
    per = c_out // groups
    # per conv group, once prepared: (matrix, processing order, undamped diagonal); kept
    # for the next candidate only if there is one (a caller's matrix is copied per group)
    prepared: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * groups
    for k, damp in enumerate(damps):
        more = k + 1 < len(damps)
        out = torch.empty(c_out, d, dtype=torch.int64)
        for gi in range(groups):
            rows = slice(gi * per, (gi + 1) * per)
            if prepared[gi] is None:
                h = h_all[gi] if owned else h_all[gi].to(dtype, copy=True)
                order, base = _prepare(h, act_order, block)
            else:
                h, order, base = prepared[gi]
                _restore_lower_(h, base, block)
            chol = _factor(h, base, damp, block)
            out[rows] = _sweep(w_all[rows].to(dtype), chol, order, s_all[rows], inv_all[rows], z_all[rows],
                               group_size, qmin, qmax, block)
            prepared[gi] = (h, order, base) if more else None
            del chol, h
        yield damp, out.reshape(weight.shape)


def _prepare(h: torch.Tensor, act_order: bool, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``h`` (one group's ``[d, d]`` Hessian) permuted into *reversed* processing
    order; returns ``(order, diagonal)`` with ``order[r]`` the original column at position
    ``r`` and the permuted, undamped diagonal.  An input that is always zero (``H_ii = 0``)
    gets ``H_ii = 1``: its row of the factor is then zero off the diagonal, so its code is
    nearest rounding and it moves no other column."""
    d = h.shape[0]
    diag = torch.diagonal(h)
    diag[diag <= 0] = 1.0
    # act_order: largest diag H first in processing order = last in the stored order
    order = torch.argsort(diag, stable=True) if act_order else torch.arange(d - 1, -1, -1)
    _permute_symmetric_(h, order, block)
    return order, torch.diagonal(h).clone()


def _factor(h: torch.Tensor, base: torch.Tensor, damp: float, block: int) -> torch.Tensor:
    """In place: ``h`` (prepared, its lower triangle intact) becomes the lower Cholesky
    factor of itself with ``damp · mean(base)`` added to the diagonal ``base``; retried
    with 10× the damping while it is not numerically positive definite (the untouched upper
    triangle restores the lower one in between)."""
    diag = torch.diagonal(h)
    extra = damp * float(base.mean())
    for _ in range(8):
        diag.copy_(base + extra)
        if _cholesky_lower_(h, block):
            return h
        _restore_lower_(h, base, block)
        extra = max(extra * 10, 1e-6 * float(base.mean()))
    raise QdslError("GPTQ: the input Hessian is not positive definite even with damping")


def _permute_symmetric_(a: torch.Tensor, order: torch.Tensor, block: int) -> None:
    """``a[:] = a[order][:, order]``, above ``FLOAT64_MAX_D`` without a second ``d × d``
    matrix: columns permuted a chunk of rows at a time, rows moved along the permutation's
    cycles."""
    d = a.shape[0]
    if torch.equal(order, torch.arange(d)):
        return
    if d <= FLOAT64_MAX_D:  # small: a temporary copy costs less than walking the cycles in Python
        a.copy_(a[order[:, None], order[None, :]])
        return
    step = max(1, _CHUNK_ELEMENTS // (4 * d))
    for r in range(0, d, step):
        a[r : r + step] = a[r : r + step].index_select(1, order)
    src = order.tolist()
    seen = [False] * d
    for start in range(d):
        if seen[start] or src[start] == start:
            continue
        tmp = a[start].clone()
        i = start
        while True:
            seen[i] = True
            if src[i] == start:
                a[i] = tmp
                break
            a[i] = a[src[i]]
            i = src[i]


def _cholesky_lower_(a: torch.Tensor, block: int) -> bool:
    """Blocked left-looking Cholesky in place: the lower triangle (with the diagonal) of
    ``a`` becomes ``L`` (``a = L Lᵀ``); the strict upper triangle is neither read nor
    written.  False (``a`` partly overwritten) if ``a`` is not numerically positive definite."""
    d = a.shape[0]
    bs = max(block, 256)
    for j in range(0, d, bs):
        e = min(j + bs, d)
        panel = a[j:, j:e]
        if j:
            panel = panel - a[j:, :j] @ a[j:e, :j].T
        diag_block = torch.tril(panel[: e - j]) + torch.tril(panel[: e - j], -1).T
        ljj, info = torch.linalg.cholesky_ex(diag_block)
        if int(info) != 0 or not bool(torch.isfinite(ljj).all()):
            return False
        blk = a[j:e, j:e]
        blk.copy_(torch.where(torch.ones_like(ljj, dtype=torch.bool).tril(), ljj, blk))
        if e < d:
            a[e:, j:e] = torch.linalg.solve_triangular(ljj.T, panel[e - j :], upper=True, left=False)
    return True


def _restore_lower_(a: torch.Tensor, diag: torch.Tensor, block: int) -> None:
    """Undo a failed :func:`_cholesky_lower_`: the lower triangle from the untouched upper."""
    d = a.shape[0]
    for r in range(0, d, block):
        e = min(r + block, d)
        a[r:e, :r] = a[:r, r:e].T
        blk = a[r:e, r:e]
        up = torch.triu(blk, 1)
        blk.copy_(up + up.T + torch.diag(diag[r:e]))


def _sweep(w, chol, order, s, inv, z, group_size, qmin, qmax, block):
    """Codes for one group's rows ``w`` ``[C, d]`` (see the module docstring for the
    reversed-order formula); ``s``/``inv``/``z`` are ``[C, G]`` (float32).  Works on the
    transposed weight (``[d, C]``) so that a column is one contiguous row."""
    c, d = w.shape
    dtype = chol.dtype
    wt = w.T.index_select(0, order)  # [d, C], stored order
    delta = torch.zeros_like(wt)  # Δ = W - Ŵ of the columns done so far
    codes = torch.empty(d, c, dtype=dtype)
    col_group = order // group_size
    st, it, zt = s.T.contiguous(), inv.T.contiguous(), z.T.contiguous()  # [G, C]
    diag = torch.diagonal(chol)
    for b in range(d, 0, -block):
        a = max(0, b - block)
        acc = chol[b:, a:b].T @ delta[b:] if b < d else torch.zeros(b - a, c, dtype=dtype)
        acc /= diag[a:b, None]
        lblk = chol[a:b, a:b] / diag[a:b]  # row j: the update to columns a..a+j-1, pre-divided
        gcols = col_group[a:b]
        sb, ib, zb = st[gcols].to(dtype), it[gcols].to(dtype), zt[gcols].to(dtype)
        wb = wt[a:b]
        off = wb + zb * sb  # Δ = w - (q - z)·s = off - q·s
        for j in range(b - a - 1, -1, -1):
            r = a + j
            target = acc[j].add_(wb[j])
            qc = torch.mul(target, ib[j], out=codes[r]).round_().add_(zb[j]).clamp_(qmin, qmax)
            err = torch.addcmul(off[j], qc, sb[j], value=-1, out=delta[r])
            if j:
                acc[:j].addr_(lblk[j, :j], err)
    out = torch.empty(c, d, dtype=torch.int64)
    out[:, order] = codes.T.to(torch.int64)
    return out

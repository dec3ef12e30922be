"""``accumulator(bits=P, constrain=true)``: weights that no input in range can overflow.

The bound (A2Q, Colbert et al. 2023, stated for our codes).  A layer's output channel sums
``S = Σ_i w_i·x_i + b`` over integer weights ``w_i`` (zero point 0: symmetric weights) and
zero-point-corrected input codes ``x_i ∈ [x_lo, x_hi]`` (``x_lo = qmin − z ≤ 0 ≤ x_hi =
qmax − z``).  ``S`` is linear in ``x``, so over the input box its extremes are at vertices::

    max S = x_hi·Σ_{w>0} w + x_lo·Σ_{w<0} w + b = x_hi·‖w⁺‖₁ + |x_lo|·‖w⁻‖₁ + b
    min S = x_lo·‖w⁺‖₁ + x_hi·Σ_{w<0} w + b = −(|x_lo|·‖w⁺‖₁ + x_hi·‖w⁻‖₁) + b

and no input can overflow a P-bit signed accumulator iff ``max S ≤ 2^(P−1) − 1`` and
``min S ≥ −2^(P−1)``.  Special cases:

* signed symmetric inputs (``|x| ≤ M``), no bias: both read ``M·‖w‖₁ ≤ 2^(P−1) − 1``, i.e.
  A2Q's ``‖w‖₁ ≤ (2^(P−1) − 1) / max|x|``;
* unsigned inputs (``x ∈ [0, 2^N − 1]``, ``z = 0``): the positive and negative parts are
  bounded separately, ``‖w⁺‖₁ ≤ (2^(P−1) − 1)/(2^N − 1)`` and ``‖w⁻‖₁ ≤ 2^(P−1)/(2^N − 1)``,
  so ``‖w‖₁`` may reach about twice the signed bound, ``(2^P − 2)/(2^N − 1)`` when the two
  parts are balanced: the tighter (exact) form for unsigned inputs.

This module checks the exact two-sided form (with the bias), never a looser sufficient one.

PTQ projection (at freeze, after the weight quantizer fixed its scale ``s_c``).  A channel
that violates the bound is re-quantized at a coarser scale ``s'_c = k·s_c`` (``k > 1``):
``w' = clamp(round(w / s'_c))``, the derived bias ``round(b / (s_x·s'_c))`` shrinking with
it.  This keeps the real weights (only their resolution drops) rather than shrinking the
channel's gain, and ``k`` is the smallest found by bisection for which the exact bound holds
(with one code of margin for the bias's rounding), rounded up to a power of two for
power-of-two scales; a per-tensor scale takes the largest ``k`` of its channels.  After the
bias is frozen the bound is checked again exactly on the final codes (an error if it
fails).  The alternative projection at the same scale (soft-thresholding the codes, the
Euclidean projection onto the L1 ball) was tried on the digits ResNet at 14 bits and lost
on every channel: at the fine scale the folded bias alone, ``b / (s_x·s_c)``, already
leaves most channels' range, and where it did not, the coarser scale changed the weights
less (L2).  The cost is reported per layer (:func:`constraint_report`): channels changed and
the fraction of the integer L1 norm kept, ``Σ|w'| / Σ|w|``.

QAT: the projection runs at freeze, so QAT trains unconstrained and is projected at the
end; an A2Q norm parametrization during training is not implemented yet.
"""

from __future__ import annotations

import attrs
import torch

from qdsl.patch.accumulate import fits, reachable
from qdsl.spec.diagnostics import QdslError

__all__ = ["ConstraintCost", "constrain_weights", "check_constrained", "constraint_report"]

_POT_SCALES = ("pot", "pot_ceil", "learned_pot")


@attrs.frozen
class ConstraintCost:
    """What ``constrain=true`` changed in one layer."""

    fqn: str
    bits: int
    channels: int
    constrained: int
    """Output channels whose weights were re-quantized at a coarser scale."""
    l1_kept: float
    """``Σ|w'| / Σ|w|`` of the integer weights over the layer (1.0: nothing clipped)."""
    max_scale_factor: float
    """The largest ``s'_c / s_c``."""


def _x_ranges(iq) -> list[tuple[int, int]]:
    z = iq.zero_point.reshape(-1)
    if iq.dynamic or z.numel() != 1:
        r = iq.recipe
        return list(iq.format.operand_ranges(r.bits, r.signed, r.narrow_range, r.symmetric))
    return [(int(iq.qmin) - int(z[0]), int(iq.qmax) - int(z[0]))]


def _codes(w: torch.Tensor, s: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    view = s.reshape((-1,) + (1,) * (w.dim() - 1)) if s.numel() > 1 else s.reshape(())
    return torch.round(w.double() / view).clamp(qmin, qmax).to(torch.int64)


def _ok(w, b, s, s_x, ranges, qmin, qmax, bits) -> torch.Tensor:
    q = _codes(w, s, qmin, qmax)
    bi = None if b is None else torch.round(b.double() / (s_x * s)).to(torch.int64)
    lo, hi = reachable(q, bi, ranges)
    if bi is not None:  # one code of margin: the frozen bias rounds at a float32 scale
        lo, hi = lo - 1, hi + 1
    return fits(lo, hi, bits)


def constrain_weights(patch, w: torch.Tensor, b: torch.Tensor | None) -> ConstraintCost:
    """Project ``patch``'s frozen weight quantizer onto the bound (module doc)."""
    wq, iq, bits = patch.wq, patch.iq, patch.plan.accumulator.bits
    where = f"'{patch.fqn}': accumulator(constrain=true)"
    if iq is None or wq is None or not wq.format.fixed_codes or wq.group_size is not None:
        raise QdslError(f"{where} needs an int weight (per tensor or per channel) and an input quantizer")
    if bool((wq.zero_point != 0).any()) or (wq.axis not in (None, 0)):
        raise QdslError(f"{where} needs symmetric weights with scales on the output channels (axis 0)")
    if iq.dynamic:
        raise QdslError(f"{where} needs a static input quantizer (its range bounds the sums)")
    w = w.detach().double()
    b = None if b is None else b.detach().double().reshape(-1)
    ranges = _x_ranges(iq)
    s_x = float(iq.scale.reshape(-1)[0])
    qmin, qmax = int(wq.qmin), int(wq.qmax)
    s0 = wq.scale.detach().double().reshape(-1)
    s = s0.expand(w.shape[0]).clone() if s0.numel() == 1 else s0.clone()
    q0 = _codes(w, s, qmin, qmax)
    ok = _ok(w, b, s, s_x, ranges, qmin, qmax, bits)
    k = torch.ones_like(s)
    if not bool(ok.all()):
        bad = ~ok
        lo_k, hi_k = torch.ones_like(s), torch.ones_like(s)
        for _ in range(200):  # bracket: double until every channel fits (all codes 0 fit)
            grow = bad & ~_ok(w, b, s * hi_k, s_x, ranges, qmin, qmax, bits)
            if not bool(grow.any()):
                break
            hi_k = torch.where(grow, hi_k * 2, hi_k)
        for _ in range(48):  # bisection on each failing channel: hi_k fits, lo_k does not
            mid = (lo_k + hi_k) / 2
            good = _ok(w, b, s * mid, s_x, ranges, qmin, qmax, bits)
            hi_k = torch.where(bad & good, mid, hi_k)
            lo_k = torch.where(bad & ~good, mid, lo_k)
        k = torch.where(bad, hi_k, k)
    if s0.numel() == 1:
        k = k.max().expand_as(k)
    s_new = s * k
    if wq.recipe.scale in _POT_SCALES:
        s_new = torch.exp2(torch.ceil(torch.log2(s_new)))
    for _ in range(64):  # a power-of-two or shared scale can land on a non-monotone point
        still = ~_ok(w, b, s_new, s_x, ranges, qmin, qmax, bits)
        if not bool(still.any()):
            break
        grown = s_new * (2.0 if wq.recipe.scale in _POT_SCALES else 1.0 + 1e-3)
        s_new = torch.where(still, grown, s_new) if s0.numel() > 1 else grown
    fixed = wq.codes.to(torch.int64) if wq.codes.numel() else None
    for _ in range(64):
        # install, then verify on the proxy's own codes (it divides in binary32: a code at a
        # .5 tie can round the other way than the binary64 search above)
        changed = s_new != s
        if not bool(changed.any()):
            break
        with torch.no_grad():
            wq.scale = (s_new[:1] if s0.numel() == 1 else s_new).to(torch.float32).reshape(wq.scale.shape).clone()
            if fixed is not None:  # fixed (learned-rounding) codes: re-round the changed channels
                wq.codes = torch.empty(0, dtype=torch.int64)
                wq._refresh()
                q = torch.where(changed.reshape((-1,) + (1,) * (w.dim() - 1)), wq.int_repr(w.float()).to(torch.int64),
                                fixed)
                wq.set_codes(q)
            wq._refresh()
        q1 = wq.int_repr(w.float()).to(torch.int64)
        s32 = wq.scale.double().reshape(-1)
        bi = None if b is None else torch.round(b / (s_x * s32)).to(torch.int64)
        lo, hi = reachable(q1, bi, ranges)
        if bi is not None:
            lo, hi = lo - 1, hi + 1
        still = ~fits(lo, hi, bits)
        if not bool(still.any()):
            break
        grown = s_new * (2.0 if wq.recipe.scale in _POT_SCALES else 1.0 + 1e-3)
        s_new = torch.where(still, grown, s_new) if s0.numel() > 1 else grown
    q1 = wq.int_repr(w.float()).to(torch.int64)
    l1_before = float(q0.abs().sum())
    return ConstraintCost(patch.fqn, bits, int(s.numel()), int(changed.sum()),
                          float(q1.abs().sum()) / l1_before if l1_before else 1.0,
                          float((s_new / s).max()))


def check_constrained(patch) -> None:
    """The bound, exactly, on the frozen layer's final integer weights and bias codes (as
    export writes them: ``rint(b̂ / (s_x·s_w))``); an error if any input could overflow."""
    from qdsl.patch.frozen import frozen_layer

    rec = frozen_layer(patch)
    wq, iq = patch.wq, patch.iq
    q = rec.weight_codes.to(torch.int64)  # symmetric: zero point 0 (constrain_weights checked)
    s_acc = float(iq.scale.reshape(-1)[0]) * wq.scale.detach().double().reshape(-1)
    b = None
    if rec.bias_float is not None:
        b_hat = patch.module.bias
        b = torch.round(b_hat.detach().double().reshape(-1) / s_acc).to(torch.int64)
    lo, hi = reachable(q, b, _x_ranges(iq))
    bits = patch.plan.accumulator.bits
    bad = ~fits(lo, hi, bits)
    if bool(bad.any()):
        c = int(bad.nonzero()[0])
        raise QdslError(f"'{patch.fqn}': accumulator(constrain=true) failed its exact check: channel {c} reaches "
                        f"[{int(lo[c])}, {int(hi[c])}], beyond {bits} bits (please report this)")


def constraint_report(model) -> list[ConstraintCost]:
    """Per constrained layer, what the constraint cost (frozen models)."""
    from qdsl.patch.handle import get_handle

    out = []
    for patch in get_handle(model).layers.values():
        cost = getattr(patch, "constraint_cost", None)
        if cost is not None:
            out.append(cost)
    return out


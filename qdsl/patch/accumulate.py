"""The spec's accumulator in the fake-quant model: the same wrap/saturate on the same sums.

The integer graph computes a conv/linear output as (``qdsl.graph.ops.weighted``)::

    S   = Σ (x_q − z_x)·(w_q − z_w)  +  b          exact (int64), b the int32 bias code
    A   = wrap_P(S)  or  sat_P(S)                   P = accumulator(bits=P) of the layer
    y   = rescale(A) ...                            output stage

where ``wrap_P(S) = ((S + 2^(P-1)) mod 2^P) − 2^(P-1)`` and ``sat_P(S) = clamp(S,
−2^(P-1), 2^(P-1) − 1)``.  The bias is added to the *exact* sum and only the total is
wrapped/saturated once (the reference executor and the C++ ``FinishAcc`` both do so).  For
wrap the order cannot matter (wrap is a ring homomorphism mod 2^P); for saturate it does,
and this module follows the graph: saturate the exact total.

A float fake-quant layer computes ``y = Σ x̂·ŵ + b̂`` and never overflows, so with a narrow
accumulator it said nothing about the hardware.  :class:`AccumulatorSim` is a forward
hook (after the layer, before its output quantizer) that replaces ``y`` by ``A · s_acc``,
``s_acc[c] = s_x · s_w[c]`` (binary64, the scale export rescales from):

* integers from the fake-quant tensors: ``x̂ = (q − z)·s_x`` in binary32, so
  ``round(x̂ / s_x) = q − z`` exactly (|q − z| < 2^16 ≪ 2^24); likewise ``w_q − z_w =
  round(ŵ / (s_w·step))`` (``step``: the format's grid step, 1 but for pot);
  ``b = rint(b̂ / s_acc)`` (export's rule for a bias at ``input*weight``);
* the sum ``S`` is the layer's own conv/linear on those integers in binary64: every
  product and partial sum is an integer below 2^53 (checked), so it is exact in any
  summation order;
* **fast path**: per output channel the exact reachable extremes over every input code in
  range (lint's tight bound, :mod:`qdsl.lint.accumulator`)::

      hi_c = Σ_{w>0} w·x_hi + Σ_{w<0} w·x_lo + b_c      lo_c likewise with x_lo/x_hi swapped

  fit in P bits: then no input can overflow and the float output is returned unchanged
  (that is the bit-widths-only case of every default 32-bit model too).

Gradient (QAT).  The forward value is the simulated one; the backward is that of the
float path times the derivative of the overflow function at ``S``:

* wrap: ``d wrap_P(S)/dS = 1`` wherever it is differentiable (everywhere but the jump
  points), so the gradient is the float layer's (a straight-through wrap).  The jump
  itself is not differentiable; training against it is what ``constrain`` (A2Q) is for;
* saturate: the clamp's derivative, 1 inside the range and 0 where ``S`` saturated (as
  the quantizers' own clamp), so a saturated output passes no gradient.

With ``constrain=true`` the layer is not simulated before its weights freeze: the
projection at freeze (qdsl.patch.constrain) guarantees that the deployed weights cannot
overflow, so QAT trains on the exact sums rather than on overflows the hardware will
never see (measured: training through the 16-bit wrap, then projecting, left the digits
ResNet at 41%).  After freeze the bound holds and the fast path applies.

Not simulated (a warning names the layer when its accumulator is narrower than 32 bits): a
layer without an input or weight quantizer (its input scale is not local), group-wise
weight scales or scales along another weight axis than the output channels (no single
``s_acc`` per output channel), transposed convs, and sums whose
range leaves exact binary64 (``|w|·|x|·fan-in >= 2^53``, e.g. power-of-two weights with
wide exponents): those pass their float output through, as before the simulation existed.  While calibrating the input scale still moves, so the layer
passes its float output through.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from qdsl.spec.model import Accumulator, Overflow

__all__ = ["AccumulatorSim", "wrap_sum", "saturate_sum", "needs_simulation", "reachable", "fits"]

_EXACT_F64 = 1 << 53


def wrap_sum(s: torch.Tensor, bits: int) -> torch.Tensor:
    """Two's complement wrap of int64 ``s`` to ``bits`` (``bits >= 64``: unchanged)."""
    if bits >= 64:
        return s
    half = 1 << (bits - 1)
    return torch.remainder(s + half, 1 << bits) - half


def saturate_sum(s: torch.Tensor, bits: int) -> torch.Tensor:
    """``clamp(s, −2^(bits-1), 2^(bits-1) − 1)`` of int64 ``s``."""
    if bits >= 64:
        return s
    half = 1 << (bits - 1)
    return s.clamp(-half, half - 1)


def needs_simulation(acc: Accumulator) -> bool:
    """A 64-bit accumulator holds every exact sum (the graph's are int64): nothing to do."""
    return acc.bits < 64


def reachable(w_int: torch.Tensor, b_int: torch.Tensor | None,
              x_ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel, the exact smallest and largest sum ``Σ w·x + b`` over every input
    code vector in the box (one ``(x_lo, x_hi)`` per candidate zero point): the sum is
    linear in ``x``, so its extremes are at vertices, taken element-wise (module doc)."""
    w = w_int.reshape(w_int.shape[0], -1).to(torch.int64)
    pos = w.clamp(min=0).sum(1)
    neg = w.clamp(max=0).sum(1)
    b = b_int.to(torch.int64) if b_int is not None else torch.zeros_like(pos)
    his = [pos * xh + neg * xl + b for xl, xh in x_ranges]
    los = [pos * xl + neg * xh + b for xl, xh in x_ranges]
    return torch.stack(los).min(0).values, torch.stack(his).max(0).values


def fits(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Per channel: ``[lo, hi]`` inside the ``bits``-bit two's complement range."""
    half = 1 << (bits - 1)
    return (lo >= -half) & (hi <= half - 1)


class _Overflowed(torch.autograd.Function):
    """Value of the simulated output, gradient of the float one (times ``keep``: the
    saturate mask, or None for wrap); see the module doc."""

    @staticmethod
    def forward(ctx, y_float, y_sim, keep):
        ctx.save_for_backward(keep if keep is not None else None)
        ctx.has_keep = keep is not None
        return y_sim

    @staticmethod
    def backward(ctx, g):
        if ctx.has_keep:
            (keep,) = ctx.saved_tensors
            g = g * keep.to(g.dtype)
        return g, None, None


def _channel_view(t: torch.Tensor, ndim: int, axis: int) -> torch.Tensor:
    if t.numel() == 1:
        return t.reshape(())
    shape = [1] * ndim
    shape[axis] = -1
    return t.reshape(shape)


class AccumulatorSim:
    """The forward hook of one layer (see the module doc).

    After each simulated forward, ``overflows`` is the number of output elements whose
    exact sum left the P-bit range (the count ``qdsl run --overflow`` reports for the
    graph); ``simulated`` says whether the exact integer path ran (False: fast path)."""

    enabled = True
    """False: the hook passes the layer's output through (set per instance; block
    reconstruction, :mod:`qdsl.ptq.reconstruct`, fits soft off-grid weights with it off)."""

    def __init__(self, patch) -> None:
        self.patch = patch
        self.acc: Accumulator = patch.plan.accumulator
        self.overflows = 0
        self.simulated = False
        self._warned = False
        self._safe_key: tuple | None = None
        self._safe_refs: tuple | None = None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_safe_key"] = state["_safe_refs"] = None  # ids of this model's tensors
        return state

    # ------------------------------------------------------------ what to use
    def _unsupported(self) -> str | None:
        p = self.patch
        m = p.module
        if not isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return f"a {type(m).__name__} (only Linear and Conv1d/2d/3d are simulated)"
        if p.iq is None or p.wq is None:
            return "no input or weight quantizer on the layer itself"
        if p.wq.group_size is not None:
            return "group-wise weight scales"
        if p.wq.axis is not None and p.wq.axis not in (0, -m.weight.dim()):
            return f"weight scales along axis {p.wq.axis} (not one per output channel)"
        if not (p.iq.format.accumulator_input and p.wq.format.accumulator_weight):
            return f"{p.iq.format.name} inputs × {p.wq.format.name} weights have no integer accumulator"
        return None

    def _warn(self, why: str) -> None:
        # the default 32-bit accumulator is not worth a warning on every model that has such
        # a layer: only a narrower one the user asked for
        if not self._warned and self.acc.bits < 32:
            self._warned = True
            warnings.warn(f"'{self.patch.fqn}': its {self.acc.bits}-bit accumulator is not simulated in the "
                          f"fake-quant model ({why}); the integer graph may differ where it overflows",
                          stacklevel=3)

    def _input_ranges(self, z: torch.Tensor | None) -> list[tuple[int, int]]:
        iq = self.patch.iq
        if z is not None and z.numel() == 1:
            return [(int(iq.qmin) - int(z), int(iq.qmax) - int(z))]
        r = iq.recipe
        return list(iq.format.operand_ranges(r.bits, r.signed, r.narrow_range, r.symmetric))

    # ------------------------------------------------------------------ hook
    def __call__(self, module: nn.Module, args: tuple, output):
        if torch.compiler.is_compiling():
            return self._traced(module, args, output)
        self.simulated = False
        self.overflows = 0
        p = self.patch
        if not self.enabled or not isinstance(output, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
            return None
        why = self._unsupported()
        if why is not None:
            self._warn(why)
            return None
        iq, wq = p.iq, p.wq
        if getattr(iq, "observing", False) or not iq.enabled or not wq.enabled:
            return None
        if self.acc.constrain and not wq.frozen:
            return None  # the projection at freeze removes every overflow: train on the exact sums
        s_x = iq.current_scale()
        w_hat = module.weight
        s_w = wq.current_scale()
        if s_x is None or s_w is None:
            return None  # nothing quantized yet (an uncalibrated static input passes through)
        if s_x.numel() != 1:
            self._warn("a per-channel input scale")
            return None
        b_hat = module.bias
        z = iq.zero_point if iq.frozen and not iq.dynamic else None
        # a frozen layer reuses its module.weight/bias tensors: decide (and derive) once
        key = (id(w_hat), w_hat._version, id(b_hat), b_hat._version if b_hat is not None else None,
               float(s_x.reshape(-1)[0]), id(s_w), s_w._version, None if z is None else int(z.reshape(-1)[0]))
        if self._safe_key is not None and self._safe_key[0] == key:
            safe, ops = self._safe_key[1:]
        else:
            with torch.no_grad():
                ops = self._operands(wq, s_w, s_x, w_hat, b_hat)
                lo, hi = reachable(ops[0], ops[1], self._input_ranges(z))
                safe = bool(fits(lo, hi, self.acc.bits).all())
            # the key names tensors by id: holding them keeps an id from being reused by a
            # new tensor (a QAT step's fresh weight) while the entry lives
            self._safe_key = (key, safe, None if safe else ops)
            self._safe_refs = (w_hat, b_hat, s_w)
        if safe:
            return None
        with torch.no_grad():
            sim = self._simulate(module, args[0], output, *ops)
        if sim is None:
            self._warn("sums beyond an exact binary64 range (|w|·|x|·fan-in >= 2^53)")
            return None
        y, keep = sim
        if not output.requires_grad:
            return y
        return _Overflowed.apply(output, y, keep)

    def _traced(self, module: nn.Module, args: tuple, output):
        """The hook inside a compiled region: the same value and gradient as the eager
        hook, without data-dependent Python.  The fast-path decision (every channel's
        reachable sums fit) is a tensor, and ``torch.cond`` runs the exact simulation only
        when it is false; the branch sees detached tensors (no gradient flows through
        ``cond``), ``_Overflowed`` carries the gradient as in eager.  Not kept up to
        date here: ``overflows``/``simulated`` (eager-only counters), the per-weight
        decision cache, the warnings, and the check that sums stay exact in binary64
        (``|w|·|x|·fan-in < 2^53``; only very wide power-of-two weights come near it)."""
        p = self.patch
        if not isinstance(output, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
            return None
        if self._unsupported() is not None:
            return None
        iq, wq = p.iq, p.wq
        if iq.observing or not iq.enabled or not wq.enabled or (self.acc.constrain and not wq.frozen):
            return None
        s_x, s_w = iq.current_scale(), wq.current_scale()
        if s_x is None or s_w is None or s_x.numel() != 1:
            return None
        z = iq.zero_point if iq.frozen and not iq.dynamic else None
        if z is not None and z.numel() == 1:
            zt = z.reshape(()).to(torch.int64)
            ranges = [(iq.qmin - zt, iq.qmax - zt)]
        else:
            r = iq.recipe
            ranges = list(iq.format.operand_ranges(r.bits, r.signed, r.narrow_range, r.symmetric))
        bits = self.acc.bits
        saturate = self.acc.overflow is Overflow.SATURATE
        linear = isinstance(module, nn.Linear)
        with torch.no_grad():
            w_int, b_int, s_x64, s_acc = self._operands(wq, s_w, s_x, module.weight, module.bias)
            lo, hi = reachable(w_int, b_int, ranges)
            unsafe = ~fits(lo, hi, bits).all()
            if b_int is None:
                b_int = torch.zeros(w_int.shape[0], dtype=torch.int64, device=w_int.device)
            s_acc = s_acc.expand(w_int.shape[0]) if s_acc.numel() == 1 else s_acc

            # the branches take and return flat tensors: inductor checks a branch operand's
            # strides against those it traced with, and a channels-last conv output failed
            # that check even after .contiguous(); a 1-d tensor has one layout
            x_shape, y_shape, w_shape = tuple(args[0].shape), tuple(output.shape), tuple(w_int.shape)

            def exact(x_flat, y_flat, w_flat, b_int, s_x64, s_acc):
                # binary64 inside the branch: an operand is materialised on every step, and
                # the fast branch (taken almost always) never reads the input
                x_int = torch.round(x_flat.reshape(x_shape).double() / s_x64)
                w = w_flat.reshape(w_shape)
                sums = F.linear(x_int, w) if linear else module._conv_forward(x_int, w, None)
                axis = sums.dim() - 1 if linear else 1
                sums = torch.round(sums).to(torch.int64) + _channel_view(b_int, sums.dim(), axis)
                half = 1 << (bits - 1)
                inside = (sums >= -half) & (sums <= half - 1)
                a = saturate_sum(sums, bits) if saturate else wrap_sum(sums, bits)
                keep = inside if saturate else torch.ones_like(inside)
                y = (a.double() * _channel_view(s_acc, a.dim(), axis)).to(y_flat.dtype)
                return y.reshape(-1), keep.reshape(-1)

            def fast(x_flat, y_flat, w_flat, b_int, s_x64, s_acc):
                return y_flat.clone(), torch.ones(y_flat.shape, dtype=torch.bool, device=y_flat.device)

            y, keep = torch.cond(unsafe, exact, fast,
                                 (args[0].detach().reshape(-1), output.detach().reshape(-1),
                                  w_int.reshape(-1), b_int, s_x64, s_acc.contiguous()))
            y, keep = y.reshape(y_shape), keep.reshape(y_shape)
        if not output.requires_grad:
            return y
        return _Overflowed.apply(output, y, keep)

    @staticmethod
    def _operands(wq, s_w, s_x, w_hat, b_hat):
        """``(w_int, b_int, s_x, s_acc)`` in binary64/int64 (module doc)."""
        step = float(wq.format.grid_step(int(wq.recipe.bits)))
        s_w64 = s_w.detach().double().reshape(-1) * step
        s_x64 = s_x.detach().double().reshape(())
        w_int = torch.round(w_hat.detach().double() / _channel_view(s_w64, w_hat.dim(), 0))
        s_acc = s_x64 * s_w64  # [] or [C]
        b_int = None
        if b_hat is not None:
            b_int = torch.round(b_hat.detach().double() / s_acc).to(torch.int64)
            if s_acc.numel() == 1:
                s_acc = s_acc.expand(b_int.shape)
        return w_int, b_int, s_x64, s_acc

    def _simulate(self, module, x_hat, output, w_int, b_int, s_x64, s_acc):
        x_int = torch.round(x_hat.detach().double() / s_x64)
        wmax = float(w_int.abs().max()) if w_int.numel() else 0.0
        fan_in = w_int[0].numel()
        if wmax * float(x_int.abs().max()) * fan_in >= _EXACT_F64:
            return None  # not exact in binary64 (e.g. wide power-of-two weights): not simulated
        if isinstance(module, nn.Linear):
            s = F.linear(x_int, w_int)
            axis = s.dim() - 1
        else:
            s = module._conv_forward(x_int, w_int, None)
            axis = 1
        s = torch.round(s).to(torch.int64)
        if b_int is not None:
            s = s + _channel_view(b_int, s.dim(), axis)
        bits = self.acc.bits
        half = 1 << (bits - 1)
        inside = (s >= -half) & (s <= half - 1)
        self.overflows = int((~inside).sum())
        self.simulated = True
        if self.acc.overflow is Overflow.SATURATE:
            a, keep = saturate_sum(s, bits), inside
        else:
            a, keep = wrap_sum(s, bits), None
        y = (a.double() * _channel_view(s_acc, a.dim(), axis)).to(output.dtype)
        return y, keep

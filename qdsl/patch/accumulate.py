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
* **width bound** (:func:`qdsl.patch.accumulator_sums.width_bound`): before reading any
  weight, lint's exact worst case over every code the quantizers can produce,
  ``fan_in · max|corner product|`` of the weight and input operand ranges (zero points
  included).  It contains every ``[lo_c, hi_c]`` above, so a layer without a bias whose
  bound fits is never checked (and gets no op in a compiled graph); with a bias,
  ``[B_lo + min b, B_hi + max b]`` fitting decides "safe" without the per-channel sums,
  and otherwise the exact check runs.  Either way the decision is the exact one.
* compiled (``torch.compile``): one custom op, :mod:`qdsl.patch.accumulate_op`, runs
  this same code and overwrites the output in place only where it simulates.

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

from qdsl.patch.accumulate_op import layer_geometry, simulate_accumulator
from qdsl.patch.accumulator_sums import (decide, fits, operands, reachable, saturate_sum, simulate, width_bound,
                                         wrap_sum)
from qdsl.spec.model import Accumulator, Overflow

__all__ = ["AccumulatorSim", "wrap_sum", "saturate_sum", "needs_simulation", "reachable", "fits"]


def needs_simulation(acc: Accumulator) -> bool:
    """A 64-bit accumulator holds every exact sum (the graph's are int64): nothing to do."""
    return acc.bits < 64


class _Overflowed(torch.autograd.Function):
    """Value of the simulated output, gradient of the float one (times ``keep``: the
    saturate mask, or None for wrap); see the module doc.  In a compiled graph ``keep``
    is ``(ran, mask)``: the mask is only written when the op ran (``_traced``), so it is
    read only then."""

    @staticmethod
    def forward(ctx, y_float, y_sim, keep):
        ctx.form = None if keep is None else ("traced" if isinstance(keep, tuple) else "eager")
        ctx.save_for_backward(*(() if keep is None else keep if isinstance(keep, tuple) else (keep,)))
        return y_sim

    @staticmethod
    def backward(ctx, g):
        if ctx.form == "eager":
            (keep,) = ctx.saved_tensors
            g = g * keep.to(g.dtype)
        elif ctx.form == "traced":
            ran, keep = ctx.saved_tensors
            # an unwritten mask (the op did not run) is never selected
            g = torch.where(ran, g * keep.to(g.dtype), g)
        return g, None, None


class AccumulatorSim:
    """The forward hook of one layer (see the module doc).

    After each simulated forward, ``overflows`` is the number of output elements whose
    exact sum left the P-bit range (the count ``qdsl run --overflow`` reports for the
    graph); ``simulated`` says whether the exact integer path ran (False: fast path)."""

    _bound: tuple[int, int] | None = None  # width_bound(), once (a class default: older pickles)
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
        why = self.__dict__.get("_why", self)
        if why is self:  # fixed by the layer's type, shape rank and proxies: decided once
            why = self._why = self._unsupported()
        if why is not None:
            self._warn(why)
            return None
        self.width_bound()  # fixed per layer: taken here, outside any compiled region
        iq, wq = p.iq, p.wq
        if getattr(iq, "observing", False) or not iq.enabled or not wq.enabled:
            return None
        if self.acc.constrain and not wq.frozen:
            return None  # the projection at freeze removes every overflow: train on the exact sums
        # the scale the input quantizer used on this very input (the layer's pre-hook ran it):
        # current_scale()'s value, without a static activation's statistics key walk per call
        s_x = iq.used_scale()
        w_hat = module.weight
        s_w = wq.current_scale()
        if s_x is None or s_w is None:
            return None  # nothing quantized yet (an uncalibrated static input passes through)
        if isinstance(s_x, float):  # the dynamic scalar path's number (eval_fast): one scale
            s_val = s_x
        elif s_x.numel() != 1:
            self._warn("a per-channel input scale")
            return None
        else:
            s_val = float(s_x.detach())
        b_hat = module.bias
        if b_hat is None and self.proven_safe():
            return None  # bit widths and fan-in alone rule out an overflow (accumulator_sums)
        z = iq.zero_point if iq.frozen and not iq.dynamic else None
        # a frozen layer reuses its module.weight/bias tensors: decide (and derive) once
        key = (id(w_hat), w_hat._version, id(b_hat), b_hat._version if b_hat is not None else None,
               s_val, id(s_w), s_w._version, None if z is None else int(z.reshape(-1)[0]))
        if self._safe_key is not None and self._safe_key[0] == key:
            safe, ops = self._safe_key[1:]
        else:
            if isinstance(s_x, float):
                s_x = iq.current_scale()  # the tensor form (the same binary32 value)
            with torch.no_grad():
                ops = operands(s_w, s_x, w_hat, b_hat, self._grid_step())
                safe = decide(ops[0], ops[1], self._input_ranges(z), self.acc.bits, self.width_bound())
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

    # ------------------------------------------------------------ the width bound
    def _grid_step(self) -> float:
        wq = self.patch.wq
        return float(wq.format.grid_step(int(wq.recipe.bits)))

    def width_bound(self) -> tuple[int, int]:
        """``(B_lo, B_hi)``: every ``Σ w·x`` the layer's quantizers can produce, from their bit
        widths and the fan-in alone (:func:`qdsl.patch.accumulator_sums.width_bound`).
        Fixed by the recipes and the weight's shape: computed once (the first eager call,
        e.g. while calibrating), so a compiled region reads two ints instead of tracing it."""
        if self._bound is None:
            p = self.patch
            wr, xr = p.wq.recipe, p.iq.recipe
            w_ranges = p.wq.format.operand_ranges(wr.bits, wr.signed, wr.narrow_range, wr.symmetric)
            x_ranges = p.iq.format.operand_ranges(xr.bits, xr.signed, xr.narrow_range, xr.symmetric)
            self._bound = width_bound(w_ranges, x_ranges, p.module.weight[0].numel())
        return self._bound

    def proven_safe(self) -> bool:
        """Without its bias, can the layer overflow at all?  False: the bound leaves P bits."""
        half = 1 << (self.acc.bits - 1)
        lo, hi = self.width_bound()
        return lo >= -half and hi <= half - 1

    def _traced(self, module: nn.Module, args: tuple, output):
        """The hook inside a compiled region: the same value and gradient as the eager
        hook, without data-dependent Python.  What depends on data runs in one custom op
        (:func:`qdsl.patch.accumulate_op.simulate_accumulator`, the eager code): it takes the
        eager decision and, only where an input could overflow, overwrites the output in
        place with the simulated one.  A layer without a bias whose bit widths and fan-in
        rule out an overflow (:meth:`proven_safe`) gets no op at all.  ``_Overflowed``
        carries the gradient as in eager; for saturate the mask the op wrote is read only
        when the op ran.  Not kept up to date here: ``overflows``/``simulated`` (eager-only
        counters), the per-weight decision cache and the warnings."""
        p = self.patch
        if not self.enabled or not isinstance(output, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
            return None
        if self._unsupported() is not None:
            return None
        iq, wq = p.iq, p.wq
        if iq.observing or not iq.enabled or not wq.enabled or (self.acc.constrain and not wq.frozen):
            return None
        s_x, s_w = iq.current_scale(), wq.current_scale()
        if s_x is None or s_w is None or s_x.numel() != 1:
            return None
        b_hat = module.bias
        proven = self.proven_safe()
        if b_hat is None and proven:
            return None
        z = iq.zero_point if iq.frozen and not iq.dynamic else None
        z = z if z is not None and z.numel() == 1 else None
        r = iq.recipe
        x_ranges = [v for rng in iq.format.operand_ranges(r.bits, r.signed, r.narrow_range, r.symmetric) for v in rng]
        saturate = self.acc.overflow is Overflow.SATURATE
        geometry, padding_name, padding_mode, pad = layer_geometry(module)
        with torch.no_grad():
            y = output.detach()
            keep = torch.empty(y.shape, dtype=torch.bool, device=y.device) if saturate else None
            ran = simulate_accumulator(
                y, keep, args[0].detach(), module.weight.detach(), None if b_hat is None else b_hat.detach(),
                s_w.detach(), s_x.detach(), None if z is None else z.detach(), x_ranges,
                [int(iq.qmin), int(iq.qmax)], self._grid_step(), self.acc.bits, saturate,
                list(self.width_bound()) if proven else [], geometry, padding_name, padding_mode, pad)
        if not output.requires_grad:
            return y
        return _Overflowed.apply(output, y, None if keep is None else (ran, keep))

    def _simulate(self, module, x_hat, output, w_int, b_int, s_x64, s_acc):
        linear = isinstance(module, nn.Linear)
        sums = (lambda x, w: F.linear(x, w)) if linear else (lambda x, w: module._conv_forward(x, w, None))
        saturate = self.acc.overflow is Overflow.SATURATE
        out = simulate(sums, -1 if linear else 1, x_hat, w_int, b_int, s_x64, s_acc, self.acc.bits, saturate,
                       output.dtype)
        if out is None:
            return None  # not exact in binary64 (e.g. wide power-of-two weights): not simulated
        y, inside = out
        self.overflows = int((~inside).sum())
        self.simulated = True
        return y, (inside if saturate else None)

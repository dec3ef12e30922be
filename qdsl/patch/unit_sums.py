"""A frozen XNOR/ternary layer summed on its codes in binary32 (the cheap form of its binary64 sums).

A frozen layer whose input and weight quantizers both have unit codes (binary, ternary:
values exactly ``c·s`` with ``c`` in {-1, 0, 1}) computes in binary64 (qdsl.patch.layer,
"Exact XNOR sums").  Per output element that is::

    y = float32( conv64(x, w) + b )      x = c_x·s_x,  w[c] = c_w·s_w[c],  b[c] the bias

and every product is exactly ``±p_c`` or 0 with ``p_c = s_x·s_w[c]`` (two binary32 factors:
at most 48 significant bits, exact in binary64).  So the layer is::

    S  = Σ c_x·c_w                       an integer, |S| <= fan-in
    y  = float32( fl64( fl64(S·p_c) + b_c ) )

and ``S`` is the layer's own conv/linear on the codes in binary32: every product is 0 or
±1 and every partial sum an integer below ``fan-in < 2^24``, so it is exact in any
summation order (oneDNN's direct/GEMM convolutions and sgemm; NNPACK, whose Winograd/FFT
transforms are not exact, is ruled out: see :meth:`UnitSums.begin`).  One binary32
conv plus three elementwise passes instead of a binary64 conv (no oneDNN kernel: ~5x the
float forward on the xnor spec, benchmarks/qat_compile.py).

Bit for bit.  When every partial sum of the binary64 conv is exact, its result is
``fl64(S·p_c + b_c)`` in any summation order, which is the formula above.  Per layer that is
proved once at freeze (:attr:`Operands.certified`): ``p_c`` and ``b_c`` lie on one power-of-two
grid ``g_c`` and ``fan-in·p_c + |b_c| < 2^53·g_c`` (then every partial sum is a multiple of
``g_c`` below ``2^53·g_c``: representable, so every addition is exact).  Where it fails (the
bundled xnor spec: ``p_c`` has 48 significant bits, so a partial sum ``j·p_c`` with ``|j| >= 32``
rounds) the binary64 conv rounds partial sums to 2^-53 in its BLAS's order, which depends on
the library, the blocking and the thread count; the formula above rounds the exact ``S`` once.
The two then agree unless such a rounding crosses a binary32 rounding boundary (measured on
the xnor CNN of benchmarks/qat_compile.py: 1 of 21M layer outputs over 10 batches, in its last
bit).  The cheap form is the default wherever it applies: its ``S`` is the integer graph's
accumulator exactly and is scaled once, so it is the correctly rounded value of the layer's
exact sum and does not depend on the BLAS, its blocking or the thread count (the binary64
conv's uncertified results do).  ``QDSL_FROZEN_SUMS`` (read at every forward) chooses:

* ``codes`` (default): the cheap form wherever it applies (~4x cheaper on the xnor CNN);
* ``certified``: the cheap form only where certified (then bit for bit the binary64 conv),
  the binary64 conv elsewhere;
* ``binary64``: the binary64 conv everywhere.

When (else the binary64 conv runs, unchanged): frozen, no autograd through the layer, not
compiling, a Linear or Conv1d/2d/3d with binary32 input and weights, input and weight
quantizers enabled, a per-tensor input scale, weight scales per output channel or per
tensor, a batched input, and the layer's accumulator check (qdsl.patch.accumulate) proved
it cannot overflow (it would otherwise read the layer's real input).
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import numpy as np
import torch
from torch import nn

from qdsl.patch.accumulator_sums import decide, operands
from qdsl.spec.diagnostics import QdslError

__all__ = ["UnitSums", "Operands", "MODE_ENV", "MODES", "certified"]

MODE_ENV = "QDSL_FROZEN_SUMS"
"""Which frozen unit-code layers take the cheap form: one of :data:`MODES` (module doc)."""
MODES = ("certified", "codes", "binary64")

_F32_EXACT = 2**24
_F64_EXACT = 2**53
_MISSING = object()


def _lsb_exponent(v: np.ndarray) -> np.ndarray:
    """Per entry, the exponent ``e`` of the least significant set bit of a binary64 value
    (``v = m·2^e``, ``m`` odd); a huge value for 0 (on every grid)."""
    m, e = np.frexp(v)  # v = m·2^e, 0.5 <= |m| < 1
    ints = np.abs(m * 2.0**53).astype(np.int64)  # exact: 53 significant bits
    out = np.full(v.shape, 10**6, dtype=np.int64)
    nz = ints != 0
    tz = np.zeros(v.shape, dtype=np.int64)
    left = ints.copy()
    for _ in range(53):  # trailing zeros (at most 53 halvings)
        even = nz & (left % 2 == 0)
        if not even.any():
            break
        tz += even
        left = np.where(even, left // 2, left)
    out[nz] = (e - 53 + tz)[nz]
    return out


def certified(p: np.ndarray, b: np.ndarray | None, fan_in: int) -> bool:
    """Is every partial sum of ``fan_in`` terms ``±p_c`` (or 0) and ``b_c`` exact in binary64,
    in any order, for every channel?  (module doc: one grid ``g_c`` for ``p_c`` and ``b_c``,
    ``fan_in·p_c + |b_c| < 2^53·g_c``.)"""
    p = np.asarray(p, dtype=np.float64).reshape(-1)
    b = np.zeros_like(p) if b is None else np.broadcast_to(np.asarray(b, dtype=np.float64).reshape(-1), p.shape)
    if not (np.isfinite(p).all() and np.isfinite(b).all()):
        return False
    g = np.minimum(_lsb_exponent(p), _lsb_exponent(b))
    worst = fan_in * np.abs(p) + np.abs(b)
    zero = worst == 0
    g = np.where(zero, 0, g)
    return bool((zero | (worst < np.ldexp(1.0, (g + 53).astype(np.int64)))).all())


@attrs.frozen(eq=False)
class Operands:
    """What a frozen unit-code layer's cheap form reads, derived once per frozen weight."""

    w_codes: torch.Tensor
    """The weight's codes in {-1, 0, 1} as binary32 (the layer's weight shape)."""
    s_x: float
    p: torch.Tensor
    """``s_x·s_w[c]`` in binary64, viewed to broadcast against the output."""
    b: torch.Tensor | None
    """The bias as binary64 (the layer's, as the binary64 conv adds it), viewed likewise."""
    certified: bool
    """Bit for bit equal to the binary64 conv in any summation order (module doc)."""
    acc_safe: bool
    """The accumulator check passes the output through (no simulation to feed)."""


class UnitSums:
    """The cheap form of one patched unit-code layer (see the module doc)."""

    def __init__(self, patch: Any):
        self.patch = patch
        self._ops: tuple | None = None  # (key, Operands | None)
        self._saved: dict | None = None  # the module's weight/bias attributes, swapped for the codes
        self._pending: Operands | None = None

    def __getstate__(self) -> dict:
        return {"patch": self.patch, "_ops": None, "_saved": None, "_pending": None}

    # ------------------------------------------------------------ operands
    def operands(self, module: nn.Module, key: tuple) -> Operands | None:
        """The layer's operands for the frozen weights under ``key`` (the patch's fast-path
        key), or None when its weights are not unit codes times one scale per channel."""
        if self._ops is not None and self._ops[0] == key:
            return self._ops[1]
        ops = self._derive(module)
        self._ops = (key, ops)
        return ops

    def _derive(self, module: nn.Module) -> Operands | None:
        iq = self.patch.iq
        w, b = module.__dict__.get("weight"), module.bias
        if not isinstance(w, torch.Tensor) or w.dtype != torch.float64 or iq.scale.numel() != 1:
            return None
        s_x = float(iq.scale.detach().reshape(-1)[0].float())
        with torch.no_grad():
            flat = w.detach().reshape(w.shape[0], -1)
            mag = flat.abs().amax(dim=1)
            # every non-zero weight of a row is exactly ±(its row's magnitude): unit codes
            if not bool(((flat == 0) | (flat.abs() == mag[:, None])).all()):
                return None
            codes = torch.sign(w.detach()).float()
            p = torch.tensor(s_x, dtype=torch.float64) * mag  # exact: two binary32 factors
            bias = None if b is None else b.detach().to(torch.float64)
        fan_in = flat.shape[1]
        if fan_in >= _F32_EXACT or not np.isfinite(s_x) or s_x <= 0:
            return None
        cert = certified(p.numpy(), None if bias is None else bias.numpy(), fan_in)
        axis_shape = [-1] + [1] * (w.dim() - 2)  # output channels on axis 1 (conv) or last (linear)
        linear = isinstance(module, nn.Linear)
        pv = p if linear else p.view(*axis_shape)
        bv = None if bias is None else (bias if linear else bias.view(*axis_shape))
        return Operands(codes, s_x, pv, bv, cert, self._acc_safe(module))

    def _acc_safe(self, module: nn.Module) -> bool:
        """Would the layer's accumulator check pass its output through?  (It reads the
        layer's real input, which the cheap form does not hand the module.)  The check's own
        decision (qdsl.patch.accumulate), taken once for the frozen weights."""
        a = self.patch.acc_sim
        if a is None:
            return True
        if a._unsupported() is not None:
            return True
        iq, wq = self.patch.iq, self.patch.wq
        s_x, s_w = iq.current_scale(), wq.current_scale()
        if s_x is None or s_w is None or s_x.numel() != 1:
            return True
        b = module.bias
        if b is None and a.proven_safe():
            return True
        z = iq.zero_point if iq.frozen and not iq.dynamic else None
        with torch.no_grad():
            ops = operands(s_w, s_x, module.weight, b, a._grid_step())
            return bool(decide(ops[0], ops[1], a._input_ranges(z), a.acc.bits, a.width_bound()))

    # ------------------------------------------------------------ forward
    def begin(self, module: nn.Module, x: Any, key: tuple | None) -> tuple | None:
        """From the layer's forward pre-hook (weights refreshed, input quantized): the
        module's new positional input (the input's codes, the weight swapped for its codes,
        no bias), or None to keep the binary64 conv."""
        p_ = self.patch
        mode = os.environ.get(MODE_ENV) or "codes"
        if mode not in MODES:
            raise QdslError(f"{MODE_ENV}={mode!r}: expected one of {', '.join(MODES)} (qdsl/patch/unit_sums.py)")
        if key is None or mode == "binary64" or torch.compiler.is_compiling():
            return None
        if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) or not isinstance(x, torch.Tensor):
            return None
        iq, wq = p_.iq, p_.wq
        if x.dtype != torch.float32 or not (iq.enabled and wq.enabled and iq.frozen and wq.frozen) or iq.dynamic:
            return None
        if wq.group_size is not None or wq.axis not in (None, 0, -module.weight.dim()):
            return None
        batched = x.dim() >= 2 if isinstance(module, nn.Linear) else x.dim() == module.weight.dim()
        if not batched or (torch.is_grad_enabled() and x.requires_grad):
            return None
        if not isinstance(module, nn.Linear) and not torch.backends.mkldnn.enabled and torch._C._get_nnpack_enabled():
            return None  # NNPACK (Winograd/FFT) may take a binary32 conv: not exact on integers
        a = p_.acc_sim
        ops = self.operands(module, key)
        if ops is None or not (ops.acc_safe or a is None or not a.enabled) or not (ops.certified or mode == "codes"):
            return None
        d = module.__dict__
        self._saved = {name: d.get(name, _MISSING) for name in ("weight", "bias")}
        d["weight"], d["bias"] = ops.w_codes, None
        self._pending = ops
        return (torch.sign(x),)  # x = c·s_x exactly (the frozen input quantizer's values)

    def restore(self) -> None:
        """Put the module's weight/bias attributes back (after the forward, or after a
        forward that raised)."""
        saved, self._saved = self._saved, None
        if saved is None:
            return
        d = self.patch.module.__dict__
        for name, v in saved.items():
            if v is _MISSING:
                d.pop(name, None)
            else:
                d[name] = v

    def finish(self, output: Any, dtype: torch.dtype) -> Any:
        """From the layer's forward hook: ``S`` (the module's sum on codes) scaled to the
        binary64 conv's value and rounded to ``dtype``; None when :meth:`begin` did not run."""
        ops, self._pending = self._pending, None
        self.restore()
        if ops is None or not isinstance(output, torch.Tensor):
            return None
        y = output.to(torch.float64).mul_(ops.p)  # S exact; one rounding of S·p_c
        if ops.b is not None:
            y.add_(ops.b)
        return y.to(dtype)

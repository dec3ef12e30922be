"""Minifloats (FP8, FP6, FP4 and any ``fp{N}_e{E}m{M}``), torch side, and their scales.

Values.  ``x̂ = s · Q(x / s)`` where ``Q`` rounds to the format's value grid
(:class:`~qdsl.spec.formats.MinifloatFormat`): in the binade of ``|y|`` (``2^e <= |y| <
2^(e+1)``, ``e`` clamped to ``emin..emax``; below ``2^emin`` the subnormals share
``emin``) the grid step is ``2^(e - M)``, so ``Q(y) = round(y / 2^(e-M)) · 2^(e-M)``:
``half_even`` on that integer is IEEE round-to-nearest-even (an even integer is an even
mantissa), a tie at the top of a binade rounds up into the next one exactly, subnormals
are exact (the step is fixed below ``2^emin``), and the result is clamped to
``±max_normal``: rounding *saturates*, it never produces inf or NaN (a NaN input stays
NaN, ±inf saturates).  The quantizer's ``rounding`` applies to that integer (``stochastic``:
``floor(v + u)``, unbiased; ``floor``, ``half_away``, a registered rounding).  ``y = x / s``
is a true division (not ``x · (1/s)``), as a cast ``(x / s).to(float8)`` computes it.

Codes (``int_repr``, ``qdsl.int_tensors``): the format's bit patterns as ``uint8``, in the
low ``N`` bits: ``sign << (N-1) | exponent_field << M | mantissa_field`` (torch's
``float8_e4m3fn``/``float8_e5m2`` bytes for the fp8 presets; ``-0`` is ``1 << (N-1)``).
``decode(codes, fmt)`` inverts it; ``fmt.operand_codes`` maps them to integer multiples of
the smallest subnormal (the integer grid an accumulator would use).

Scales (one per tensor, channel or ``group(k)`` block; the observer gives ``amax = max|x|``;
with ``observer = mse`` (or ``auto``) a weight's ``amax`` is searched instead: ``k/grid``
of its own max-abs for ``k = grid..1``, keeping per slot the one whose scale gives the
least ``sum |w - ŵ|^norm`` on this format's grid - ``grid`` fake quantizations per call):

* ``scale = float``: ``s = amax / max_normal`` (the largest value maps to the largest code).
* ``scale = pot`` (any power-of-two rule): OCP MX v1.0's shared exponent,
  ``s = 2^(floor(log2 amax) - emax)`` with ``emax`` the element format's largest exponent
  (fp4_e2m1 2, fp6_e2m3 2, fp6_e3m2 4, fp8_e4m3 8, fp8_e5m2 15), clamped to E8M0's
  ``2^-127..2^127``; elements above ``max_normal · s`` saturate, as MX specifies.  With
  ``group(32)`` this is MXFP4/MXFP6/MXFP8; the E8M0 code of a block is ``log2(s) + 127``
  (:func:`e8m0_codes`).
* ``scale = fp8_e4m3`` (or ``fp8_e5m2``): :class:`MinifloatScale`, NVFP4's two-level scale:
  a per-tensor ``s_t = 2^ceil(log2(max_blocks(amax / max_normal) / 448))`` and per block
  ``s = s_t · e4m3(amax / max_normal / s_t)`` (RNE, saturating, at least the smallest
  subnormal).  ``s_t`` is a power of two (NVFP4 allows any fp32; a power of two keeps
  ``s_t · e4m3`` exact in float32 and costs no relative precision).  The stored scale is
  that product; :func:`split_scale` gives back ``(s_t, e4m3 codes)``.  With ``fp4_e2m1``
  and ``group(16)`` this is NVFP4.

Gradients (QAT): the clipping-mask straight-through estimator of :class:`FormatOps`
(identity where ``|x| <= max_normal · s``, zero where it saturates); a learned scale gets
``d(s·Q(x/s))/ds = Q(x/s)``.
"""

from __future__ import annotations

import torch
from torch import nn

from qdsl.quantizers import functional as F
from qdsl.quantizers import native_fq as NFQ
from qdsl.quantizers.formats.base import TINY, FormatOps, is_weight, zero_gain
from qdsl.spec.builtins import MseParams
from qdsl.spec.formats import MINIFLOAT_PRESETS, MinifloatFormat

__all__ = [
    "MinifloatOps",
    "MinifloatScale",
    "E4M3Scale",
    "E5M2Scale",
    "minifloat_round",
    "minifloat_codes",
    "decode",
    "mx_scale",
    "e8m0_codes",
    "split_scale",
]

E8M0_MIN, E8M0_MAX = -127, 127
"""The exponents an OCP E8M0 scale holds (code 255 is NaN)."""


def _steps(a: torch.Tensor, fmt: MinifloatFormat) -> torch.Tensor:
    """The grid step ``2^(e - M)`` at each magnitude ``a`` (``e`` its binade, clamped to
    ``emin..emax``); frexp is exact: ``a = m·2^k`` with ``m`` in [0.5, 1), binade ``k - 1``."""
    _, k = torch.frexp(a)
    e = torch.clamp(k.to(torch.int32) - 1, fmt.emin, fmt.emax)
    return torch.ldexp(torch.ones_like(a), (e - fmt.mantissa).to(a.dtype))


def _bits_ok(fmt: MinifloatFormat) -> bool:
    """Every grid step ``2^(e-M)`` and its inverse ``2^(M-e)`` (``e`` in ``emin..emax``)
    is a normal float32 (all presets), so :func:`_bit_steps` may build them from bits."""
    return fmt.emin - fmt.mantissa >= -126 and fmt.mantissa - fmt.emin <= 127 \
        and fmt.emax - fmt.mantissa <= 127 and fmt.mantissa - fmt.emax >= -126


def _bit_steps(y: torch.Tensor, fmt: MinifloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2^(e-M), 2^(M-e))`` for each float32 ``y``, ``e`` its binade clamped to
    ``emin..emax``, from the float32 bits alone (the values of :func:`_steps`).

    The biased exponent field ``f`` of ``y`` is ``floor(log2 |y|) + 127`` for a normal
    ``y``; 0 (zero, subnormal) and 255 (inf, NaN) land on the clamp's ends, where
    :func:`_steps`' binade lands too (a subnormal's binade is below ``emin`` >= -126; inf
    and NaN round to ``±max_normal`` / NaN whatever the step).  A power of two
    ``2^k`` (``-126 <= k <= 127``) is the float32 with field ``k + 127`` and a zero
    mantissa.  Elementwise integer ops only: a compiler vectorises them (``frexp`` ran
    one element at a time in inductor's C++ and ``ldexp`` as a vector ``pow``)."""
    f = torch.clamp((y.view(torch.int32) >> 23) & 0xFF, fmt.emin + 127, fmt.emax + 127)
    step = ((f - fmt.mantissa) << 23).view(torch.float32)
    inv = ((254 + fmt.mantissa - f) << 23).view(torch.float32)
    return step, inv


def minifloat_round(y: torch.Tensor, fmt: MinifloatFormat, mode: str | None = "half_even",
                    generator: torch.Generator | None = None, round_fn=None) -> torch.Tensor:
    """``y`` rounded to ``fmt``'s values (saturating; see the module docstring).

    >>> f = MINIFLOAT_PRESETS["fp4_e2m1"]
    >>> minifloat_round(torch.tensor([0.25, 0.75, 2.5, 5.0, 7.0, -100.0, 1e-9]), f).tolist()
    [0.0, 1.0, 2.0, 4.0, 6.0, -6.0, 0.0]
    """
    y = y.float()
    if _bits_ok(fmt):
        # y·2^(M-e) is y / 2^(e-M) bit for bit: both are the exact product, rounded once
        step, inv = _bit_steps(y, fmt)
        v = y * inv
    else:
        step = _steps(y.abs(), fmt)
        v = y / step  # exact: a power-of-two division of a float32 in range
    r = round_fn(v, generator=generator) if round_fn is not None else F.round_(v, mode, generator)
    top = fmt.max_normal
    return torch.clamp(r * step, -top, top)


_TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""The presets torch has as dtypes (its casts round to nearest even with subnormals, as
:func:`minifloat_round`; they do not saturate, so :func:`_cast_round` clamps first)."""
_TABLES: dict = {}


def _table(dtype: torch.dtype, device) -> torch.Tensor:
    """The float32 value of each of the 256 bytes of a torch float8 dtype."""
    key = (dtype, device)
    table = _TABLES.get(key)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        table = _TABLES[key] = codes.view(dtype).to(torch.float32).to(device)
    return table


def _cast_round(y: torch.Tensor, fmt: MinifloatFormat, dtype: torch.dtype, scale: torch.Tensor | None = None,
                inplace: bool = False) -> torch.Tensor:
    """``minifloat_round(y, fmt)`` (half_even) through torch's float8 cast, ~8x faster on
    CPU.  Clamping to ``±max_normal`` before rounding equals saturating after it (rounding is
    monotone and ``max_normal`` is on the grid); the bytes are decoded by a 256-entry table
    because torch's float8 -> float32 conversion runs scalar.  A NaN stays NaN (its payload
    may differ).

    ``scale`` (one value): returns ``minifloat_round(y)·scale``, decoded through the table
    times ``scale`` (each entry the same binary32 product, so the same values, one pass
    fewer).  ``inplace``: ``y`` is the caller's own temporary (contiguous) and receives
    the result (no new buffer besides the byte codes and their int32 indices)."""
    table = _table(dtype, y.device)
    if scale is not None:
        table = table * scale.reshape(())
    top = fmt.max_normal
    if inplace and y.is_contiguous():
        c = y.clamp_(-top, top).to(dtype).view(torch.uint8)
        return torch.index_select(table, 0, c.view(-1).to(torch.int32), out=y.view(-1)).view(y.shape)
    c = torch.clamp(y, -top, top).to(dtype).view(torch.uint8)
    return table.index_select(0, c.reshape(-1).to(torch.int32)).view(y.shape)


def _native_round(x: torch.Tensor, s: torch.Tensor, fmt: MinifloatFormat, dtype: torch.dtype) -> torch.Tensor | None:
    """``_cast_round(x / s, fmt, dtype, scale=s)`` in one native pass (qdsl.quantizers.native_fq),
    or None: the same values bit for bit, a NaN as the decode table holds it."""
    if not NFQ.enabled():
        return None
    nan = _NAN_BITS.get(dtype)
    if nan is None:
        code = torch.tensor(float("nan")).to(dtype).view(torch.uint8).to(torch.int32)
        nan = _NAN_BITS[dtype] = int(_table(dtype, "cpu")[code].view(torch.int32)) & 0x7FFFFFFF
    return NFQ.fake_quant_minifloat(x, float(s), fmt.max_normal, fmt.emin, fmt.mantissa, nan)


_NAN_BITS: dict = {}


def minifloat_codes(q: torch.Tensor, fmt: MinifloatFormat, sign_of: torch.Tensor | None = None) -> torch.Tensor:
    """Bit patterns (uint8, ``sign|exponent|mantissa``) of values ``q`` already on the grid;
    the sign bit is ``sign_of``'s (so ``-0`` keeps it), default ``q``'s."""
    a = q.abs()
    _, k = torch.frexp(a)
    e = torch.clamp(k.to(torch.int64) - 1, fmt.emin, fmt.emax)
    normal = a >= fmt.min_normal
    e_field = torch.where(normal, e + fmt.bias, torch.zeros_like(e))
    # subnormal: a = m·2^(emin-M); normal: a = (2^M + m)·2^(e-M)
    m_steps = torch.round(a / torch.ldexp(torch.ones_like(a), (e - fmt.mantissa).to(a.dtype))).to(torch.int64)
    m_field = torch.where(normal, m_steps - (1 << fmt.mantissa), m_steps)
    sign = torch.signbit(q if sign_of is None else sign_of).to(torch.int64)
    code = (sign << (fmt.bits - 1)) | (e_field << fmt.mantissa) | m_field
    return code.to(torch.uint8)


def decode(codes: torch.Tensor, fmt: MinifloatFormat) -> torch.Tensor:
    """Float32 values of bit patterns (the inverse of :func:`minifloat_codes`).

    >>> decode(torch.tensor([0, 1, 7, 9, 15], dtype=torch.uint8), MINIFLOAT_PRESETS["fp4_e2m1"]).tolist()
    [0.0, 0.5, 6.0, -0.5, -6.0]
    """
    c = codes.to(torch.int64)
    e = (c >> fmt.mantissa) & ((1 << fmt.exponent) - 1)
    m = (c & ((1 << fmt.mantissa) - 1)).float()
    frac = torch.where(e == 0, m, m + (1 << fmt.mantissa))
    mag = torch.ldexp(frac, (torch.clamp(e, min=1) - fmt.bias - fmt.mantissa).float())
    return torch.where(((c >> (fmt.bits - 1)) & 1).bool(), -mag, mag)


def mx_scale(amax: torch.Tensor, fmt: MinifloatFormat) -> torch.Tensor:
    """OCP MX's shared scale ``2^(floor(log2 amax) - emax)``, clamped to E8M0's range
    (an all-zero block gets ``2^-127``).

    >>> mx_scale(torch.tensor([6.0, 8.0, 0.0]), MINIFLOAT_PRESETS["fp4_e2m1"]).tolist()[:2]
    [1.0, 2.0]
    """
    _, k = torch.frexp(amax.float())
    e = torch.where(amax > 0, k.to(torch.int32) - 1 - fmt.emax, torch.full_like(k, E8M0_MIN, dtype=torch.int32))
    e = torch.clamp(e, E8M0_MIN, E8M0_MAX)
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), e.float())


def e8m0_codes(scale: torch.Tensor) -> torch.Tensor:
    """The E8M0 byte (``log2(s) + 127``) of power-of-two scales."""
    _, k = torch.frexp(scale.float())
    return (k.to(torch.int32) - 1 + 127).to(torch.uint8)


def _tensor_scale(raw: torch.Tensor, fmt: MinifloatFormat) -> torch.Tensor:
    top = torch.clamp(raw.max(), min=TINY) / fmt.max_normal
    return torch.exp2(torch.ceil(torch.log2(top)))


def split_scale(scale: torch.Tensor, fmt_name: str = "fp8_e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """``(s_t, codes)`` with ``scale == s_t · decode(codes)`` exactly, for a scale made by
    :class:`MinifloatScale` (``s_t`` a power of two, codes the 8-bit float's bytes)."""
    fmt = MINIFLOAT_PRESETS[fmt_name]
    s_t = _tensor_scale(scale, fmt)
    v = scale / s_t
    return s_t, minifloat_codes(minifloat_round(v, fmt), fmt)


class MinifloatScale(nn.Module):
    """A scale rule (``scale = fp8_e4m3``): each raw scale cast to an 8-bit float under a
    power-of-two per-tensor scale (NVFP4's two levels; see the module docstring)."""

    learned = False
    pot = False
    format_name = "fp8_e4m3"

    def __init__(self, ctx=None):
        super().__init__()
        self.fmt = MINIFLOAT_PRESETS[self.format_name]

    def forward(self, raw: torch.Tensor) -> torch.Tensor:
        raw = raw.float()
        s_t = _tensor_scale(raw, self.fmt)
        v = torch.clamp(minifloat_round(raw / s_t, self.fmt), min=self.fmt.min_subnormal)
        return v * s_t


class E4M3Scale(MinifloatScale):
    """``scale = fp8_e4m3``: NVFP4's block scales."""


class E5M2Scale(MinifloatScale):
    """``scale = fp8_e5m2``: more range, one mantissa bit fewer."""

    format_name = "fp8_e5m2"


def _finite_absmax(v: torch.Tensor, dim: int) -> torch.Tensor:
    """The float32 bits (int32) of the largest finite ``|v|`` along ``dim`` (0 if none):
    non-negative float32 bits order as the floats; with the sign bit cleared, inf and NaN
    are the patterns ``>= 0x7F800000``."""
    b = v.view(torch.int32) & 0x7FFFFFFF
    return torch.where(b < 0x7F800000, b, 0).amax(dim=dim)


def _blockwise(x: torch.Tensor, g: int, fn, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``fn`` on ``x``'s groups (``x.reshape(C, -1)`` cut in blocks of ``g``, the last one
    shorter when ``g`` does not divide the row), without padding: the full blocks as
    ``[C, Gf, g]`` (``fn(v, s)`` with ``s = scale[:, :Gf, None]``) and the short one as
    ``[C, t]`` (``s = scale[:, -1:]``).  With a scale, the results are joined back to
    ``x``'s shape; without one (a reduction over the block), ``fn(v, None)`` gives
    ``[C, Gf]`` / ``[C]`` and the result is ``[C, G]``.  (Compiled code only: inductor 2.13
    left a ragged last block's elements unwritten when a zero-padded ``[C, G, g]`` view,
    or a scale repeat_interleave'd to the row, was sliced back to the row's length.)"""
    c = x.shape[0]
    rows = x.reshape(c, -1)
    r = rows.shape[1]
    full = r // g * g
    parts = []
    if full:
        v = rows[:, :full].reshape(c, full // g, g)
        parts.append(fn(v, None) if scale is None else fn(v, scale[:, : full // g, None]).reshape(c, full))
    if full < r:
        v = rows[:, full:]
        parts.append(fn(v, None).unsqueeze(1) if scale is None else fn(v, scale[:, -1:]))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out if scale is None else out.reshape(x.shape)


def _finite_absmax_bits(x: torch.Tensor, axis, group_size) -> torch.Tensor:
    """The float32 bits (int32) of each scale slot's largest finite ``|x|`` (0 for a slot
    with none): ``max(-lo, hi)`` of the observers' finite min and max, in one integer
    reduction per block shape."""
    x = x.detach().float()
    if group_size is not None:
        return _blockwise(x, group_size, lambda v, _: _finite_absmax(v, -1))
    return _finite_absmax(F.reduce_view(x, axis, None), 1)


def _mx_scale_bits(amax_bits: torch.Tensor, fmt: MinifloatFormat) -> torch.Tensor:
    """:func:`mx_scale` of a finite ``amax >= 0`` given by its bits, for ``emax >= 0``:
    ``floor(log2 amax)`` is the exponent field minus 127 for a normal ``amax``; a zero or
    subnormal one (field 0) gives ``-127 - emax``, clamped to -127 as :func:`mx_scale`'s
    ``2^-127`` for a zero block and its clamp for a subnormal ``amax``.  ``2^-127`` itself is
    the subnormal with bits ``1 << 22``."""
    e = torch.clamp((amax_bits >> 23) - (127 + fmt.emax), E8M0_MIN, E8M0_MAX)
    return torch.where(e > E8M0_MIN, (e + 127) << 23, 1 << 22).view(torch.float32)


class MinifloatOps(FormatOps):
    """Every minifloat's torch ops (registered as the ``minifloat`` family)."""

    def qparams(self, q, x, lo, hi, rule):
        params = q.recipe.observer_params
        if x is not None and torch.compiler.is_compiling() and self._traced_absmax(q, params):
            # compiled: the same scale from x's bits (lo and hi go unused, so the compiler
            # drops the observer's three masked reductions); see _finite_absmax_bits
            bits = _finite_absmax_bits(x, q.axis, q.group_size).reshape(lo.shape)
            if self._pot_identity(q, rule):
                scale = _mx_scale_bits(bits, q.format)
            else:
                scale = self._scale(q, bits.view(torch.float32), rule)
            return scale, torch.zeros(scale.shape, dtype=torch.int32, device=scale.device), None
        amax = torch.maximum(-lo, hi)
        if x is not None and q.role.is_param and isinstance(params, MseParams):
            amax = self._search(q, x, amax, rule, params)
        scale = self._scale(q, amax, rule)
        return scale, torch.zeros(scale.shape, dtype=torch.int32, device=scale.device), None

    @staticmethod
    def _traced_absmax(q, params) -> bool:
        """``(lo, hi)`` passed to :meth:`qparams` with ``x`` under compile are the finite min
        and max of ``x`` itself (a stateless quantizer whose observer's traced range is
        min/max's), so ``max(-lo, hi)`` may come from ``x`` directly."""
        from qdsl.quantizers.observers import MinMaxObserver

        return (q.stateless and not isinstance(params, MseParams)
                and getattr(type(q.observer), "traced_range", None) is MinMaxObserver.traced_range)

    @staticmethod
    def _pot_identity(q, rule) -> bool:
        """The pot rule leaves the MX scale (a power of two) as it is: ``pot``/``pot_ceil``
        map ``2^k`` to itself (qdsl.quantizers.scales), so :func:`_mx_scale_bits` is the
        whole scale."""
        from qdsl.quantizers.scales import PotCeilScale, PotScale

        return type(rule) in (PotScale, PotCeilScale) and q.format.emax >= 0

    @staticmethod
    def _scale(q, amax, rule):
        if getattr(rule, "pot", False):
            # OCP MX: the shared exponent, exactly a power of two, which every pot rule keeps
            return rule(mx_scale(amax, q.format))
        return rule(torch.clamp(amax / q.format.max_normal, min=TINY))

    def _search(self, q, x, amax, rule, params):
        """The clipped max-abs (``k/grid`` of the weight's own, per scale slot) whose scale
        gives the least ``sum |w - ŵ|^norm`` on this format's grid (the observer's search
        assumes an integer grid); ``k = grid`` is max-abs itself, so it never does worse."""
        rows = F.reduce_view(x.detach().float(), q.axis, q.group_size)
        amax0 = rows.abs().amax(dim=1)
        best_err = torch.full_like(amax0, float("inf"))
        best = amax0.clone()
        for k in range(params.grid, 0, -1):
            cand = amax0 * (k / params.grid)
            s = self._scale(q, cand, rule).detach().reshape(-1, 1).float()
            fq = minifloat_round(rows / s, q.format) * s
            err = (rows - fq).abs().pow(params.norm).sum(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, cand, best)
        return best.reshape(amax.shape)

    def _y(self, q, x, scale):
        s = F.param_view(scale.to(torch.float32), x, q.axis, q.group_size)
        return x / s, s

    @staticmethod
    def _blocked(q, x, scale) -> bool:
        # compiled group scales: applied block by block (_blockwise), not through the
        # scale repeat_interleave'd to x's shape, which inductor 2.13 miscompiled
        return q.group_size is not None and torch.compiler.is_compiling() and scale.dim() == 2

    def fake(self, q, x, scale, zp, thr):
        if self._blocked(q, x, scale):
            def block(v, s):
                return minifloat_round(v / s, q.format, q._round_mode, q.generator, q._round_fn) * s

            return _blockwise(x.float(), q.group_size, block, scale.to(torch.float32)).to(x.dtype)
        y, s = self._y(q, x.float(), scale)
        dtype = _TORCH_FP8.get(q.format.name) if q._round_fn is None and q._round_mode == "half_even" else None
        if dtype is not None and q.format == MINIFLOAT_PRESETS[q.format.name] \
                and not (torch.is_grad_enabled() and y.requires_grad) and not torch.compiler.is_compiling():
            if s.numel() == 1:  # y = x / s is this call's own buffer: decode into it, scaled
                out = _native_round(x.float(), s, q.format, dtype)
                if out is not None:
                    return out.to(x.dtype)
                return _cast_round(y, q.format, dtype, scale=s, inplace=True).to(x.dtype)
            return _cast_round(y, q.format, dtype, inplace=True).mul_(s).to(x.dtype)
        return (minifloat_round(y, q.format, q._round_mode, q.generator, q._round_fn) * s).to(x.dtype)

    def codes(self, q, x, scale, zp, thr):
        y, _ = self._y(q, x.float(), scale)
        return minifloat_codes(minifloat_round(y, q.format, q._round_mode, q.generator, q._round_fn), q.format, y)

    def qat_value(self, q, x, scale, zp, thr):
        if is_weight(q) and not scale.requires_grad and self._blocked(q, x, scale):
            # FormatOps.qat_value's weight form, its clipping mask on the block view too
            xd, sd = x.detach(), scale.detach()
            value = q._fake(xd, sd, zp, thr)
            top = q.format.max_normal
            inside = _blockwise(xd.abs(), q.group_size, lambda v, s: v <= s * top, sd.to(x.dtype))
            return value + zero_gain(x * inside)
        return super().qat_value(q, x, scale, zp, thr)

    def activation_mask(self, q, x, s):
        return x.abs() <= s * q.format.max_normal

    def qat_surrogate(self, q, x, s_view):
        return x * (x.detach().abs() <= s_view.detach() * q.format.max_normal)

    def scale_surrogate(self, s_view, value):
        return s_view * (value / s_view.detach().clamp_min(1e-30)).detach()

"""Pure torch quantization arithmetic: the numerics every qdsl quantizer is built from.

Guarantees
----------
* **Affine int** (``fake_quant_affine``/``quantize_affine``/``dequantize_affine``) is
  bit-exact with ``torch.fake_quantize_per_tensor_affine`` and
  ``torch.fake_quantize_per_channel_affine`` for every configuration those ops can
  express (same float32 scale, same integer zero point, half-even rounding).  torch's
  CPU kernel (``_fake_quantize_tensor_helper`` / ``_fake_quant_per_channel_cachemask_cpu_helper``
  in ATen) computes, all in float32::

      inv = 1.0f / scale                    # float32 reciprocal, computed once
      q   = clamp(nearbyint(x * inv) + z, qmin, qmax)
      x̂   = float(q - z) * scale

  i.e. it *multiplies by the float32 reciprocal* rather than dividing by the scale.  The
  two differ in the last ulp for some inputs and can flip a rounding decision at a .5
  boundary (measured: 3 codes in 2M random elements), so qdsl uses the reciprocal form
  everywhere: fake quantization, ``int_repr``, and the export reference executor's input
  quantizer must all use :func:`reciprocal` then multiply.
* Scales are float32 tensors of shape ``[]`` (per tensor), ``[C]`` (per channel along
  ``axis``) or ``[C, G]`` (groups); zero points are integer tensors of the same shape.
* **Groups** (the resolver's definition, ``qdsl.resolve.validate``): a weight of shape
  ``[C, *rest]`` is seen as rows ``w.reshape(C, R)`` (``R = prod(rest)``, kernel position
  fastest); with ``group_size`` g each row has ``G = ceil(R / g)`` groups and group
  ``(c, j)`` is ``w.reshape(C, R)[c, j*g:(j+1)*g]``.  :func:`group_view` exposes it.  When
  g does not divide R the last group of each row is shorter; the reductions see it
  zero-padded to g (OCP MX's padded last block: min/max/max-abs are unchanged by the
  zeros).  Only formats with ``ragged_groups`` (minifloats) get there: the resolver keeps
  E217 (g must divide R) for the others.
* Power-of-two scales (:func:`pot_scale`), binary, ternary and power-of-two weights are
  exact: they use ``frexp``/comparisons, never ``log2`` rounding, so a value exactly on
  a boundary always goes the documented way.

Non-finite values (the policy the integer graph shares, docs/qgraph.md): a NaN gets the
code of 0 (the zero point; binary: +1, ternary: 0), ``+inf`` the largest code and
``-inf`` the smallest, so fake quantization never lets a NaN through; ``check_finite``
raises :class:`~qdsl.spec.diagnostics.NonFiniteError` instead, for callers that ask.

Half precision: callers upcast float16/bfloat16 to float32 before these functions
(``HALF_DTYPES``); every function here computes in the dtype it is given.

Rounding modes: ``half_even`` (``torch.round``, what torch's kernels do), ``half_away``
(ties away from zero, what gemmlowp requantization does), ``floor``, ``stochastic``
(``floor(x) + [u < frac(x)]`` with ``u ~ U[0, 1)`` from an optional generator).
"""

from __future__ import annotations

import math

import torch

from qdsl.spec.diagnostics import NonFiniteError
from qdsl.spec.formats import int_code_range, pot_levels

__all__ = [
    "ROUNDINGS",
    "HALF_DTYPES",
    "check_finite",
    "scaled",
    "qrange",
    "round_",
    "reciprocal",
    "int_dtype",
    "param_shape",
    "param_view",
    "group_view",
    "reduce_view",
    "fake_quant_affine",
    "quantize_affine",
    "dequantize_affine",
    "pot_scale",
    "binary_codes",
    "fake_quant_binary",
    "ternary_params",
    "ternary_codes",
    "fake_quant_ternary",
    "pot_weight_levels",
    "pot_weight_codes",
    "pot_weight_decode",
    "fake_quant_pot_weight",
]

ROUNDINGS = ("half_even", "half_away", "floor", "stochastic")

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""Dtypes a quantizer upcasts to float32 (exactly) before computing, and casts back after."""


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise :class:`NonFiniteError` if ``x`` holds a NaN or an infinity.

    >>> check_finite(torch.tensor([1.0, float("nan")]), "conv1:input")
    Traceback (most recent call last):
    ...
    qdsl.spec.diagnostics.NonFiniteError: conv1:input: 1 non-finite value(s) (NaN or inf) in a tensor of shape (2,)
    """
    if x.is_floating_point():
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            raise NonFiniteError(f"{what}: {int(bad.sum())} non-finite value(s) (NaN or inf) in a tensor of "
                                 f"shape {tuple(x.shape)}")


def scaled(x: torch.Tensor, inv) -> torch.Tensor:
    """``x · inv`` with NaN replaced by 0 (so it rounds to the zero point's code); the
    infinities become the largest finite values, which every clamp maps to qmin/qmax.

    >>> scaled(torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0]), 0.5).tolist()[::3]
    [0.0, 1.5]
    """
    return torch.nan_to_num_(x * inv, nan=0.0)


# 1/sqrt(2) as float32: the boundary between two powers of two in the log domain.
_INV_SQRT2 = float(torch.tensor(1.0 / math.sqrt(2.0), dtype=torch.float32))


def qrange(bits: int, signed: bool, narrow: bool = False) -> tuple[int, int]:
    """Integer code range for ``bits``.  ``narrow`` drops the most negative (signed) or
    the largest (unsigned) code, making a signed range symmetric.

    >>> qrange(8, True), qrange(8, True, narrow=True), qrange(4, False), qrange(2, False, True)
    ((-128, 127), (-127, 127), (0, 15), (0, 2))
    """
    if bits < 1:
        raise ValueError(f"bits must be >= 1, got {bits}")
    return int_code_range(bits, signed, narrow)


def int_dtype(qmin: int, qmax: int) -> torch.dtype:
    """The narrowest of int8/uint8/int16/int32/int64 that holds ``[qmin, qmax]``.

    >>> int_dtype(-128, 127), int_dtype(0, 255), int_dtype(-2**15, 2**15 - 1), int_dtype(-2**31, 0)
    (torch.int8, torch.uint8, torch.int16, torch.int32)
    """
    for dt in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        info = torch.iinfo(dt)
        if info.min <= qmin and qmax <= info.max:
            return dt
    raise ValueError(f"no integer dtype holds [{qmin}, {qmax}]")


def round_(x: torch.Tensor, mode: str = "half_even", generator: torch.Generator | None = None) -> torch.Tensor:
    """Round to integers (still a float tensor).

    >>> t = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49999997])
    >>> round_(t).tolist()
    [-2.0, -2.0, -0.0, 0.0, 2.0, 2.0, 0.0]
    >>> round_(t, "half_away").tolist()
    [-3.0, -2.0, -1.0, 1.0, 2.0, 3.0, 0.0]
    >>> round_(t, "floor").tolist()
    [-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 0.0]
    """
    if mode == "half_even":
        return torch.round(x)
    if mode == "half_away":
        # floor(|x| + 0.5) is wrong for 0.49999997 (the add rounds up to 1.0); fix only
        # the exact ties of round(), where |x - trunc(x)| == 0.5 exactly (that is exact).
        t = torch.trunc(x)
        tie = (x - t).abs() == 0.5
        return torch.where(tie, t + torch.sign(x), torch.round(x))
    if mode == "floor":
        return torch.floor(x)
    if mode == "stochastic":
        f = torch.floor(x)
        u = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        return f + (u < (x - f)).to(x.dtype)
    raise ValueError(f"unknown rounding {mode!r}; known: {', '.join(ROUNDINGS)}")


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` in float32, IEEE-correctly rounded (what torch's kernels multiply by).

    >>> reciprocal(torch.tensor(0.1)).item() == float(torch.tensor(1.0) / torch.tensor(0.1))
    True
    """
    scale = torch.as_tensor(scale, dtype=torch.float32)
    return torch.ones_like(scale) / scale


def param_shape(shape: tuple[int, ...], axis: int | None = None, group_size: int | None = None) -> tuple[int, ...]:
    """Shape of the scale for a tensor of ``shape``: ``()``, ``(C,)`` or ``(C, G)``.

    >>> param_shape((8, 4, 3, 3)), param_shape((8, 4, 3, 3), axis=0), param_shape((8, 4, 3, 3), 0, 12)
    ((), (8,), (8, 3))
    """
    if group_size is not None:
        if len(shape) < 2:
            raise ValueError(f"group granularity needs a tensor with >= 2 dims, got shape {tuple(shape)}")
        row = math.prod(shape[1:])
        if group_size <= 0:
            raise ValueError(f"group size must be positive, got {group_size}")
        return (shape[0], -(-row // group_size))
    if axis is None:
        return ()
    return (shape[axis],)


def param_view(p: torch.Tensor, x: torch.Tensor, axis: int | None = None, group_size: int | None = None) -> torch.Tensor:
    """Reshape (for groups: expand) a ``[]``/``[C]``/``[C, G]`` parameter so it broadcasts
    against ``x``.

    >>> param_view(torch.tensor([1., 2.]), torch.zeros(2, 3, 4), axis=0).shape
    torch.Size([2, 1, 1])
    >>> param_view(torch.tensor([[1., 2.]]), torch.zeros(1, 2, 2), group_size=2).tolist()
    [[[1.0, 1.0], [2.0, 2.0]]]
    """
    if p.dim() == 0:
        return p
    if group_size is not None:
        e = p.repeat_interleave(group_size, dim=1)
        row = x[0].numel() if x.dim() else 1
        if e.shape[1] != row:  # a shorter last group (see the module docstring)
            e = e[:, :row]
        return e.reshape(x.shape)
    ax = axis % x.dim()
    shape = [1] * x.dim()
    shape[ax] = p.numel()
    return p.reshape(shape)


def group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[C, *rest]`` -> ``[C, G, g]``: one row per group (see the module docstring).

    >>> group_view(torch.arange(12.).reshape(2, 2, 3), 3).tolist()
    [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]]
    """
    c, g = param_shape(tuple(x.shape), group_size=group_size)
    return _padded_rows(x, c, g * group_size).reshape(c, g, group_size)


def _padded_rows(x: torch.Tensor, c: int, width: int) -> torch.Tensor:
    """``x.reshape(c, -1)`` zero-padded on the right to ``width`` columns."""
    rows = x.reshape(c, -1)
    if rows.shape[1] == width:
        return rows
    return torch.nn.functional.pad(rows, (0, width - rows.shape[1]))


def reduce_view(x: torch.Tensor, axis: int | None = None, group_size: int | None = None) -> torch.Tensor:
    """``x`` as ``[P, N]``: one row per scale slot (P = 1, C or C·G), for reductions.

    >>> reduce_view(torch.zeros(4, 6, 3), axis=0).shape, reduce_view(torch.zeros(4, 6, 3), group_size=2).shape
    (torch.Size([4, 18]), torch.Size([36, 2]))
    """
    if group_size is not None:
        c, g = param_shape(tuple(x.shape), group_size=group_size)
        return _padded_rows(x, c, g * group_size).reshape(-1, group_size)
    if axis is None:
        return x.reshape(1, -1)
    return x.movedim(axis, 0).reshape(x.shape[axis], -1)


def _prep(x, scale, zero_point, axis, group_size):
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    zp = torch.as_tensor(zero_point, device=x.device)
    inv = reciprocal(scale)
    return (
        param_view(scale, x, axis, group_size),
        param_view(inv, x, axis, group_size),
        param_view(zp.to(x.dtype), x, axis, group_size),
    )


def _codes(x, inv, z, qmin, qmax, rounding, generator):
    # Same order of float32 operations as torch's kernel: round(x * inv) + z, then clamp
    # (NaN -> code z: see "Non-finite values" in the module docstring).
    return torch.clamp(round_(scaled(x, inv), rounding, generator) + z, qmin, qmax)


def fake_quant_affine(
    x: torch.Tensor,
    scale,
    zero_point,
    qmin: int,
    qmax: int,
    rounding: str = "half_even",
    axis: int | None = None,
    group_size: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``x̂ = (clamp(round(x · (1/s)) + z, qmin, qmax) − z) · s`` (see the module docstring).

    >>> x = torch.tensor([-1.0, -0.26, 0.0, 0.25, 0.3, 2.0])
    >>> fake_quant_affine(x, torch.tensor(0.1), torch.tensor(0), -8, 7).tolist() == \\
    ...     torch.fake_quantize_per_tensor_affine(x, 0.1, 0, -8, 7).tolist()
    True
    >>> fake_quant_affine(torch.tensor([[1., 2.], [3., 4.]]), torch.tensor([1., 2.]), torch.tensor([0, 0]),
    ...                   -2, 1, axis=0).tolist()
    [[1.0, 1.0], [2.0, 2.0]]
    """
    s, inv, z = _prep(x, scale, zero_point, axis, group_size)
    return (_codes(x, inv, z, qmin, qmax, rounding, generator) - z) * s


def quantize_affine(
    x: torch.Tensor,
    scale,
    zero_point,
    qmin: int,
    qmax: int,
    rounding: str = "half_even",
    axis: int | None = None,
    group_size: int | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The integer codes ``clamp(round(x · (1/s)) + z, qmin, qmax)`` as an integer tensor
    (``dtype`` defaults to the narrowest that holds ``[qmin, qmax]``).

    >>> quantize_affine(torch.tensor([-1.0, 0.04, 0.06, 9.0]), torch.tensor(0.1), torch.tensor(3), 0, 15).tolist()
    [0, 3, 4, 15]
    """
    _, inv, z = _prep(x, scale, zero_point, axis, group_size)
    q = _codes(x, inv, z, qmin, qmax, rounding, generator)
    if qmax > 2**24 or qmin < -(2**24):
        # float32 cannot hold every code of a wide range (2^31 - 1 rounds to 2^31): clamp
        # again after the exact conversion to int64 so the cast below cannot wrap.
        q = q.to(torch.int64).clamp(qmin, qmax)
    return q.to(dtype or int_dtype(qmin, qmax))


def dequantize_affine(
    q: torch.Tensor, scale, zero_point, axis: int | None = None, group_size: int | None = None
) -> torch.Tensor:
    """``(q − z) · s`` in float32; ``dequantize_affine(quantize_affine(x, ...), ...)`` equals
    ``fake_quant_affine(x, ...)`` exactly.

    >>> dequantize_affine(torch.tensor([0, 3, 4, 15]), torch.tensor(0.5), torch.tensor(3)).tolist()
    [-1.5, 0.0, 0.5, 6.0]
    """
    qf = q.to(torch.float32)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    zp = torch.as_tensor(zero_point, device=q.device).to(torch.float32)
    return (qf - param_view(zp, qf, axis, group_size)) * param_view(scale, qf, axis, group_size)


def pot_scale(s: torch.Tensor, mode: str = "round") -> torch.Tensor:
    """Restrict a positive scale to a power of two.

    * ``"round"``: nearest power of two **in the log domain**, ``2^round(log2 s)``: with
      ``s = m·2^e`` (``m`` in [0.5, 1), from ``frexp``) the result is ``2^e`` when
      ``m >= 1/√2`` (float32-rounded) and ``2^(e−1)`` otherwise.  The boundary case goes
      up.  This can shrink the scale by up to √2 and so clip the largest values.
    * ``"ceil"``: the smallest power of two ``>= s`` (never clips; up to 2× coarser).

    Computed with ``frexp`` rather than ``log2`` so exact powers of two stay put.

    >>> pot_scale(torch.tensor([0.1, 0.7, 0.75, 1.0, 3.0])).tolist()
    [0.125, 0.5, 1.0, 1.0, 4.0]
    >>> pot_scale(torch.tensor([0.1, 0.5, 0.51, 3.0]), "ceil").tolist()
    [0.125, 0.5, 1.0, 4.0]
    """
    s = torch.as_tensor(s, dtype=torch.float32)
    m, e = torch.frexp(s)
    if mode == "round":
        exp = torch.where(m >= _INV_SQRT2, e, e - 1)
    elif mode == "ceil":
        exp = torch.where(m == 0.5, e - 1, e)
    else:
        raise ValueError(f"unknown pot mode {mode!r}; known: round, ceil")
    return torch.ldexp(torch.ones_like(s), exp).to(torch.float32)


def binary_codes(x: torch.Tensor, alpha=None, signed: bool = True, axis=None, group_size=None) -> torch.Tensor:
    """Binary codes as int8.  Signed: ``sign(x)`` with ``sign(0) = +1`` (so every code is
    ±1, as XNOR-popcount hardware needs).  Unsigned ({0, 1}): ``x >= α/2`` (nearest of
    0 and α; ``alpha`` required).

    >>> binary_codes(torch.tensor([-0.5, 0.0, 2.0])).tolist()
    [-1, 1, 1]
    >>> binary_codes(torch.tensor([0.2, 0.5, 2.0]), torch.tensor(1.0), signed=False).tolist()
    [0, 1, 1]
    """
    if signed:
        return torch.where(x < 0, -1, 1).to(torch.int8)  # NaN compares false: +1, like 0
    a = param_view(torch.as_tensor(alpha, dtype=x.dtype, device=x.device), x, axis, group_size)
    return (x >= a * 0.5).to(torch.int8)


def fake_quant_binary(x: torch.Tensor, alpha, signed: bool = True, axis=None, group_size=None,
                      threshold: torch.Tensor | None = None) -> torch.Tensor:
    """``α · code`` with the codes of :func:`binary_codes`; ``α`` per tensor/channel/group.
    A signed ``threshold`` (already viewed to broadcast against ``x``) moves the sign
    change from 0 to it: ``-α`` where ``x < t``, ``+α`` at and above it (and for NaN).

    >>> fake_quant_binary(torch.tensor([[-3., 1.], [0., -2.]]), torch.tensor([2., 1.]), axis=0).tolist()
    [[-2.0, 2.0], [1.0, -1.0]]
    """
    a = param_view(torch.as_tensor(alpha, dtype=x.dtype, device=x.device), x, axis, group_size)
    if signed:
        t = 0 if threshold is None else threshold
        if _select_by_mask(x, a, signed=True):
            # -2α·[x < t] + α: exactly -α or +α (2α is exact and finite, checked)
            return torch.lt(x, t, out=torch.empty_like(x)).mul_(-2 * a).add_(a)
        return torch.where(x < t, -a, a)  # NaN -> +α, as binary_codes
    if _select_by_mask(x, a, signed=False):
        return torch.ge(x, a * 0.5, out=torch.empty_like(x)).mul_(a)  # α·[x >= α/2]; α > 0: +0.0 below
    return torch.where(x >= a * 0.5, a, torch.zeros_like(a))


def _select_by_mask(x: torch.Tensor, a: torch.Tensor, signed: bool) -> bool:
    """Whether :func:`fake_quant_binary` may compute its ``torch.where`` as a float mask
    times α: the same values bit for bit (signs of zeros included), and about 3x faster on
    CPU (torch 2.13, 1 thread, 2M floats: ``where`` with a broadcast α 15 ms, ``lt`` into a
    float buffer then ``mul_``/``add_`` 4 ms; binary activations before freeze went from
    1.39x to 1.1x float in benchmarks/qat_compile.py).  Needs α finite and non-zero with
    2α finite (signed), α positive (unsigned: ``0·α`` is then +0.0, as ``where``'s zeros),
    and no autograd through α (``where``'s gradient to α is the same, but not worth the
    in-place bookkeeping), and a result of ``x``'s own shape."""
    if torch.compiler.is_compiling():
        return False  # the check below is data-dependent (a graph break); the compiler fuses where anyway
    if (a.requires_grad and torch.is_grad_enabled()) or not x.is_floating_point() or a.dtype != x.dtype:
        return False
    if a.dim() > x.dim() or any(sa not in (1, sx) for sa, sx in zip(reversed(a.shape), reversed(x.shape))):
        return False
    ok = (a > 0) if not signed else (a != 0)
    return bool((ok & (a.abs() <= torch.finfo(a.dtype).max / 2)).all())


def ternary_params(x: torch.Tensor, axis=None, group_size=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(threshold, alpha)`` per slot (TWN): ``Δ = 0.7·mean|x|`` and ``α = mean(|x| where |x| > Δ)``
    (``α = 0`` when nothing exceeds Δ, e.g. an all-zero channel).

    >>> d, a = ternary_params(torch.tensor([[1., -1., 0.1, 0.], [2., 2., 2., 2.]]), axis=0)
    >>> [round(v, 4) for v in d.tolist()], [round(v, 4) for v in a.tolist()]
    ([0.3675, 1.4], [1.0, 2.0])
    """
    r = reduce_view(x.detach(), axis, group_size).abs()
    delta = 0.7 * r.mean(dim=1)
    above = r > delta[:, None]
    alpha = (r * above).sum(dim=1) / above.sum(dim=1).clamp_min(1)
    shape = param_shape(tuple(x.shape), axis, group_size)
    return delta.reshape(shape), alpha.reshape(shape)


def ternary_codes(x: torch.Tensor, threshold, axis=None, group_size=None) -> torch.Tensor:
    """``sign(x) · [|x| > Δ]`` as int8 codes in {-1, 0, 1}.

    >>> ternary_codes(torch.tensor([-1., -0.2, 0.2, 0.3, 1.]), torch.tensor(0.25)).tolist()
    [-1, 0, 0, 1, 1]
    """
    d = param_view(torch.as_tensor(threshold, dtype=x.dtype, device=x.device), x, axis, group_size)
    # NaN: |x| > Δ is false -> 0 (``sign(NaN) * False`` would be NaN, whose int cast is undefined)
    return torch.where(x.abs() > d, torch.sign(x), torch.zeros_like(x)).to(torch.int8)


def fake_quant_ternary(x: torch.Tensor, threshold, alpha, axis=None, group_size=None) -> torch.Tensor:
    """``α · sign(x) · [|x| > Δ]``.

    >>> fake_quant_ternary(torch.tensor([-1., -0.2, 0.2, 0.3, 1.]), torch.tensor(0.25), torch.tensor(0.8)).tolist()
    [-0.800000011920929, 0.0, 0.0, 0.800000011920929, 0.800000011920929]
    """
    a = param_view(torch.as_tensor(alpha, dtype=x.dtype, device=x.device), x, axis, group_size)
    # via the int codes so a zeroed negative value is +0.0, like the integer graph's output
    return ternary_codes(x, threshold, axis, group_size).to(x.dtype) * a


def pot_weight_levels(bits: int) -> int:
    """Number ``n`` of magnitudes of a ``bits``-bit power-of-two weight: one bit is the sign,
    the remaining ``2^(bits−1)`` codes are 0 and the ``n = 2^(bits−1) − 1`` magnitudes
    ``s·2^0, s·2^−1, …, s·2^−(n−1)`` (``s`` = the scale, the largest magnitude).

    >>> [pot_weight_levels(b) for b in (2, 3, 4, 8)]
    [1, 3, 7, 127]
    """
    return pot_levels(bits)


def pot_weight_codes(x: torch.Tensor, scale, bits: int, axis=None, group_size=None) -> torch.Tensor:
    """Power-of-two weight codes ``c`` in ``[−n, n]`` (int8 for ``bits <= 8``): ``c = 0`` is 0,
    otherwise the value is ``sign(c) · s · 2^(|c| − n)``.

    Each ``r = |x|/s`` goes to the *linearly* nearest level: ``r >= 1`` -> ``|c| = n``;
    between ``2^k`` and ``2^(k+1)`` the midpoint ``1.5·2^k`` rounds up; below the smallest
    level ``2^−(n−1)``, values ``>= 2^−n`` (its half) round up to it, smaller ones to 0.

    >>> pot_weight_codes(torch.tensor([0.0, 0.1, 0.126, 0.3, 0.375, -0.8, 5.0]), torch.tensor(1.0), 3).tolist()
    [0, 0, 1, 1, 2, -3, 3]
    """
    n = pot_weight_levels(bits)
    s = param_view(torch.as_tensor(scale, dtype=torch.float32, device=x.device), x, axis, group_size)
    r = x.abs() / s
    m, e = torch.frexp(r)  # r = m·2^e, m in [0.5, 1): r lies in [2^(e-1), 2^e)
    k = torch.where(m >= 0.75, e, e - 1)  # exponent of the nearest power of two
    k = torch.clamp(k, max=0)
    mag = (k + n).to(torch.int64)  # |c| = n + k
    mag = torch.where(r >= 2.0 ** (-n), mag.clamp(min=1), torch.zeros_like(mag))
    mag = torch.where(r == 0, torch.zeros_like(mag), mag)
    c = torch.where(x < 0, -mag, mag)
    return c.to(int_dtype(-n, n))


def pot_weight_decode(codes: torch.Tensor, scale, bits: int, axis=None, group_size=None) -> torch.Tensor:
    """Values of power-of-two weight codes (exact in float32).

    >>> pot_weight_decode(torch.tensor([0, 1, 2, -3]), torch.tensor(1.0), 3).tolist()
    [0.0, 0.25, 0.5, -1.0]
    """
    n = pot_weight_levels(bits)
    c = codes.to(torch.int64)
    s = param_view(torch.as_tensor(scale, dtype=torch.float32, device=codes.device), codes, axis, group_size)
    mag = torch.ldexp(torch.ones(c.shape, dtype=torch.float32, device=c.device), c.abs() - n)
    return torch.where(c == 0, torch.zeros_like(mag), torch.sign(c).to(torch.float32) * mag) * s


def fake_quant_pot_weight(x: torch.Tensor, scale, bits: int, axis=None, group_size=None) -> torch.Tensor:
    """Round every value to ``0`` or ``±s·2^−j`` (``0 <= j < n``), see :func:`pot_weight_codes`.

    >>> fake_quant_pot_weight(torch.tensor([0.1, 0.3, -0.8, 5.0]), torch.tensor(1.0), 3).tolist()
    [0.0, 0.25, -1.0, 1.0]
    """
    return pot_weight_decode(pot_weight_codes(x, scale, bits, axis, group_size), scale, bits, axis, group_size)

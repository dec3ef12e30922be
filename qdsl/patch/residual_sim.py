"""Fake quantization that adds a post-norm residual sum the way the integer graph does.

A post-norm block's ``LayerNorm(dense(h) + x)`` (Hugging Face BERT's BertSelfOutput and
BertOutput; ``nn.TransformerEncoderLayer(norm_first=False)``) with no quantizer on the
LayerNorm's input is one LAYERNORM in the graph, reading the sum wide
(qdsl.export.lower_attn.layernorm_pending): each term is brought to one power-of-two int32
grid ``s_t`` and the terms are added in integers:

* a Linear's result with no output quantizer (a :class:`LinearTerm`): the exact sum
  ``A = Σ (x_q - z)·w_q + b`` (int32 accumulator), written by LINEAR as int32 at ``s_t``
  (``A·s_acc[c]/s_t`` rounded half away once: export's default ``requant="single"``);
* a LayerNorm's wide output (a :class:`WideTerm`): its accumulator at its unit ``u``,
  rescaled by ``u/s_t``;

and ``s_t = wide_sum_grid(Σ bounds)``, each term's worst case from its codes
(:func:`~qdsl.graph.ops.weighted.accumulator_bound`,
:func:`~qdsl.graph.ops.layernorm.wide_output_bound`: the functions the exporter sizes the
grid with).  The fake-quant model's float32 sum rounds the Linear's sum and the add each to
24 bits, and qdsl.patch.int_sim's value grid (:func:`~qdsl.patch.int_sim.wide_grid`) is not
``s_t``: near a rounding boundary of the next 8-bit quantizer the two land on different
codes, and each later softmax amplifies those (MiniLM, end to end: 98.0% equal codes after
block 0, 66% after block 4).

How the terms are found.  The graph's term structure comes from the export trace, which
for a Hugging Face model exists only at export.  Here, once frozen, every Linear whose
result is an accumulator marks its output tensor with a :class:`LinearTerm` (its input, the
sum is only computed when a LayerNorm reads it), and every simulated wide LayerNorm marks
its output with a :class:`WideTerm` (its exact accumulator).  A LayerNorm's input is such a
sum when the float32 sum of two recently marked tensors *is* its input, bit for bit (a float
add is commutative, so the operand order does not matter; dropout in eval returns its input
tensor itself).  Anything else (the embeddings' three lookups, a quantized operand) keeps
int_sim's value grid.

The result goes through :func:`qdsl.graph.ops.layernorm.layernorm` (the reference
executor's function) with the exporter's per-term rescales; the gradient is the float
one (straight-through in int_sim).  Assumed: export's default rescales
(``requant="single"``); a graph exported with ``requant="gemmlowp"`` rounds twice.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from qdsl.graph.ops.layernorm import layernorm_constants, wide_output_bound, wide_sum_grid
from qdsl.graph.ops.weighted import accumulator_bound
from qdsl.graph.requant import INT32_MAX, INT32_MIN, apply_rescale, make_rescale
from qdsl.graph.schema import Rescale, RescaleKind, Rounding
from qdsl.patch.frozen import frozen_layer
from qdsl.spec.model import Overflow

__all__ = ["LinearTerm", "WideTerm", "CodesTerm", "ConstTerm", "TermLog", "residual_terms", "mark_wide", "wide_codes", "wide_term",
           "layernorm_constants_at", "exact_accumulator", "linear_codes", "rescale_codes", "F32_EXACT", "NEAR_TIE"]

F32_EXACT = 2**24
"""Integers below this are exact in binary32 (the Linear's partial sums on its codes)."""

_IDENTITY = Rescale(RescaleKind.POT, [1], [0])

SINGLE_ROUNDING = True
"""The rescales of export's default ``requant="single"`` (FIXED_SINGLE: one rounding)."""


def _operands(patch, grid: tuple):
    """``(w codes - zp (O, K) float32, bias int64 or None, s_acc (O,), bound, chunk, fits)`` of a
    frozen Linear reading ``grid``, derived from its frozen record as export derives them
    (cached per record): ``chunk`` input features per float32 product keep every partial sum
    below 2^24, so the sums on codes are exact integers in any order."""
    rec = frozen_layer(patch)
    cached = patch.__dict__.get("_residual_operands")
    if cached is not None and cached[0] is rec and cached[1] == grid:
        return cached[2]
    codes, s_w = rec.weight_grid()
    w_zp = np.broadcast_to(rec.weight_zero_point.reshape(-1).numpy().astype(np.int64), (codes.shape[0],))
    s_acc = np.float64(grid[0]) * np.broadcast_to(s_w, (codes.shape[0],))
    bias = rec.bias_at(s_acc)
    bias = None if bias is None else bias.astype(np.int64)
    x_max = max(abs(grid[2] - grid[1]), abs(grid[3] - grid[1]))
    w = codes.reshape(codes.shape[0], -1) - w_zp.reshape(-1, 1)
    w_max = int(np.abs(w).max(initial=1)) or 1
    chunk = max(1, (F32_EXACT - 1) // (max(x_max, 1) * w_max))
    bound = accumulator_bound(codes, w_zp, x_max, bias, s_acc)
    # every reachable sum inside the accumulator: no wrap or saturation to apply
    fits = float(((np.abs(w).sum(axis=1) * x_max + (np.abs(bias) if bias is not None else 0))).max(initial=0)) \
        < 2.0 ** (patch.plan.accumulator.bits - 1) - 1
    ops = (torch.from_numpy(w.astype(np.float32)), None if bias is None else torch.from_numpy(bias.astype(np.float64)),
           s_acc, bound,
           chunk, fits)
    patch._residual_operands = (rec, grid, ops)
    return ops


def exact_accumulator(patch, x: torch.Tensor, grid: tuple) -> torch.Tensor:
    """The graph's LINEAR accumulator (the spec's accumulator wrap/saturate applied) of a
    frozen Linear on its fake-quantized input ``x`` (``grid``: its input quantizer's), as
    binary64 holding exact integers: float32 products of codes summed in chunks that stay
    exact (:func:`_operands`), the chunks and the bias added in binary64 (below 2^53)."""
    w, bias, _, bound, chunk, fits = _operands(patch, grid)
    xq = torch.div(x.detach().cpu().float(), grid[0]).round_()  # q - z: |q - z| <= 255, off by < 2^-14
    k = w.shape[1]
    acc = None
    for lo in range(0, k, chunk):  # in place from here on: the same operations, fewer passes
        part = F.linear(xq[..., lo:lo + chunk], w[:, lo:lo + chunk]).double()
        acc = part if acc is None else acc.add_(part)
    if bias is not None:
        acc.add_(bias)
    if fits:  # every reachable sum inside the accumulator (accumulator_bound): nothing to wrap
        return acc
    a = patch.plan.accumulator
    half = float(1 << (a.bits - 1))
    if a.overflow is Overflow.SATURATE:
        return acc.clamp_(-half, half - 1)
    return torch.remainder(acc + half, 2 * half) - half


NEAR_TIE = 2.0**-40
"""Relative distance to a rounding boundary below which :func:`rescale_codes` asks the
reference (binary64 rounds ``acc·m/2^(31+s)`` to 2^-53 relative: far inside it)."""


def rescale_codes(acc: torch.Tensor, rescale: Rescale) -> torch.Tensor:
    """``apply_rescale(acc, rescale)`` along the last axis (qdsl.graph.requant, the reference)
    of integers held in binary64 (``|acc| < 2^53``), as binary64 integers: the binary64
    product decides every rounding but those within :data:`NEAR_TIE` of a boundary, which the
    reference decides on those elements only (its int64 per-channel shifts are ~50x slower).
    Exact by construction."""
    kind = rescale.kind
    if kind not in (RescaleKind.POT, RescaleKind.FIXED_SINGLE):  # gemmlowp's two roundings
        ref = apply_rescale(acc.to(torch.int64).numpy(), rescale, axis=acc.dim() - 1)
        return torch.from_numpy(ref).double()
    m = np.asarray(rescale.multiplier, dtype=np.int64)
    sh = np.asarray(rescale.shift, dtype=np.int64)
    single = kind == RescaleKind.FIXED_SINGLE
    # the clamp is a copy: skipped when it changes nothing (one read pass, no write)
    t = acc if acc.numel() and _inside(acc, INT32_MIN, INT32_MAX) else acc.clamp(INT32_MIN, INT32_MAX)
    if (sh < 0).any():  # left shifts (factors above 1): saturated as the reference does
        t = (t * torch.from_numpy(np.exp2(np.maximum(-sh, 0)))).clamp(INT32_MIN, INT32_MAX)
    scale = (m if single else np.ones_like(m)) * np.exp2(-(np.maximum(sh, 0) + (31 if single else 0)))
    y = t * torch.from_numpy(scale.astype(np.float64))
    rounding = Rounding(rescale.rounding)
    out = torch.floor(y) if rounding == Rounding.FLOOR else torch.round(y)
    if y.numel():
        lo, hi = torch.aminmax(y)  # max |y| without an |y| temporary (abs is exact)
        tol = NEAR_TIE * (max(-float(lo), float(hi)) + 1.0)
    else:
        tol = 0.0
    # distance to the nearest boundary (an integer for floor, a half for the others),
    # computed in y's own buffer (y is not read again; a fresh binary64 tensor of the output's
    # size costs its page faults): the same operations as ((y - out).abs() - 0.5).abs()
    dist = y.sub_(torch.round(y)).abs_() if rounding == Rounding.FLOOR else y.sub_(out).abs_().sub_(0.5).abs_()
    near = dist <= tol
    if bool(near.any()):
        idx = near.nonzero(as_tuple=True)
        ch = idx[-1].numpy() if m.size > 1 else np.zeros(idx[-1].numel(), dtype=np.int64)
        sub = Rescale(kind, [int(v) for v in m[ch]], [int(v) for v in sh[ch]], rescale.rounding)
        vals = acc[idx].to(torch.int64).numpy()
        out[idx] = torch.from_numpy(apply_rescale(vals, sub, axis=0) if vals.size > 1 else
                                    apply_rescale(vals, Rescale(kind, [int(m[ch[0]])], [int(sh[ch[0]])],
                                                                rescale.rounding), axis=0)).double()
    return out.clamp_(INT32_MIN, INT32_MAX)


def _inside(t: torch.Tensor, lo: float, hi: float) -> bool:
    """Every entry of ``t`` in ``[lo, hi]`` (False with a NaN: the clamp then runs as before)."""
    a, b = torch.aminmax(t)
    return bool(a >= lo) and bool(b <= hi)


def _rescale(patch, ops: tuple, factor_of: float, rounding: Rounding) -> Rescale:
    """``make_rescale(s_acc / factor_of, rounding, single)`` of a frozen Linear's operands
    (``ops``, :func:`_operands`), derived once per operands, grid and rounding: a Python loop
    over the channels that gave the same result at every forward."""
    cached = patch.__dict__.get("_residual_rescales")
    if cached is None or cached[0] is not ops:
        cached = (ops, {})
        patch._residual_rescales = cached
    key = (factor_of, rounding)
    r = cached[1].get(key)
    if r is None:
        r = cached[1][key] = make_rescale(ops[2] / factor_of, rounding, single=SINGLE_ROUNDING)
    return r


def linear_codes(patch, x: torch.Tensor, grid: tuple, out_grid: tuple) -> torch.Tensor:
    """The graph's LINEAR output codes at ``out_grid`` (int_sim.grid_of of its output
    quantizer), as binary64: the exact accumulator rescaled by ``s_acc/s_out`` (one rounding,
    the quantizer's mode), not the quantizer's rounding of the float32 sum."""
    s_out, zp, qmin, qmax, rounding = out_grid
    rescale = _rescale(patch, _operands(patch, grid), s_out, rounding)
    return rescale_codes(exact_accumulator(patch, x, grid), rescale).add_(zp).clamp_(qmin, qmax)


@attrs.define(eq=False)
class LinearTerm:
    """A frozen Linear's result read wide: its patch, its (fake-quantized) input and input grid."""

    patch: Any
    x: torch.Tensor
    grid: tuple

    def bound(self) -> float:
        return _operands(self.patch, self.grid)[3]

    def at(self, s_t: float, rounding: Rounding) -> tuple[np.ndarray, Rescale, int]:
        """The LINEAR's int32 output at ``s_t`` (identity rescale in the LAYERNORM)."""
        acc = exact_accumulator(self.patch, self.x, self.grid)
        # the Pending's I32 target: half away, export's default rescale (FIXED_SINGLE)
        rescale = _rescale(self.patch, _operands(self.patch, self.grid), s_t, Rounding.HALF_AWAY)
        return rescale_codes(acc, rescale).to(torch.int64).numpy(), _IDENTITY, 0


@attrs.define(eq=False)
class WideTerm:
    """A simulated LayerNorm's wide output: its accumulator ``acc`` at ``unit``."""

    acc: np.ndarray
    unit: float
    bound_: float

    def bound(self) -> float:
        return self.bound_

    def at(self, s_t: float, rounding: Rounding) -> tuple[np.ndarray, Rescale, int]:
        return self.acc, make_rescale(self.unit / s_t, rounding, single=SINGLE_ROUNDING), 0


@attrs.define(eq=False)
class CodesTerm:
    """An 8-bit quantized value read by a wide sum (an embedding lookup's output): its codes at
    its quantizer's ``grid``; ``fixed``: computed from model buffers only (position and
    token-type ids), which the exporter folds into one constant."""

    x: torch.Tensor
    grid: tuple
    fixed: bool

    def codes(self) -> np.ndarray:
        return np.rint(self.x.detach().double().cpu().numpy() / self.grid[0]).astype(np.int64) + self.grid[1]

    def bound(self) -> float:
        s, zp, qmin, qmax = self.grid[:4]
        return max(abs(qmin - zp), abs(qmax - zp)) * s

    def at(self, s_t: float, rounding: Rounding) -> tuple[np.ndarray, Rescale, int]:
        return self.codes(), make_rescale(self.grid[0] / s_t, rounding, single=SINGLE_ROUNDING), self.grid[1]


@attrs.define(eq=False)
class ConstTerm:
    """The constant the exporter folds from the fixed lookups (their float32 sum, one batch
    row), added at the sum's grid."""

    value: np.ndarray

    def bound(self) -> float:
        return float(np.abs(self.value).max(initial=0))

    def at(self, s_t: float, rounding: Rounding) -> tuple[np.ndarray, Rescale, int]:
        return np.rint(self.value / s_t).astype(np.int64), _IDENTITY, 0


class TermLog:
    """The tensors most recently marked with a term: a weak reference to each (identity:
    :meth:`term_of`) and its detached value (a sum's operand may be a temporary that is gone
    by the time the LayerNorm runs, ``LayerNorm(dense(h) + x)``)."""

    SIZE = 8

    def __init__(self) -> None:
        self._recent: collections.deque = collections.deque(maxlen=self.SIZE)
        self.inputs: set[int] = set()
        """Storage addresses of the model's input tensors in the current call."""

    def __getstate__(self) -> dict:
        return {}  # this process's tensors: a copy starts empty

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def read_inputs(self, module: Any, args: tuple, kwargs: dict) -> None:
        """The model's forward pre-hook: which tensors are its inputs (read by EmbeddingMark)."""
        self.inputs = {t.untyped_storage().data_ptr() for t in (*args, *kwargs.values())
                       if isinstance(t, torch.Tensor)}

    def mark(self, t: torch.Tensor, term: Any) -> None:
        self._recent.append((weakref.ref(t), t.detach(), term))

    def term_of(self, t: torch.Tensor) -> Any:
        """The term ``t`` itself was marked with, or None."""
        return next((term for ref, _, term in reversed(self._recent) if ref() is t), None)

    def find(self, x: torch.Tensor) -> list | None:
        """Two marked tensors whose float sum is ``x`` bit for bit (most recent first), as
        their terms, or None."""
        alive = [(t, term) for _, t, term in reversed(self._recent)
                 if t.shape == x.shape and t.dtype == x.dtype and t.device == x.device]
        with torch.no_grad():
            for i, (a, ta) in enumerate(alive):
                for b, tb in alive[i + 1:]:
                    if torch.equal(a + b, x):
                        return [ta, tb]
            return self._lookups(x)

    def _lookups(self, x: torch.Tensor) -> list | None:
        """An embedding sum: one lookup of the ids plus fixed lookups (BERT's word + token type
        + position), ``(a + b) + c`` in float32 equal to ``x``, as the exporter reads it: the
        lookup's codes and the fixed ones' float32 sum as one constant."""
        found = [(t, term) for _, t, term in reversed(self._recent) if isinstance(term, CodesTerm)
                 and t.dtype == x.dtype and t.dim() == x.dim() and all(d in (1, e) for d, e in zip(t.shape, x.shape))]
        for i, (a, ta) in enumerate(found):
            for j, (b, tb) in enumerate(found[i + 1:], i + 1):
                for c, tc in (f for k, f in enumerate(found) if k not in (i, j)):
                    terms = (ta, tb, tc)
                    if sum(not t.fixed for t in terms) != 1 or (a + b + c).shape != x.shape \
                            or not torch.equal(a + b + c, x):
                        continue
                    fixed = [t.x.detach() for t in terms if t.fixed]
                    const = (fixed[0] + fixed[1]).double()
                    if not bool((const == const[:1]).all()):
                        return None  # rows differ: not one constant
                    return [next(t for t in terms if not t.fixed), ConstTerm(const[:1].cpu().numpy())]
        return None


def residual_terms(module: Any, x: torch.Tensor, log: TermLog, rounding: Rounding) -> tuple | None:
    """The graph's LAYERNORM inputs for ``module`` (an ``nn.LayerNorm``) reading ``x`` wide:
    ``(input codes, attrs with in_*, s_t)``, or None when ``x`` is not a sum of two marked terms."""
    terms = log.find(x)
    if terms is None:
        return None
    n = int(module.normalized_shape[0])
    s_t = wide_sum_grid(sum(t.bound() for t in terms), n, float(module.eps))
    parts = [t.at(s_t, rounding) for t in terms]
    codes = [p[0] for p in parts]
    rescales = [p[1] for p in parts]
    a = dict(in_zp=tuple(p[2] for p in parts), in_kind=tuple(int(r.kind) for r in rescales),
             in_multiplier=tuple(int(r.multiplier[0]) for r in rescales),
             in_shift=tuple(int(r.shift[0]) for r in rescales), in_rounding=tuple(int(r.rounding) for r in rescales))
    return codes, a, s_t


def wide_codes(term: WideTerm, grid: tuple) -> torch.Tensor:
    """The 8-bit codes an input quantizer with ``grid`` (int_sim.grid_of) reads from a wide
    LayerNorm output: the graph's REQUANTIZE of its accumulator by ``unit/s`` (one rounding,
    the quantizer's mode), not the quantizer's rounding of ``float32(acc)·float32(unit)/s``."""
    s, zp, qmin, qmax, rounding = grid
    rescale = make_rescale(term.unit / s, rounding, single=SINGLE_ROUNDING)
    return rescale_codes(torch.from_numpy(term.acc).double(), rescale).add_(zp).clamp_(qmin, qmax)


def mark_wide(log: TermLog, value: torch.Tensor, module: Any, acc: np.ndarray) -> None:
    """Mark ``value`` as ``module``'s (an ``nn.LayerNorm``) wide output with accumulator
    ``acc``: a tensor fed to a frozen model in place of that output (a block fed the graph's own
    input) is then read as the graph reads it."""
    g_int, b_int, unit, _ = layernorm_constants_at(module, 1.0)  # the affine codes do not depend on the grid
    log.mark(value, wide_term(g_int, b_int, unit, np.asarray(acc, dtype=np.int64)))


def wide_term(g_int: np.ndarray, b_int: np.ndarray, unit: float, acc: np.ndarray) -> WideTerm:
    """The mark of a simulated LayerNorm's wide output (its exporter bound)."""
    return WideTerm(acc, unit, wide_output_bound(g_int, b_int, unit))


def layernorm_constants_at(module: Any, s_in: float):
    """:func:`~qdsl.graph.ops.layernorm.layernorm_constants` of ``module`` at the grid ``s_in``."""
    n = int(module.normalized_shape[0])
    weight = None if module.weight is None else module.weight.detach().double().cpu().numpy()
    bias = None if module.bias is None else module.bias.detach().double().cpu().numpy()
    return layernorm_constants(n, weight, bias, float(module.eps), s_in)

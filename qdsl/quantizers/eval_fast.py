"""Evaluation fast paths of :class:`~qdsl.quantizers.proxy.TensorQuantizer`: no autograd,
not compiled, values equal to the general path's bit for bit
(``tests/quantizers/test_eval_fast_paths.py``, ``test_eval_shared.py`` and
``tests/qat/test_eval_plan.py`` compare them).  The proxy's ``forward`` calls
:func:`eval_fast` with the kind :func:`plan` decided for its state; the view builders
(frozen, static before freeze, dynamic) and the passes (:func:`fast`) live here.

Two things cost an evaluation forward before the elementwise passes themselves, and
matter on small layers (a transformer encoder's 29 activation quantizers per layer pair):

* **A dynamic per-tensor int quantizer's scale** (:func:`dynamic_int_params`): the general
  path derives scale and zero point from the batch range in ~40 tensor ops on one or two
  numbers (each a dispatch of several microseconds).  Here the range comes from one
  ``aminmax`` and the scale and zero point from binary32 scalar arithmetic (Python floats,
  each operation rounded once to binary32, as torch's float32 kernels do; numpy ``float32``
  for an overflowing quotient),
  the formula of :func:`qdsl.quantizers.range_search.range_to_qparams` and
  :class:`qdsl.quantizers.formats.int.IntOps` step by step.
* **One tensor quantized by several readers** (:class:`SharedInputs`): a BERT layer's
  query, key and value Linears each quantize the same hidden states with their own
  input quantizer; with identical parameters (dynamic: the same recipe; static: the same
  calibrated scale and zero point) the fake-quantized tensor is the same, so it is
  computed once.  The tensor is shared by reference among those readers (input
  quantizers only: Linear/Conv/attention read their input without writing it); an
  in-place edit of either tensor (its version counter) ends the sharing.
"""

from __future__ import annotations

import math
import struct
import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from qdsl.quantizers import native_fq as NFQ
from qdsl.quantizers.formats.int import IntOps
from qdsl.quantizers.observers import EmaObserver, MinMaxObserver
from qdsl.quantizers.scales import FloatScale
from qdsl.spec.model import Role

__all__ = ["SharedInputs", "dynamic_int_params", "views_fingerprint", "SHARED", "plan", "eval_fast", "fast"]

_F32 = np.float32
_TINY32 = float(np.float32(1e-12))
"""``range_search._TINY`` as ``torch.clamp(float32, min=1e-12)`` compares it: in binary32."""


_WIDE = 3.0e38
"""Ranges at least this wide (binary32's largest value is 3.4e38) are left to the tensor
path: their width may overflow binary32, where numpy would warn."""


def dynamic_int_params(lo: float, hi: float, qmin: int, qmax: int, symmetric: bool) -> tuple[float, int] | None:
    """``(scale, zero_point)`` of the range ``lo..hi`` (finite binary32 values held in Python
    floats) for an int quantizer with a ``float`` scale rule: the values
    ``IntOps.qparams(range_to_qparams(lo, hi))`` computes in float32 tensors.  None for a
    range :data:`_WIDE` or wider.

    Each binary32 operation is done in binary64 and rounded once to binary32 (:func:`_f32`):
    for ``+ - × /`` of binary32 operands that double rounding gives the correctly rounded
    binary32 result (binary64 carries 53 >= 2·24 + 2 bits), the value numpy's ``float32``
    arithmetic (:func:`_dynamic_int_params_np`, the test's oracle) gives at a tenth of the
    cost: this runs once per dynamic quantizer call.

    >>> dynamic_int_params(-1.0, 2.0, 0, 255, False)
    (0.0117647061124444, 85)
    """
    lo0, hi0 = min(lo, 0.0), max(hi, 0.0)
    if hi0 - lo0 >= _WIDE:
        return None
    try:
        if symmetric:
            if qmin < 0:
                amax = max(-lo0, hi0)
            else:
                amax = hi0 if hi0 > 0 else -lo0
            raw = _f32(amax / _f32(qmax))
        else:
            raw = _f32(_f32(hi0 - lo0) / _f32(qmax - qmin))  # (the code count as binary32, as numpy's)
        scale = max(raw, _TINY32)
        if symmetric:
            return scale, 0
        # IntOps: the zero point of the scale actually used, qmin - round(min(lo, 0) / s), clamped;
        # round(): half to even on the binary32 quotient, as np.round / torch.round
        zp = _f32(_f32(qmin) - round(_f32(lo0 / scale)))
    except OverflowError:  # round() of an infinite quotient (not reached below _WIDE): numpy's way
        return _dynamic_int_params_np(lo, hi, qmin, qmax, symmetric)
    return scale, int(min(max(zp, qmin), qmax))


_PACK32 = struct.Struct("f")


def _f32(v: float) -> float:
    """``v`` rounded to binary32 (to nearest, ties to even; beyond the largest binary32
    value an infinity, as numpy's float32 arithmetic gives), as a Python float."""
    return _PACK32.unpack(_PACK32.pack(v))[0]


def _dynamic_int_params_np(lo: float, hi: float, qmin: int, qmax: int, symmetric: bool) -> tuple[float, int] | None:
    """:func:`dynamic_int_params` in numpy ``float32`` scalars (each operation rounds once
    to binary32): the reference it is tested against, and its fallback."""
    lo0, hi0 = min(lo, 0.0), max(hi, 0.0)
    if hi0 - lo0 >= _WIDE:
        return None
    if symmetric:
        if qmin < 0:
            amax = max(-lo0, hi0)
        else:
            amax = hi0 if hi0 > 0 else -lo0
        raw = _F32(amax) / _F32(qmax)
    else:
        raw = (_F32(hi0) - _F32(lo0)) / _F32(qmax - qmin)
    scale = max(float(raw), _TINY32)
    if symmetric:
        return scale, 0
    r = np.round(_F32(lo0) / _F32(scale))
    zp = float(_F32(qmin) - r)
    return scale, int(min(max(zp, qmin), qmax))


def reciprocal(scale: float) -> float:
    """``functional.reciprocal`` of a binary32 value held in a Python float."""
    return float(_F32(1.0) / _F32(scale))


def views_fingerprint(s: Any, inv: Any, lo: Any, hi: Any) -> tuple | None:
    """What the fast path's result depends on besides the input, for views with one scale
    and Python clamp bounds (the values, so two quantizers calibrated alike match); None
    for per-channel views (never shared)."""
    if not (isinstance(lo, int) and isinstance(hi, int)):
        return None
    if isinstance(s, torch.Tensor):
        if s.numel() != 1 or not isinstance(inv, torch.Tensor) or inv.numel() != 1:
            return None
        s, inv = float(s), float(inv)
    if not (math.isfinite(s) and math.isfinite(inv)):
        return None
    return ("affine", s, inv, lo, hi)


class SharedInputs:
    """Recently fake-quantized input tensors, by the input tensor (identity and version
    counter) and the quantizer's :func:`views_fingerprint`.

    Bounded (``size`` input tensors, ``per_tensor`` fingerprints each, per thread): it only
    has to span the readers of one tensor, which run one after another; an entry also goes
    when its input tensor is freed.  Holding the result keeps at most that many
    activation-sized tensors alive."""

    def __init__(self, size: int = 2, per_tensor: int = 2) -> None:
        self.size = size
        self.per_tensor = per_tensor
        self._local = threading.local()

    def _entries(self) -> OrderedDict:
        e = getattr(self._local, "entries", None)
        if e is None:
            e = self._local.entries = OrderedDict()
        return e

    def get(self, x: torch.Tensor, fp: tuple) -> tuple[torch.Tensor, Any] | None:
        """``(result, aux)`` stored for ``x`` (unchanged) and ``fp``, if the result is unchanged."""
        e = self._entries().get(id(x))
        if e is None or e[0]() is not x or e[1] != x._version:
            return None
        hit = e[2].get(fp)
        if hit is None or hit[0]._version != hit[1]:
            return None
        return hit[0], hit[2]

    def put(self, x: torch.Tensor, fp: tuple, out: torch.Tensor, aux: Any = None) -> None:
        """Remember ``out`` (and ``aux``: the scale it used) as the result for ``x``, ``fp``."""
        entries = self._entries()
        k = id(x)
        e = entries.get(k)
        if e is None or e[0]() is not x or e[1] != x._version:
            def drop(ref, k=k, entries=entries):
                cur = entries.get(k)
                if cur is not None and cur[0] is ref:
                    entries.pop(k, None)
            e = entries[k] = [weakref.ref(x, drop), x._version, {}]
        outs = e[2]
        outs[fp] = (out, out._version, aux)
        while len(outs) > self.per_tensor:
            outs.pop(next(iter(outs)))
        entries.move_to_end(k)
        while len(entries) > self.size:
            entries.popitem(last=False)

    def clear(self) -> None:
        self._entries().clear()


SHARED = SharedInputs()
"""The input quantizers' shared results (a cache: it only ever returns values equal to a
recomputation)."""


# ----------------------------------------------------------------------------------------------
# The proxy's evaluation fast paths (moved here from qdsl.quantizers.proxy, which calls them).
#
# Per call they cost what the elementwise passes leave: a transformer encoder calls ~30
# activation quantizers per forward, so the per-call Python is kept to a few attribute reads.
# What does not change between calls is decided once per quantizer state (:func:`plan`, kept
# on the proxy until ``TensorQuantizer._refresh``); a dynamic quantizer's scale is kept as a
# Python float (the scalar path computes it so) and made a tensor only when read
# (``TensorQuantizer.current_scale``); plain attributes are written to the instance dict
# (``nn.Module.__setattr__`` looks the name up in three dicts first).

_BATCH_MINMAX = (MinMaxObserver, EmaObserver)
"""Observers whose range of one tensor (after the reset every dynamic batch gets) is its
finite min and max (:func:`dynamic_views`); exact types: a subclass may differ."""

FROZEN, STATIC, DYN_SCALAR, DYNAMIC = 1, 2, 3, 4
""":func:`plan` kinds: frozen affine views; a static activation's views of its cached range
before freeze; a dynamic per-tensor int scale in scalar arithmetic; a dynamic scale from a
tensor ``aminmax`` (per channel/token)."""


def plan(q) -> tuple[int, bool]:
    """``(kind, lean)`` for proxy ``q`` in its present state: the fast path :func:`eval_fast`
    takes (0: none; the per-call checks on ``x`` remain), and whether ``forward`` may go there
    directly (no token reshape, no learned binarisation threshold to initialise); the
    remaining per-call conditions (enabled, observing, dtype, autograd, offset, codes,
    check_finite, axis in range) ``TensorQuantizer.forward`` checks itself."""
    kind = 0
    affine = q._ops.fast_path and q._round_mode == "half_even"
    if q._fast_ok:
        kind = FROZEN
    elif not q.stateless and not q.derived and not q.learned and not q._frozen and q.observer is not None and affine:
        kind = STATIC
    elif (q.dynamic and q.axis is None and q.group_size is None and not q.derived
          and type(q.observer) in _BATCH_MINMAX and type(q.scale_rule) is FloatScale
          and type(q._ops) is IntOps and q._round_mode == "half_even"):
        kind = DYN_SCALAR
    elif q.dynamic:
        kind = DYNAMIC  # dynamic_views checks the rest per call
    lean = kind != 0 and not q.token and q.sign_threshold is None
    return kind, lean


def eval_fast(q, x: torch.Tensor, kind: int) -> torch.Tensor | None:
    """The fast paths without autograd (frozen, static before freeze, dynamic), or None (the
    general path).  An input quantizer whose result depends only on ``x`` and numbers it
    shares with another reader of the same ``x`` takes that reader's result (SharedInputs)."""
    if kind == FROZEN:
        return _shared_fast(q, x, frozen_views(q, x), False)
    if kind == STATIC:
        v = static_views(q, x)
        return None if v is None else _shared_fast(q, x, v, False)
    if kind == DYN_SCALAR and x.dtype is torch.float32 and x.is_cpu and x.numel():
        return _scalar_dynamic(q, x)
    if kind == DYN_SCALAR or kind == DYNAMIC:
        v = dynamic_views(q, x)
        return None if v is None else fast(q, x, v, finite=True)
    return None


def _shared_fast(q, x: torch.Tensor, v: tuple, finite: bool) -> torch.Tensor:
    fp = v[4] if q.role is Role.INPUT else None
    if fp is None:
        return fast(q, x, v, finite)
    hit = SHARED.get(x, fp)
    if hit is not None:
        return hit[0]
    out = fast(q, x, v, finite)
    SHARED.put(x, fp, out)
    return out


def _scalar_dynamic(q, x: torch.Tensor) -> torch.Tensor | None:
    """A dynamic per-tensor int quantizer (:data:`DYN_SCALAR`) on a float32 CPU tensor: the
    range in one native min/max pass, the scale in scalar arithmetic
    (:func:`dynamic_int_params`), the passes of :func:`fast`; None for a non-finite batch.
    Its result is a function of ``x`` and ``(qmin, qmax, symmetric)`` alone, which an input
    quantizer shares with the other readers of ``x``."""
    d = q.__dict__
    share = q.role is Role.INPUT
    if share:
        fp = ("dynamic_int", q.qmin, q.qmax, bool(q.recipe.symmetric))
        hit = SHARED.get(x, fp)
        if hit is not None:
            d["_last_scale"] = hit[1]
            return hit[0]
    lo, hi = NFQ.aminmax(x)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    params = dynamic_int_params(lo, hi, q.qmin, q.qmax, bool(q.recipe.symmetric))
    if params is None:
        return None
    scale, zp = params
    d["_last_scale"] = scale  # a Python float: current_scale() makes it a tensor when asked
    out = fast(q, x, (scale, reciprocal(scale), q.qmin - zp, q.qmax - zp, None), finite=True)
    if share:
        SHARED.put(x, fp, out, scale)
    return out


def frozen_views(q, x: torch.Tensor) -> tuple:
    """The frozen scale's :func:`views_for`, per rank (per shape for groups)."""
    key = x.dim() if q.group_size is None else tuple(x.shape)
    v = q._views.get(key)
    if v is None:
        v = q._views[key] = views_for(q, x, q.scale, q.zero_point)
    return v


def static_views(q, x: torch.Tensor):
    """Before freeze, a static activation's scale is fixed by its statistics, so evaluation
    (no autograd) takes the frozen fast path with the views of the cached range (rebuilt
    when ``TensorQuantizer._static_range`` recomputes it).  None: nothing observed yet.
    Only for :data:`STATIC` quantizers (:func:`plan`)."""
    r = q._static_range()
    if r is None:
        return None
    rng = q._range
    d = q.__dict__
    key = x.dim() if q.group_size is None else tuple(x.shape)
    sv = d.get("_sviews")
    if sv is None or sv[0] is not rng or sv[1] != key:
        scale, zp, _ = q._from_range(x, *r, q.scale_rule)
        sv = d["_sviews"] = (rng, key, views_for(q, x, scale, zp), scale)
    d["_last_scale"] = sv[3]
    return sv[2]


def dynamic_views(q, x: torch.Tensor):
    """A dynamic activation without autograd (evaluation, also after freeze): its batch's
    range in one ``aminmax`` pass and the views of the scale derived from it, for the fast
    path.  The same values as observing the batch and fake-quantizing it (a min/max observer
    reset for one tensor holds its finite min and max: when the batch is finite, exactly what
    ``aminmax`` returns), at 5 passes over the tensor instead of ~10; the observer is not fed
    (for a dynamic quantizer it only holds the last batch's range, which nothing reads before
    the next batch replaces it).  None: not such a quantizer, or a batch with a NaN/inf
    (aminmax propagates NaN, an infinity shows in the range) or a scale whose reciprocal
    overflows: the general path handles those."""
    obs = q.observer
    if (not q.dynamic or type(obs) not in _BATCH_MINMAX or q.learned or q.derived
            or q.group_size is not None or not q._ops.fast_path
            or q._round_mode != "half_even" or not x.numel()):
        return None
    rows, shape = obs._rows(x)
    if rows.shape[0] == 1:
        lo, hi = torch.aminmax(rows)  # a full reduction: aminmax(dim=1) of one row is ~10x slower
    else:
        lo, hi = rows.amin(dim=1), rows.amax(dim=1)
    if not bool((torch.isfinite(lo) & torch.isfinite(hi)).all()):
        return None
    scale, zp, _ = q._from_range(x, lo.reshape(shape), hi.reshape(shape), q.scale_rule)
    v = views_for(q, x, scale, zp)
    if not bool(torch.isfinite(v[1]).all()):
        return None
    q.__dict__["_last_scale"] = scale
    return v


def views_for(q, x, scale, zero_point):
    """``(s, inv, lo, hi, fingerprint)`` for :func:`fast` (fingerprint: see
    :func:`views_fingerprint`)."""
    s, inv, z = q._param_views(x, scale, zero_point)
    if zero_point.numel() == 1 or not bool((zero_point != zero_point.flatten()[0]).any()):
        zp = int(zero_point.flatten()[0]) if zero_point.numel() else 0
        lo, hi = q.qmin - zp, q.qmax - zp  # python numbers: the fastest clamp
        return s, inv, lo, hi, views_fingerprint(s, inv, lo, hi)
    return s, inv, q.qmin - z, q.qmax - z, None


def affine_passes(x, s, inv, lo, hi, finite: bool) -> torch.Tensor:
    """:func:`fast`'s torch passes (see its docstring)."""
    y = torch.mul(x, inv)
    y.round_()
    y.clamp_(lo, hi)
    if not finite and math.isnan(y.sum().item()):
        y.nan_to_num_(0.0)
    return y.mul_(s)


def fast(q, x: torch.Tensor, v: tuple | None = None, finite: bool = False) -> torch.Tensor:
    """Frozen int path: four passes over one fresh buffer, and a read-only sum when ``x``
    may hold a NaN (``finite`` False; ``finite``: the caller knows ``x`` and the reciprocal
    are finite, so ``x·(1/s)`` holds no NaN).

    ``(clamp(round(v) + z, qmin, qmax) − z)·s`` equals ``clamp(round(v), qmin − z, qmax −
    z)·s`` exactly (integers below 2^24 add exactly in float32), so the zero point moves into
    per-slot clamp bounds; only the sign of a zero may differ (−0.0 here where the reference
    gives +0.0), which compares equal.  A NaN becomes 0 (the zero point's code, as
    :func:`functional.scaled` does before rounding): round and clamp keep a NaN, so the
    clamped codes sum to NaN exactly when one is there (they are bounded, their sum is
    finite otherwise), and only then does a fifth pass replace it (``NaN·s`` is NaN; the
    code 0 times ``s`` is +0.0, what it becomes).  Where the native library applies, the same
    passes run as one (qdsl.quantizers.native_fq).
    """
    if v is None:
        v = frozen_views(q, x)
    out = NFQ.fake_quant(x, v)
    if out is not None:
        return out
    s, inv, lo, hi = v[:4]
    n = type(q).fast_path_threads
    prev = torch.get_num_threads() if n else 0
    if n and prev != n:
        torch.set_num_threads(n)
        try:
            return affine_passes(x, s, inv, lo, hi, finite)
        finally:
            torch.set_num_threads(prev)
    return affine_passes(x, s, inv, lo, hi, finite)

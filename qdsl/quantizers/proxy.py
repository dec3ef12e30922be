"""``TensorQuantizer``: one quantized tensor, composed from registry parts by a recipe.

Stable interface (export, lint and QAT read these; keep them)
-------------------------------------------------------------
``recipe``          the :class:`~qdsl.resolve.plan.QuantizerRecipe` it was built from
``role``            :class:`~qdsl.spec.model.Role` (weight, bias, input, output)
``kind``            ``recipe.kind`` (int, binary, ternary, pot, or a registered format's name)
``format``          the number format's facts (``recipe.format``, qdsl.spec.formats); its torch
                    ops (qdsl.quantizers.formats) do everything that differs between kinds
``qmin, qmax``      integer code range, the format's ``code_range(bits, signed, narrow)``:
                    int -> from bits/signed/narrow; binary -> (-1, 1) signed or (0, 1)
                    unsigned; ternary -> (-1, 1); pot -> (-n, n) with ``n = 2^(bits-1) - 1``
``axis``            channel axis (``channel`` granularity) or None
``group_size``      group size (``group`` granularity, groups along ``w.reshape(C, -1)``) or None
``scale``           buffer, float32, shape ``[]``/``[C]``/``[C, G]``; filled by :meth:`freeze`
                    (binary/ternary/pot: α or the largest magnitude)
``zero_point``      buffer, int32, same shape (0 unless asymmetric int)
``threshold``       buffer (ternary only): codes are ``sign(x)·[|x| > threshold]``
``sign_threshold``  parameter (``threshold = learned``, signed binary activations) or None:
                    codes are +1 where ``x >= t[c]`` and -1 below, ``c`` along axis 1
                    (qdsl.quantizers.formats.binary); empty until the first batch sets
                    it to the per-channel mean of that batch
``frozen``          True after :meth:`freeze`; the scale no longer changes
``dynamic``         activation scale computed per batch at run time (never frozen)
``derived``         a bias whose scale is ``input_scale × weight_scale`` (set by the patch
                    layer through :meth:`set_derived_scale`)
``int_repr(x)``     the exact integer codes ``forward`` used (narrowest int dtype)
``forward(x)``      fake quantization (float tensor, values ``dequant(int_repr(x))``)
``enabled``         False -> ``forward`` is the identity
``observing``       True -> ``forward`` feeds the observer and returns ``x`` unchanged
``observer``        the observer part (statistics in buffers), ``scale_rule`` the scale part

Lifecycle of one proxy
----------------------
* Weights, biases and dynamic activations are *stateless*: until frozen, every call
  resets the observer, observes the tensor and derives the scale from it, so the scale
  always tracks the current weight.
* Static activations: while ``observing`` the observer accumulates (calibration) and the
  value passes through in float; afterwards the scale comes from the statistics; before
  any data was seen ``forward`` is the identity (nothing to quantize with).
* :meth:`freeze` computes the scale once (for weights, from the weight passed in),
  stores it in the buffers and precomputes the broadcast views the fast path uses.

Dtypes: a float16/bfloat16 tensor is upcast to float32 (exactly) on entry and the
result cast back, so the codes equal those of a float32 tensor with the same values; the
state above stays float32 even through ``model.to(torch.bfloat16)`` (``_apply``).
``check_finite`` (``qdsl.apply(..., check_finite=True)``): an activation holding a NaN/inf
raises ``NonFiniteError``; otherwise non-finite values follow qdsl.quantizers.functional.

Gradients: values always come from :mod:`qdsl.quantizers.functional`.  When autograd
needs a gradient, the proxy calls its own ``self.grad_path(self, x, scale, zp,
threshold)`` if one is installed on it, otherwise it uses the plain straight-through
estimator (value ``x̂``, gradient of the identity).  The QAT path
(:func:`qdsl.quantizers.proxy_grad.qat_grad_path`) is installed per proxy, never
process-wide: on a proxy whose scale rule is learned when it is built, and on every
proxy of a model by ``qdsl.qat.prepare_qat``/``fit``/``LeanOptimizer``
(:func:`qdsl.quantizers.proxy_grad.install`).
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, ClassVar

import torch

from qdsl.quantizers import eval_fast as EF
from qdsl.quantizers import functional as F
from qdsl.quantizers import range_search as RS
from qdsl.quantizers import weight_op as WO
from qdsl.quantizers.functional import HALF_DTYPES, check_finite
from qdsl.quantizers.observers import LazyBuffers
from qdsl.quantizers.parts import (
    PartContext,
    build_format_ops,
    build_observer,
    build_rounding,
    build_scale_rule,
    channel_axis,
    default_registries,
)
from qdsl.resolve.plan import QuantizerRecipe
from qdsl.spec.diagnostics import Diagnostic, QdslError, SpecError
from qdsl.spec.model import DERIVED_BIAS_SCALE, GranularityKind, Role
from qdsl.spec.registry import Registries

__all__ = ["TensorQuantizer", "code_range"]

_VERSION = operator.attrgetter("_version")

_BUILTIN_ROUNDING = "qdsl.quantizers.rounding:"


class _StraightThrough(torch.autograd.Function):
    """Value ``compute()`` (x̂, computed here, without grad), gradient of the identity.

    x̂ is computed inside ``forward`` rather than passed in: autograd treats an input
    returned as is as a view, and an in-place op on the result (torchvision's
    ``ReLU(inplace=True)`` after a quantized output) then raised "Output 0 of
    _StraightThrough is a view and is being modified inplace".  A x̂ that aliases ``x``
    is copied for the same reason."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        fake = compute()
        if fake.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            fake = fake.clone()
        return fake

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


def code_range(recipe: QuantizerRecipe) -> tuple[int, int]:
    """``(qmin, qmax)`` of a recipe's integer codes (its number format's code range)."""
    return recipe.qmin, recipe.qmax


def _after_load(q: "TensorQuantizer", _incompatible) -> None:
    # load_state_dict post hook: the observer (a child) has loaded by now; take the range
    # eagerly so that a compiled forward finds it (see TensorQuantizer._static_range)
    if not q.stateless and not q._observing:
        q._static_range(refresh=True)


_affine_passes = EF.affine_passes  # (moved to qdsl.quantizers.eval_fast)


class TensorQuantizer(LazyBuffers):
    """See the module docstring for the interface."""

    _qdsl_internal = True
    grad_path: Callable[..., torch.Tensor] | None = None
    """This proxy's gradient path (see the module docstring); set per instance only."""
    _eplan: tuple[int, bool] | None = None
    """The evaluation fast path this state admits (qdsl.quantizers.eval_fast.plan); None:
    not decided yet (reset by :meth:`_refresh`)."""
    fast_path_threads: ClassVar[int | None] = 1
    """Intra-op threads for the frozen fast path's five elementwise passes (None: torch's
    setting).  They are memory-bound, so extra threads gain little, while every
    multi-threaded op is a barrier that waits for all threads: on an oversubscribed
    machine (measured: load 7 on 2 cores) one pass over 2M floats took 64 ms on 2
    threads and 1.9 ms on 1; on an idle one, 1.1 ms vs 1.6 ms."""

    def __init__(self, recipe: QuantizerRecipe, role: Role | str, registries: Registries | None = None, *, name: str = ""):
        super().__init__()
        if not recipe.format.quantized:
            raise ValueError("a float recipe has no quantizer")
        regs = registries if registries is not None else default_registries()
        self.recipe = recipe
        self.role = Role(role)
        self.name = name
        self.kind = recipe.kind
        self.format = recipe.format
        self._ops = build_format_ops(regs, recipe)
        self.axis, self.group_size = channel_axis(recipe, self.role)
        # token granularity: channel(0) of the tensor seen as (rows, last axis) (channel_axis);
        # forward reshapes to that view and back
        self.token = recipe.granularity.kind is GranularityKind.TOKEN
        self.qmin, self.qmax = code_range(recipe)
        self.derived = recipe.scale == DERIVED_BIAS_SCALE
        if self.derived:
            self.axis, self.group_size = 0, None  # input_scale × weight_scale is [] or [C]
        self.dynamic = bool(recipe.dynamic)
        self.stateless = self.role.is_param or self.dynamic
        # (weakref to the tensor last observed, its version counter): a stateless observer
        # skips re-observing the very same, unmodified tensor (a per-channel range search
        # costs far more than the layer; calibration and freeze both ask for the weight's
        # parameters).  A weakref, not data_ptr: freed memory reused by a new tensor must
        # never look like a hit; in-place updates (optimizer steps, copy_) bump _version.
        # Not pickled (see __getstate__): a copy re-observes once.
        self._observed: tuple[Any, int] | None = None
        self.enabled = True
        self._observing = False
        # Python mirrors of rarely changing state, so a compiled forward branches on
        # attributes dynamo guards on (a change recompiles) instead of reading a tensor:
        # ``_frozen`` mirrors the ``frozen_flag`` buffer (synced by :meth:`_refresh`);
        # ``_range`` is a static activation's ``(key, lo, hi, qparams)``, the observer's
        # range for the statistics named by ``key`` and the qparams derived from it
        # (None for a learned rule; see :meth:`_static_range`)
        self._frozen = False
        self._range: tuple | None = None
        self.check_finite = False
        """True: a NaN/inf reaching this (input/output) quantizer raises NonFiniteError
        (``qdsl.apply(..., check_finite=True)``) instead of following the policy."""
        self.generator: torch.Generator | None = None
        self.observer: Any = None
        self.scale_rule: Any = None
        if not self.derived:
            pot = bool(regs.scales.get(recipe.scale).extra.get("pot", False)) if recipe.scale in regs.scales else False
            ctx = PartContext(recipe, self.role, self.qmin, self.qmax, self.axis, self.group_size, pot)
            self.scale_rule = build_scale_rule(regs, ctx)
            self.observer = build_observer(regs, ctx)
            if self.learned or recipe.threshold == "learned":
                # a learned scale trains with LSQ's gradient from the start, a learned
                # threshold with its own (the plain STE would give it none)
                from qdsl.quantizers.proxy_grad import qat_grad_path

                self.grad_path = qat_grad_path
        rinfo = regs.roundings.get(recipe.rounding) if recipe.rounding in regs.roundings else None
        if rinfo is not None and isinstance(rinfo.factory, str) and rinfo.factory.startswith(_BUILTIN_ROUNDING):
            self._round_mode, self._round_fn = recipe.rounding, None
        else:
            self._round_mode, self._round_fn = None, build_rounding(regs, recipe.rounding)
        self.register_buffer("scale", torch.empty(0))
        self.register_buffer("zero_point", torch.empty(0, dtype=torch.int32))
        self.register_buffer("threshold", torch.empty(0))
        self.register_buffer("frozen_flag", torch.zeros((), dtype=torch.bool))
        # a learned per-channel binarisation threshold: sized by the first batch (the
        # same Parameter object, so an optimizer built before it still holds it)
        self.register_parameter("sign_threshold", torch.nn.Parameter(torch.empty(0))
                                if recipe.threshold == "learned" else None)
        # PTQ (qdsl.ptq), empty = unused: ``offset`` is added to the float tensor before
        # quantizing (bias correction); ``codes`` are fixed integer codes that replace
        # rounding (learned rounding, e.g. GPTQ).  Buffers, so state_dict carries them.
        self.register_buffer("offset", torch.empty(0))
        self.register_buffer("codes", torch.empty(0, dtype=torch.int64))
        self._derived_scale: torch.Tensor | None = None
        self._views: dict[Any, tuple] = {}
        self._fast_ok = False
        self._last_scale: torch.Tensor | None = None
        self.register_load_state_dict_post_hook(_after_load)

    # ------------------------------------------------------------------ state
    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def observing(self) -> bool:
        """True -> ``forward`` feeds the observer and returns ``x`` unchanged."""
        return self._observing

    @observing.setter
    def observing(self, value: bool) -> None:
        was, self._observing = self._observing, bool(value)
        if was and not self._observing:
            # calibration ended: take the range now, eagerly, so that a compiled forward
            # finds it (a histogram's percentile/search cannot be traced)
            self._static_range(refresh=True)

    @property
    def learned(self) -> bool:
        return bool(getattr(self.scale_rule, "learned", False))

    @property
    def calibrated(self) -> bool:
        """Has what it needs to quantize (a frozen scale, data seen, or no need for data)."""
        if self.frozen or self.stateless:
            return True
        if self.learned and bool(getattr(self.scale_rule, "initialized", False)):
            return True
        return self.observer is not None and self.observer.observed

    def current_scale(self) -> torch.Tensor | None:
        """The frozen scale, else the scale the last ``forward`` used (None: passed through)."""
        if self.frozen and not self.dynamic:
            return self.scale
        if (not self.stateless and not self.derived and not self.learned and not self._observing
                and self.observer is not None and not torch.compiler.is_compiling()):
            # a static activation's scale follows its statistics, not the last forward: a
            # refresh right after calibration (before any forward) derives the bias from it
            r = self._static_range()
            if r is None:
                return None
            sv = self.__dict__.get("_sviews")
            if sv is not None and sv[0] is self._range:
                return sv[3]
            return self._from_range(None, *r, self.scale_rule)[0]
        s = self._last_scale
        if isinstance(s, float):  # the dynamic scalar path keeps it as a number (eval_fast)
            s = self.__dict__["_last_scale"] = torch.tensor(s, dtype=torch.float32)
        return s

    def used_scale(self) -> torch.Tensor | float | None:
        """The scale the last ``forward`` quantized with, for a reader within the same module
        call (the accumulator hook, after the layer's pre-hook ran this input quantizer): the
        frozen scale (the frozen fast path does not record it), else the last forward's, a
        Python float from the dynamic scalar path (eval_fast) or a tensor; None: passed
        through.  The value :meth:`current_scale` gives right after a forward (a static
        activation's statistics do not change within a module call; observing, disabled and
        compiled calls are the caller's to exclude), without walking the statistics' key."""
        if self._frozen and not self.dynamic:
            return self.scale
        return self._last_scale

    def add_offset(self, delta: torch.Tensor) -> torch.Tensor:
        """Bias correction: add ``delta`` to the float tensor before it is quantized (on
        every later call); returns the total offset."""
        delta = delta.detach().to(torch.float32)
        self.offset = delta.clone() if self.offset.numel() == 0 else self.offset + delta
        return self.offset.clone()

    def clear_ptq_adjustments(self) -> bool:
        """Drop bias-correction offsets and fixed learned-rounding codes; True if any.

        Both are computed for the weights as calibration left them; once training moves
        the weights they are stale (and fixed codes would stop the gradient), so QAT
        (``qdsl.qat.prepare_qat``) clears them and learns the equivalent itself.
        """
        had = bool(self.offset.numel() or self.codes.numel())
        self.offset = torch.empty(0, device=self.offset.device)
        self.codes = torch.empty(0, dtype=torch.int64, device=self.codes.device)
        return had

    def set_codes(self, codes: torch.Tensor) -> None:
        """Learned rounding: from now on the tensor's integer codes are ``codes`` (same
        shape as the tensor; the scale and zero point still come from the tensor/observer)
        instead of rounding.  No gradient reaches the float tensor through fixed codes."""
        if not self.format.fixed_codes:
            raise QdslError(f"fixed codes need an int quantizer, not {self.format.name}")
        codes = codes.detach().to(torch.int64)
        if int(codes.min()) < self.qmin or int(codes.max()) > self.qmax:
            raise QdslError(f"codes outside [{self.qmin}, {self.qmax}] for {self.name or self.role.value}")
        self.codes = codes.clone()
        self._refresh()
        # the layer holding this weight recomputes ``module.weight`` now (LayerPatch.install
        # registers it), not at its next forward: a reader in between saw the old codes
        for fn in self.__dict__.get("codes_listeners", ()):
            fn()

    def _from_codes(self, x: torch.Tensor):
        p = self.qparams(x)
        if p is None:
            return x
        scale, zp = p[0].detach(), p[1]
        if tuple(self.codes.shape) != tuple(x.shape):
            raise QdslError(f"fixed codes of shape {tuple(self.codes.shape)} for a tensor of shape {tuple(x.shape)}")
        s = F.param_view(scale.to(torch.float32), x, self.axis, self.group_size)
        z = F.param_view(zp.to(torch.float32), x, self.axis, self.group_size)
        return (self.codes.to(torch.float32) - z) * s

    def set_derived_scale(self, scale: torch.Tensor | None) -> None:
        """For a derived (``input*weight``) bias: the scale to use on the next call."""
        self._derived_scale = scale

    def extra_repr(self) -> str:
        g = f"axis={self.axis}" if self.axis is not None else (f"group={self.group_size}" if self.group_size else "tensor")
        return (f"{self.role.value}: {self.format.label(self.recipe.bits)} [{self.qmin}, {self.qmax}] {g} "
                f"scale={self.recipe.scale} frozen={self.frozen}")

    # --------------------------------------------------------------- qparams
    def qparams(self, x: torch.Tensor | None = None, *, src: torch.Tensor | None = None):
        """``(scale, zero_point, threshold)`` the next ``forward(x)`` would use, or None if
        there is nothing to quantize with yet (static activation never observed).

        ``src``: the tensor ``x`` was upcast from (half-precision models), which keys the
        stateless observer's "same tensor, unchanged" cache."""
        if x is not None and x.dtype in HALF_DTYPES:
            x, src = x.float(), x if src is None else src
        if self.frozen and not self.dynamic:
            return self.scale, self.zero_point, (self.threshold if self.threshold.numel() else None)
        if self.derived:
            if self._derived_scale is None:
                return None
            s = self._derived_scale.to(torch.float32)
            return s, torch.zeros(s.shape, dtype=torch.int32, device=s.device), None
        rule = self.scale_rule
        if self.learned and bool(getattr(rule, "initialized", False)):
            scale = rule(None)
            zp = self.zero_point if self.zero_point.shape == scale.shape else torch.zeros(scale.shape, dtype=torch.int32)
            return scale, zp, self._ops.learned_threshold(scale)
        obs = self.observer
        if self.stateless and x is not None and torch.compiler.is_compiling():
            training = self.role.is_param and torch.is_grad_enabled() and x.requires_grad
            traced = obs.traced_range(x.detach(), training)
            if traced is not None:  # else: the eager observation below (a graph break)
                return self._from_range(x, *traced, rule)
        if self.stateless and x is not None:
            key = x if src is None else src
            last = self._observed
            # a searching weight observer carries its searched clip ratio through
            # training forwards instead of searching again (observers.MseObserver)
            training = self.role.is_param and torch.is_grad_enabled() and x.requires_grad
            if last is None or last[0]() is not key or last[1] != key._version or not obs.observed:
                obs.reset()
                obs.training_forward = training
                obs(x.detach())
                self._observed = (weakref.ref(key), key._version)
            elif training:
                obs.cached_training_forward()
        if not self.stateless:
            return self._static_qparams(x)
        if not obs.observed:
            return None
        return self._from_range(x, *obs.range(), rule)

    def _from_range(self, x, lo, hi, rule):
        scale, zp, thr = self._ops.qparams(self, x, lo.float(), hi.float(), rule)
        if self.learned:
            self.zero_point = zp.detach()
        return scale, zp, thr

    def _static_range(self, refresh: bool = False):
        """A static activation's observed ``(lo, hi)``, or None before any data.

        Computed once per state of the statistics: after calibration they no longer
        change, while a histogram's percentile or search costs as much as a small layer
        on every forward.  The key holds each observer buffer with its version counter:
        observing (buffers are reassigned), ``load_state_dict`` (in-place copies) and
        ``sync_observers`` (reassigned) all miss it.  A compiled forward cannot read
        version counters: it uses the range taken eagerly (at the end of calibration,
        after ``load_state_dict``, or by the last eager forward); a range changed in
        between by other means needs an eager forward (or ``_static_range(refresh=True)``)
        before the compiled one sees it.
        """
        obs = self.observer
        if obs is None:
            return None
        r = self._range
        if r is not None and not refresh and torch.compiler.is_compiling():
            return r[1], r[2]
        # key: (the buffers, their version counters), compared without a Python loop per buffer
        ts = [t for t in obs._buffers.values() if t is not None]
        key = (ts, list(map(_VERSION, ts)))
        if (r is not None and not refresh and len(r[0][0]) == len(ts)
                and all(map(operator.is_, r[0][0], ts)) and r[0][1] == key[1]):
            return r[1], r[2]
        if not obs.observed:
            self._range = None
            return None
        lo, hi = obs.range()
        # the qparams too, once per range (not for a learned rule, whose scale trains): a
        # compiled forward then reads them instead of tracing the scale arithmetic again
        params = None if self.learned else self._from_range(None, lo, hi, self.scale_rule)
        self._range = (key, lo, hi, params)
        return lo, hi

    def _static_qparams(self, x):
        """A static activation's ``(scale, zero_point, threshold)``: the ones
        :meth:`_static_range` derived with its range (a function of the range alone, as
        :meth:`current_scale` and eval_fast.static_views also assume), or for a learned rule
        from the range now; None before any data."""
        r = self._static_range()
        if r is None:
            return None
        params = self._range[3]
        return self._from_range(x, *r, self.scale_rule) if params is None else params

    # --------------------------------------------------------------- numerics
    def _param_views(self, x, s, zp):
        s = s.to(torch.float32)
        return (F.param_view(s, x, self.axis, self.group_size),
                F.param_view(F.reciprocal(s), x, self.axis, self.group_size),
                F.param_view(zp.to(x.dtype), x, self.axis, self.group_size))

    def _fake(self, x, scale, zp, thr):
        return self._ops.fake(self, x, scale, zp, thr)

    def _with_grad(self, x, scale, zp, thr):
        needs = torch.is_grad_enabled() and (x.requires_grad or (isinstance(scale, torch.Tensor) and scale.requires_grad)
                                             or (self.sign_threshold is not None and self.sign_threshold.requires_grad))
        if not needs:
            return self._fake(x, scale, zp, thr)
        if self.grad_path is not None:
            return self.grad_path(self, x, scale, zp, thr)
        if self.sign_threshold is not None:  # a learned threshold always trains with its own gradient
            return self._ops.qat_value(self, x, scale, zp, thr)
        # plain straight-through estimator: value of x̂ exactly, gradient of the identity
        # (not ``x + (x̂ - x).detach()``, whose float rounding changes the value)
        return _StraightThrough.apply(x, lambda: self._fake(x.detach(), scale.detach(), zp, thr))

    def int_repr(self, x: torch.Tensor) -> torch.Tensor:
        """The integer codes ``forward(x)`` uses (int8/uint8/int16/int32 by range)."""
        if x.dtype in HALF_DTYPES:
            x = x.float()
        if self.offset.numel():
            x = x + self.offset
        p = self.qparams(x)
        if p is None:
            raise QdslError(f"quantizer {self.name or self.role.value} has no scale yet: calibrate the model first")
        scale, zp, thr = (t.detach() if isinstance(t, torch.Tensor) else t for t in p)
        x = x.detach()
        if self.codes.numel():
            return self.codes.to(F.int_dtype(self.qmin, self.qmax))
        return self._ops.codes(self, x, scale, zp, thr)

    # ---------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        # (is_compiling first: a traced forward must not read or set ``_eplan``, or its guard on
        # it fails on the next call and the model compiles a second time)
        plan = None if torch.compiler.is_compiling() else (self._eplan or self._plan())
        if (plan is not None and plan[1] and not self._observing and x.dtype is torch.float32 and not self.check_finite
                and not (torch.is_grad_enabled() and x.requires_grad)):
            # evaluation: straight to the fast path when nothing below applies (the checks
            # that follow, in the order they would run; qdsl.quantizers.eval_fast.plan)
            b, ax = self._buffers, self.axis
            if not b["offset"].numel() and not b["codes"].numel() and (ax is None or -x.dim() <= ax < x.dim()):
                out = EF.eval_fast(self, x, plan[0])
                return out if out is not None else self._general(x, x)
        if self.token and x.dim() != 2:
            return self.forward(x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)).reshape(x.shape)
        if self.axis is not None and not -x.dim() <= self.axis < x.dim():
            self._bad_axis(x)
        if self.check_finite and not self.role.is_param:
            check_finite(x, self.name or self.role.value)
        if self.sign_threshold is not None and self.sign_threshold.numel() == 0:
            self._ops.init_threshold(self, x)
        if self.observing:
            if not self.stateless and self.observer is not None:
                self.observer(x.detach().float() if x.dtype in HALF_DTYPES else x.detach())
            return x
        if x.dtype in HALF_DTYPES:
            # half-precision models: the arithmetic runs in float32 (exact upcast; the same
            # codes as a float32 model holding the same values), the result goes back to the
            # model's dtype.  ``src`` keeps the stateless observer's cache keyed on the
            # caller's tensor, not on a fresh upcast copy.
            return self._forward(x.float(), x).to(x.dtype)
        return self._forward(x, x)

    def _forward(self, x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        if self.offset.numel():
            x = x + self.offset
        if self.codes.numel():
            if not (self.training and torch.is_grad_enabled() and x.requires_grad):
                return self._from_codes(x)
            # a training forward (QAT after a PTQ calibration that learned the rounding):
            # the fixed codes are stale once the weight moves and would stop its gradient,
            # so they go, as qdsl.qat.prepare_qat's clear_ptq_adjustments would drop them
            self.codes = torch.empty(0, dtype=torch.int64, device=self.codes.device)
        if not (torch.is_grad_enabled() and x.requires_grad) and not torch.compiler.is_compiling():
            # (thread switches and Python caches: not for a traced region)
            out = EF.eval_fast(self, x, (self._eplan or self._plan())[0])
            if out is not None:
                return out
        return self._general(x, src)

    def _general(self, x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and self.role.is_param:
            # a minifloat/MX weight's QAT forward as one opaque op (qdsl.quantizers.weight_op)
            out = WO.mx_plain(self, x)
            if out is not None:
                return out
        p = self.qparams(x, src=src)
        if p is None:
            self._last_scale = None
            return x
        self._last_scale = p[0]
        return self._with_grad(x, *p)

    def _plan(self) -> tuple[int, bool]:
        """qdsl.quantizers.eval_fast.plan, kept until :meth:`_refresh`."""
        p = self._eplan = EF.plan(self)
        return p

    def _bad_axis(self, x: torch.Tensor) -> None:
        # activation ranks are only known at run time (resolve checks weights and convs)
        g = self.recipe.granularity
        raise SpecError(Diagnostic.error(
            "E507", f"channel axis {self.axis} of {self.name or self.role.value} is out of range for "
            f"the {x.dim()}-d tensor it quantizes (shape {tuple(x.shape)})", g.span,
            f"a {x.dim()}-d tensor has axes {-x.dim()}..{x.dim() - 1}"))

    def _fast(self, x: torch.Tensor, v: tuple | None = None, finite: bool = False) -> torch.Tensor:
        """The frozen fast path's passes (qdsl.quantizers.eval_fast.fast)."""
        return EF.fast(self, x, v, finite)

    # ----------------------------------------------------------------- freeze
    def freeze(self, x: torch.Tensor | None = None) -> None:
        """Fix the scale: from ``x`` for weights/biases (required), from the statistics for
        static activations; a derived bias takes the last :meth:`set_derived_scale`.
        Dynamic quantizers stay dynamic (they are marked frozen but keep computing)."""
        if self.frozen:
            raise QdslError(f"quantizer {self.name or self.role.value} is already frozen")
        if self.dynamic:
            self.frozen_flag.fill_(True)
            self._frozen = True
            self._eplan = None
            return
        if self.role.is_param and not self.derived and x is None:
            raise ValueError("freezing a parameter quantizer needs the parameter")
        if x is not None and x.dtype in HALF_DTYPES:
            x = x.float()
        if x is not None and self.offset.numel():
            x = x + self.offset
        p = self.qparams(x)
        if p is None:
            raise QdslError(
                f"quantizer {self.name or self.role.value} never observed data: "
                "run qdsl.calibrate(model, batches) before qdsl.freeze(model)"
            )
        scale, zp, thr = p
        self.scale = scale.detach().to(torch.float32).clone()
        self.zero_point = zp.detach().to(torch.int32).clone()
        self.threshold = thr.detach().to(torch.float32).clone() if thr is not None else torch.empty(0)
        self.frozen_flag.fill_(True)
        self._refresh()

    def _refresh(self) -> None:
        self._frozen = bool(self.frozen_flag)
        self._views = {}
        # the fused path below is the affine one: only formats that say so use it
        self._fast_ok = (self.frozen and not self.dynamic and self._ops.fast_path
                         and self._round_mode == "half_even")
        self._eplan = None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        t = state_dict.get(prefix + "sign_threshold")
        if self.sign_threshold is not None and t is not None and self.sign_threshold.shape != t.shape \
                and self.sign_threshold.numel() == 0:
            self.sign_threshold.data = torch.zeros_like(t, dtype=torch.float32, device=self.sign_threshold.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._refresh()


    # ---------------------------------------------------------- pickle, copy
    def __getstate__(self) -> dict:
        """``pickle`` / ``torch.save(model)`` and ``copy.deepcopy`` both come through here.

        Caches are dropped, not copied: ``_observed`` holds a weakref (not picklable, and
        it names a tensor of *this* model), ``_views`` is rebuilt from the buffers on the
        next call.  ``_last_scale`` (a learned scale's output after a forward with grad
        is a non-leaf tensor, which ``deepcopy`` refuses) keeps its value, detached.
        """
        state = super().__getstate__()
        state["_observed"] = None
        state["_views"] = {}
        state["_range"] = None  # keyed on this model's buffers
        state.pop("_sviews", None)
        state.pop("_eplan", None)
        state.pop("_qdsl_state_dicts", None)  # this module's dicts (qdsl.patch.layer.proxy_state_key)
        for name in ("_last_scale", "_derived_scale"):
            t = state.get(name)
            if isinstance(t, torch.Tensor):
                state[name] = t.detach()
        return state

    def __setstate__(self, state: dict) -> None:
        # a model pickled before the compile-friendly state: plain attributes then
        state.setdefault("_observing", state.pop("observing", False))
        state.setdefault("_range", None)
        super().__setstate__(state)
        self._frozen = bool(self.frozen_flag)
        if not self.stateless and not self._observing:
            # the range cache is not copied (it names the original's buffers): take it again
            # now, eagerly, so that a compiled forward of the copy finds it
            self._static_range(refresh=True)

    def _apply(self, fn, recurse=True):
        # ``model.to(torch.bfloat16)`` / ``.half()`` / ``.double()`` reach every buffer: the
        # quantizer's state (scales, zero points, statistics, learned scales) keeps its
        # dtype so the integer grid stays the float32 one export and the runtime use;
        # device moves still apply.  The fast path's cached views are rebuilt.
        before = {n: t.dtype for n, t in self.named_parameters()}
        before.update((n, t.dtype) for n, t in self.named_buffers())
        super()._apply(fn, recurse)
        for mod_name, mod in self.named_modules():
            prefix = mod_name + "." if mod_name else ""
            for k, p in mod._parameters.items():
                want = before.get(prefix + k)
                if p is not None and want is not None and p.dtype != want:
                    p.data = p.data.to(want)
            for k, b in mod._buffers.items():
                want = before.get(prefix + k)
                if b is not None and want is not None and b.dtype != want:
                    mod._buffers[k] = b.to(want)
        self._refresh()
        return self

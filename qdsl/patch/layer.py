"""One patched module: its hooks, its moved parameters, its folded BatchNorm.

What a :class:`LayerPatch` does to ``module`` (and undoes in :meth:`LayerPatch.uninstall`):

* forward **pre-hook**: quantize the first positional input (input proxy), then recompute
  ``module.weight`` / ``module.bias`` (see :mod:`qdsl.patch.handle` for where the float
  masters live).  The order matters: the input proxy runs first, so an ``input*weight``
  bias reads the scale the input proxy *just* used (static: its scale; dynamic: this
  batch's) and the scale the weight proxy used, and quantizes the bias with
  ``scale = float32(input_scale × weight_scale)``, zero point 0, int32 range.
* forward **hooks**: the spec's accumulator (wrap/saturate at ``accumulator(bits=P)``, on
  the same integer sums as the graph; :mod:`qdsl.patch.accumulate`), then quantize the
  output (output proxy).
* load-state-dict **pre-hook**: a float checkpoint's ``conv.weight`` loads into the
  master ``conv.weight_float`` (load with ``strict=False``: it has no qdsl state).
* BatchNorm folding: the float weight the weight proxy sees is ``W·γ/σ`` (per output
  channel, ``σ = sqrt(running_var + eps)``) and the float bias ``(b − μ)·γ/σ + β``; the
  BN's hooks make it return its input without running (:class:`_SkipBN`), so its
  buffers never change while folded.

Exact XNOR sums: a frozen layer whose input and weight quantizers both have unit codes
(binary, ternary: values exactly ``±s`` or 0 in binary32) computes in binary64 and returns its
own dtype.  Its sum is an integer times ``s_x·s_w[c]`` (a product binary64 holds exactly), so
every partial sum is exact and a sum that is exactly 0 is 0, as the integer graph's
accumulator is; binary32 rounds the partial sums (``3·s`` has 26 significant bits), and a
reader's ``sign`` of ``±1e-9`` then flipped whole channels (MobileNetV3/EfficientNet-B0 under
xnor-binary: a 1×1 binary conv reading all-positive inputs has ``Σ sign(w) = 0`` in about
a quarter of its channels).  Only when frozen: training keeps binary32 (speed; the scales
still move).  Without autograd the sums run on the codes in binary32 instead: the exact
integer sum scaled once, ~4x cheaper, the binary64 conv's bits wherever its partial sums are
provably exact and within one binary32 unit of it elsewhere (``QDSL_FROZEN_SUMS=certified``
or ``binary64`` keeps the binary64 conv there: qdsl.patch.unit_sums).

Frozen fast path: when every proxy of the layer is frozen (and the input is not
dynamic) and autograd does not need the weights, the fake-quantized weight and bias are
computed once and reused until the master weight, the BN's tensors (their ``_version``)
or the handle's generation (bumped by freeze/load) change.  Before freeze the same cache
serves evaluation during QAT (no autograd through the weights): its key adds every buffer
and parameter of the weight, bias and input proxies (identity and version counter) and
their flags, so an optimizer step, an in-place edit of a master, a learned scale's
update, new statistics or ``load_state_dict`` recompute it.  (An edit through ``.data``
bumps no version counter: it goes unseen, as for any version-keyed cache.)  Compiled
regions never use it.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
from torch import nn

from qdsl.patch.accumulate import AccumulatorSim, needs_simulation
from qdsl.patch.constrain import check_constrained, constrain_weights
from qdsl.patch.lazy_weight import LazyQuantized
from qdsl.patch.softmax_roles import SoftmaxRoles
from qdsl.patch.unit_sums import UnitSums
from qdsl.quantizers.functional import HALF_DTYPES
from qdsl.resolve.plan import LayerPlan
from qdsl.spec.diagnostics import QdslError
from qdsl.spec.model import Role

__all__ = ["LayerPatch", "MASTER_SUFFIX", "proxy_state_key"]

MASTER_SUFFIX = "_float"


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.float() if t is not None and t.dtype in HALF_DTYPES else t


def proxy_state_key(proxies) -> tuple[list, list]:
    """``(key, refs)``: the state of ``proxies`` (None entries allowed) a cached
    fake-quantized tensor depends on before freeze, as :meth:`LayerPatch._quantizer_key`
    describes; ``refs`` are the tensors the key names by id, to keep alive with it.

    Walks the modules' own ``_buffers``/``_parameters`` dicts (the proxy and its parts,
    recursively) instead of ``buffers()``/``parameters()``: the same tensors in the same
    order (none is shared within a proxy), without the generator and de-duplication
    machinery, which cost more than the rest of an evaluation forward's hooks together on
    a small encoder (a key is taken per layer per forward).  Per proxy the key holds its
    flags, then the ids, version counters and dtypes of its tensors (``map`` over the
    list: no Python loop per tensor)."""
    key: list = []
    refs: list = []
    for q in proxies:
        if q is None:
            key.append(None)
            continue
        key += (q.enabled, q._observing, q._frozen, id(q._range),
                bool(getattr(q.__dict__.get("_modules", {}).get("observer"), "_search_requested", False)))
        refs.append(q._range)
        ts = [t for d in _state_dicts(q) for t in d.values() if t is not None]
        key.append(len(ts))
        key += map(id, ts)
        key += map(_VERSION, ts)
        key += map(_DTYPE, ts)
        refs += ts
    return key, refs


_VERSION = operator.attrgetter("_version")
_DTYPE = operator.attrgetter("dtype")


def _state_dicts(q: nn.Module) -> list:
    """The ``_buffers`` and ``_parameters`` dicts of ``q`` and its children, recursively, in
    :func:`_tensors`'s order (their values are the tensors it lists).  Kept on the proxy
    while its children are the same modules and have no children of their own (a proxy's
    observer and scale rule): checked per call by two identity comparisons, where walking
    the tree cost three calls and six list comprehensions per proxy.  Deeper trees are
    walked each time."""
    d = q.__dict__
    kids = tuple(d["_modules"].values())
    leaves = not any(k is not None and k._modules for k in kids)
    hit = d.get("_qdsl_state_dicts")
    if hit is not None and leaves and hit[0] == kids:
        return hit[1]
    dicts: list = []
    _dicts(q, dicts)
    if leaves:
        d["_qdsl_state_dicts"] = (kids, dicts)
    else:
        d.pop("_qdsl_state_dicts", None)
    return dicts


def _dicts(m: nn.Module, out: list) -> None:
    out += (m._buffers, m._parameters)
    for child in m._modules.values():
        if child is not None:
            _dicts(child, out)


def _tensors(m: nn.Module, out: list) -> None:
    """The buffers and parameters of ``m`` and its children, in ``_buffers``, ``_parameters``,
    children order."""
    out += [t for t in m._buffers.values() if t is not None]
    out += [t for t in m._parameters.values() if t is not None]
    for child in m._modules.values():
        if child is not None:
            _tensors(child, out)


class _SkipBN:
    """Make a folded BatchNorm return its input without computing it.

    A hook cannot skip ``forward``, so the pre-hook hands the BN an empty batch in eval
    mode (free; the module is switched to eval for the call if it was training, since an
    empty batch is an error in train mode and the running statistics must not move: the
    folded weights read them) and keeps the real input, which the forward hook returns.
    """

    def __init__(self) -> None:
        self.stash: list[tuple[torch.Tensor | None, bool]] = []

    def pre(self, module, args):
        if not args or not isinstance(args[0], torch.Tensor):
            self.stash.append((None, module.training))
            return None
        self.stash.append((args[0], module.training))
        module.training = False
        return (args[0][:0],) + tuple(args[1:])

    def post(self, module, args, output):
        x, training = self.stash.pop()
        module.training = training
        return output if x is None else x


class LayerPatch:
    """The patch of one module; see the module docstring."""

    _unit = False  # (class defaults: a patch pickled before these existed)
    sq = pq = None
    constraint_cost = None
    """What ``accumulator(constrain=true)`` changed at freeze (qdsl.patch.constrain)."""
    acc_sim: AccumulatorSim | None = None
    """The spec's narrow accumulator simulated on the layer's output (qdsl.patch.accumulate)."""
    _shadowed: tuple[str, ...] = ()
    """Parameters a binary64 view shadows during this forward (see ``_pre``)."""
    unit_sums: UnitSums | None = None
    """The frozen unit-code layer's sums on codes (qdsl.patch.unit_sums)."""

    def __init__(self, handle, plan: LayerPlan, module: nn.Module, proxies: dict[Role, Any],
                 bn: nn.Module | None = None, bn_fqn: str | None = None):
        self.handle = handle
        self.fqn = plan.fqn
        self.plan = plan
        self.module = module
        self.wq = proxies.get(Role.WEIGHT)
        self.bq = proxies.get(Role.BIAS)
        self.iq = proxies.get(Role.INPUT)
        self.oq = proxies.get(Role.OUTPUT)
        # the softmax its forward computes (qdsl.patch.softmax_roles): any module with children
        self.sq = proxies.get(Role.SCORES)
        self.pq = proxies.get(Role.PROBS)
        self.bn = bn
        self.bn_fqn = bn_fqn
        self._hooks: list[Any] = []
        self._param_order = list(module._parameters)
        self._moved: dict[str, bool] = {}  # name -> had a parameter (False: was None)
        self._cache_key: tuple | None = None
        self._unit = all(q is not None and q.format.unit_codes for q in (self.iq, self.wq))
        """Input and weight both have unit codes: the frozen layer computes in binary64."""
        if self._unit:
            self.unit_sums = UnitSums(self)

    def proxies(self) -> dict[Role, Any]:
        return {r: q for r, q in ((Role.INPUT, self.iq), (Role.WEIGHT, self.wq), (Role.BIAS, self.bq),
                                  (Role.OUTPUT, self.oq), (Role.SCORES, self.sq), (Role.PROBS, self.pq))
                if q is not None}

    def param_proxies(self) -> list[Any]:
        """The weight and bias proxies (None where absent)."""
        return [self.wq, self.bq]

    # --------------------------------------------------------------- install
    def install(self, materialize: bool = True) -> None:
        """Patch the module; ``materialize=False``: ``module.weight``/``bias`` are
        :class:`~qdsl.patch.lazy_weight.LazyQuantized` until first used or the first forward
        (no fake-quantized copy computed here)."""
        m = self.module
        for name, q in (("weight", self.wq), ("bias", self.bq)):
            folded = self.bn is not None
            if (q is not None or folded) and name in m._parameters:
                p = m._parameters.pop(name)
                self._moved[name] = p is not None
                if p is not None:
                    m._parameters[name + MASTER_SUFFIX] = p
        if self._moved:
            self._hooks.append(m.register_load_state_dict_pre_hook(self._load_float_names))
        if self._moved or self.iq is not None:
            self._hooks.append(m.register_forward_pre_hook(self._pre))
        if self._unit:  # before the output quantizer: it reads the layer's own dtype
            self._hooks.append(m.register_forward_hook(self._post_exact))
        if "weight" in self._moved and needs_simulation(self.plan.accumulator):
            # after the layer's sum, before its output quantizer (the graph's order)
            self.acc_sim = AccumulatorSim(self)
            self._hooks.append(m.register_forward_hook(self.acc_sim))
        if self.oq is not None:
            self._hooks.append(m.register_forward_hook(self._post))
        if self.sq is not None or self.pq is not None:
            self._hooks += SoftmaxRoles(self.fqn, self.sq, self.pq).install(m)
        if self._moved:
            if materialize:
                with torch.no_grad():
                    self.refresh()
            else:
                self._install_lazy()
            if self.wq is not None and "weight" in self._moved:
                # learned-rounding codes set on the weight proxy show in module.weight at once
                self.wq.__dict__.setdefault("codes_listeners", []).append(self.refresh_now)

    def _install_lazy(self) -> None:
        # what refresh() would store, described without computing it (see float_params):
        # the weight has its master's shape (a folded BN scales it per channel); a bias
        # exists if the model has one, a folded BN gives one, or a bias quantizer creates
        # one (bias correction on a bias-less layer), with the weight's rows; the dtype is
        # the master's (refresh() computes in binary64 only once frozen)
        w0, b0 = self.master("weight"), self.master("bias")
        d = self.module.__dict__
        if "weight" in self._moved:
            d["weight"] = None if w0 is None else LazyQuantized(self, "weight", w0.shape, w0)
        if "bias" in self._moved:
            if b0 is not None:
                d["bias"] = LazyQuantized(self, "bias", b0.shape, b0)
            elif w0 is not None and (self.bn is not None or self.bq is not None):
                d["bias"] = LazyQuantized(self, "bias", w0.shape[:1], w0)
            else:
                d["bias"] = None

    def install_bn_skip(self) -> None:
        """The folded BN's hooks; called after every layer is installed so the skip runs
        *after* any input quantizer of the BN itself and *before* any output quantizer."""
        if self.bn is not None:
            skip = _SkipBN()
            self._hooks.append(self.bn.register_forward_pre_hook(skip.pre))
            self._hooks.append(self.bn.register_forward_hook(skip.post, prepend=True))

    def uninstall(self) -> None:
        self._unshadow()
        listeners = self.wq.__dict__.get("codes_listeners") if self.wq is not None else None
        if listeners is not None:
            listeners[:] = [fn for fn in listeners if getattr(fn, "__self__", None) is not self]
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        m = self.module
        for name, had in self._moved.items():
            m.__dict__.pop(name, None)
            p = m._parameters.pop(name + MASTER_SUFFIX, None)
            m._parameters[name] = p if had else None
        # restore the parameters' order so state_dict() keys come out in the same order
        params = dict(m._parameters)
        m._parameters.clear()
        for k in self._param_order:
            if k in params:
                m._parameters[k] = params.pop(k)
        m._parameters.update(params)
        self._moved.clear()

    # ------------------------------------------------------------ parameters
    def master(self, name: str) -> torch.Tensor | None:
        """The float master parameter (``weight`` or ``bias``), wherever it lives now."""
        m = self.module
        if name in self._moved:
            return m._parameters.get(name + MASTER_SUFFIX)
        return m._parameters.get(name)

    def float_params(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The float weight and bias the weight/bias proxies see (BN folded in)."""
        w, b = self.master("weight"), self.master("bias")
        if b is None and w is not None and self.bq is not None and self.bn is None:
            # a bias created for bias correction (spec bias_correction on a bias-less layer)
            b = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
        bn = self.bn
        if bn is None or w is None:
            return w, b
        # a half-precision model folds in float32 (the proxies compute in float32 anyway):
        # the folded values are then those of a float32 model holding the same parameters
        w, b, mean, var, gamma, beta = (_f32(t) for t in (w, b, bn.running_mean, bn.running_var, bn.weight, bn.bias))
        inv_std = torch.rsqrt(var + bn.eps)
        k = inv_std * gamma if gamma is not None else inv_std
        w = w * k.reshape(-1, *([1] * (w.dim() - 1)))
        shifted = -mean if b is None else b - mean
        b = shifted * k
        if beta is not None:
            b = b + beta
        return w, b

    def _exact(self) -> bool:
        """Compute in binary64 now (see the module doc)."""
        if not self._unit:
            return False  # (before the import: this runs several times per layer call)
        from qdsl.patch.handle import State

        return self.handle.state in (State.FROZEN, State.EXPORTED)

    def _cacheable(self, w, b) -> tuple | None:
        from qdsl.patch.handle import State

        if torch.compiler.is_compiling():
            return None  # version counters cannot be traced; the compiler fuses the recomputation
        if self.iq is not None and self.iq.dynamic and self.bq is not None and self.bq.derived:
            return None  # the bias scale follows each batch's input scale
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in self._grad_sources(w, b)):
            return None
        key = [self.handle.generation, self._exact()]
        if self.handle.state not in (State.FROZEN, State.EXPORTED):
            key += self._quantizer_key()
        for t in self._grad_sources(w, b):
            # dtype: ``model.to(torch.bfloat16)`` swaps ``.data`` without bumping _version
            key += [id(t), t._version, t.dtype] if t is not None else [None, None, None]
        if self.bn is not None:
            for name in ("running_mean", "running_var"):
                t = getattr(self.bn, name)
                key += [id(t), t._version]
        return tuple(key)

    def _quantizer_key(self) -> list:
        """Before freeze, what else the fake-quantized weight and bias depend on: every
        buffer and parameter of the weight and bias proxies, and of the input proxy when the
        bias scale is derived from it (``input*weight``; otherwise ``refresh`` never reads
        it) (observer statistics,
        carried clip ratios, learned scales, offsets, codes; by identity and version
        counter) and their flags.  The tensors themselves are kept (``_cache_refs``) so that
        no id is reused by a new tensor while the entry lives."""
        # the input proxy only matters through a derived (input*weight) bias scale
        iq = self.iq if self.bq is not None and self.bq.derived else None
        key, self._key_refs = proxy_state_key((self.wq, self.bq, iq))
        return key

    def _grad_sources(self, w, b):
        out = [w, b]
        if self.bn is not None:
            out += [self.bn.weight, self.bn.bias]
        return out

    def refresh(self) -> None:
        """Recompute ``module.weight`` / ``module.bias`` from the masters (and the BN)."""
        from qdsl.patch.handle import State
        w0, b0 = self.master("weight"), self.master("bias")
        key = self._cacheable(w0, b0)
        if key is not None and key == self._cache_key:
            return
        w, b = self.float_params()
        if self.wq is not None and w is not None:
            w = self.wq(w)
        if self.bq is not None and b is not None:
            if self.bq.derived and not self.bq.frozen:
                s_in = self.iq.current_scale() if self.iq is not None else None
                s_w = self.wq.current_scale() if self.wq is not None else None
                self.bq.set_derived_scale(None if s_in is None or s_w is None else s_in.detach() * self._per_output(s_w).detach())
            b = self.bq(b)
        d = self.module.__dict__
        # the module computes in its own dtype (a folded half-precision layer came out of
        # float_params in float32), or in binary64 (exact XNOR sums, module doc)
        exact = torch.float64 if self._exact() else None
        if "weight" in self._moved:
            d["weight"] = w if w is None or w0 is None else w.to(exact or w0.dtype)
        if "bias" in self._moved:
            ref = b0 if b0 is not None else w0
            d["bias"] = b if b is None or ref is None else b.to(exact or ref.dtype)
        if key is not None and self.handle.state not in (State.FROZEN, State.EXPORTED):
            # before freeze the proxies may have re-observed just now: the key of the state
            # these weights were computed with is the one after the call
            key = self._cacheable(w0, b0)
        self._cache_key = key
        self._cache_refs = getattr(self, "_key_refs", None) if key is not None else None

    # ----------------------------------------------------------------- hooks
    def _load_float_names(self, module, state_dict, prefix, *args):
        """A float checkpoint (``conv.weight``) loads into the master (``conv.weight_float``)."""
        for name in self._moved:
            old, new = prefix + name, prefix + name + MASTER_SUFFIX
            if old in state_dict and new not in state_dict:
                state_dict[new] = state_dict.pop(old)

    def _pre(self, module, args):
        if self.iq is not None:
            if not args or not isinstance(args[0], torch.Tensor):
                raise QdslError(
                    f"'{self.fqn or '<model>'}' has an input quantizer but was called without a tensor "
                    "as its first positional argument"
                )
            args = (self.iq(args[0]),) + tuple(args[1:])
        if self._moved:
            self.refresh()
        self._unshadow()
        if self._exact():
            if self.unit_sums is not None:
                iq_s = self.iq.scale
                key = None if self._cache_key is None else (self._cache_key, id(iq_s), iq_s._version)
                fast = self.unit_sums.begin(module, args[0], key)
                if fast is not None:
                    return fast + tuple(args[1:])
            args = (args[0].to(torch.float64),) + tuple(args[1:])
            # a float parameter left in place (a bias with no quantizer and no folded BN):
            # a binary64 view shadows it for this forward (the instance dict comes before
            # nn.Module's parameter lookup); state_dict and autograd still see the parameter
            shadowed = []
            for name in ("weight", "bias"):
                p = module._parameters.get(name)
                if p is not None:
                    module.__dict__[name] = p.to(torch.float64)
                    shadowed.append(name)
            self._shadowed = tuple(shadowed)
        return args

    def _unshadow(self) -> None:
        if self.unit_sums is not None:
            self.unit_sums.restore()  # a forward that raised between the two hooks
        for name in self._shadowed:
            self.module.__dict__.pop(name, None)
        self._shadowed = ()

    def _post_exact(self, module, args, output):
        w = self.master("weight")
        dtype = w.dtype if w is not None else torch.float32
        fast = self.unit_sums.finish(output, dtype) if self.unit_sums is not None else None
        self._unshadow()
        if fast is not None:
            return fast
        if isinstance(output, torch.Tensor) and output.dtype is torch.float64 and self._exact():
            return output.to(dtype)
        return output

    def _post(self, module, args, output):
        if not isinstance(output, torch.Tensor):
            raise QdslError(
                f"'{self.fqn or '<model>'}' has an output quantizer but returned {type(output).__name__}, "
                "not a tensor"
            )
        return self.oq(output)

    # ---------------------------------------------------------------- freeze
    def freeze(self) -> None:
        """Freeze this layer's proxies: activations first, then weight, then bias (whose
        derived scale needs both)."""
        for q in (self.iq, self.oq, self.sq, self.pq):
            if q is not None and not q.frozen:
                q.freeze()
        with torch.no_grad():
            w, b = self.float_params()
            if self.wq is not None and not self.wq.frozen and w is not None:
                self.wq.freeze(w)
                if self.plan.accumulator.constrain:  # before the bias: its derived scale follows
                    self.constraint_cost = constrain_weights(self, w, b)
            if self.bq is not None and not self.bq.frozen and b is not None:
                if self.bq.derived:
                    if self.iq is not None and self.iq.dynamic:
                        return  # the bias scale follows the input's per-batch scale
                    self.bq.set_derived_scale(self.iq.scale * self._per_output(self.wq.scale))
                self.bq.freeze(b)
        self._cache_key = None
        if self.constraint_cost is not None:
            self.refresh_now()
            check_constrained(self)

    def _per_output(self, s_w: torch.Tensor) -> torch.Tensor:
        """The weight scale per output channel: a transposed conv's per-channel scales
        (weight axis 1, ``out/groups`` of them) repeat for each group (output channel
        ``g·og + o`` has scale ``s_w[o]``)."""
        if self.wq.axis == 1 and s_w.numel() > 1:
            return s_w.repeat(int(getattr(self.module, "groups", 1)))
        return s_w

    # ---------------------------------------------------------- pickle, copy
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_cache_key"] = None  # names this model's tensors by id(): meaningless in a copy
        state["_cache_refs"] = state["_key_refs"] = None
        state.pop("_frozen_record", None)  # keyed the same way (qdsl.patch.frozen)
        return state

    def __deepcopy__(self, memo: dict) -> "LayerPatch":
        # ``module.weight`` / ``module.bias`` are plain attributes holding the last
        # forward's fake-quantized value: after a forward with grad, a non-leaf tensor,
        # which ``Tensor.__deepcopy__`` refuses.  deepcopy reaches this patch first (the
        # module's hook dicts, holding our bound methods, precede those attributes in its
        # ``__dict__``; the container's handle is another way in), so hand it a detached
        # copy of each through its memo.  ``pickle`` needs nothing: it stores a non-leaf
        # tensor's value, and the next forward recomputes the attribute anyway.
        d = self.module.__dict__
        for name in self._moved:
            t = d.get(name)
            if isinstance(t, torch.Tensor) and not t.is_leaf and id(t) not in memo:
                memo[id(t)] = t.detach().clone()
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__getstate__(), memo))
        return new

    def refresh_now(self) -> None:
        """Recompute ``module.weight``/``bias`` outside a forward (after freeze, calibration)."""
        if self._moved:
            self._cache_key = None
            with torch.no_grad():
                self.refresh()

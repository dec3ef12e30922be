"""BatchNorm folding during QAT (Krishnamoorthi 2018, §3.2) for an applied model.

With ``fold_bn``, ``qdsl.apply`` folds each Conv/Linear -> BatchNorm pair for inference
(:mod:`qdsl.patch.layer`): the weight proxy sees ``W·f`` with ``f = γ/sqrt(σ²_run + ε)``
per output channel, the bias is ``β + (b − μ_run)·f`` and the BatchNorm returns its
input.  That is what the integer graph computes, but it cannot *train* the BN: batch
statistics are never used and running statistics would be updated from already
normalised activations.  :func:`prepare_qat` gives every folded layer a training mode:

* **live statistics** (``model.train()``, statistics not frozen): the layer uses the
  weight ``Q(W·f) / f`` and its own bias ``b``, and the unmodified BatchNorm runs
  normally.  A convolution/linear map is linear in each output channel's weight, so

      layer(x, Q(W·f)/f) = layer(x, Q(W·f)) / f            (per output channel)

  and BN normalises the pre-BN activation of the folded, quantized layer with batch
  statistics - the whitepaper's batch-statistics form with correction ``σ_run/σ_B`` -
  while updating its running statistics from the batch as usual.  The weight
  quantizer sees exactly the ``W·f`` it sees at inference.
* **frozen statistics** (:func:`freeze_bn_stats`, or automatically after
  ``freeze_bn_after`` training batches) and **eval**: the inference fold above, with
  gradients to ``W``, ``γ`` and ``β``; BN statistics stop changing.  A training forward
  then equals the inference forward.
* after ``qdsl.freeze`` the layer always uses the inference fold, so export reads the
  folded weights.
* under ``torch.compile`` the live form's ``Q(W·f)/f`` is one extern op
  (:mod:`qdsl.quantizers.weight_op`, where it covers the weight quantizer; same values and
  gradients), and the layer's ``weight``/``bias`` attributes are put back after its
  forward (:meth:`_QatFold.after`): inductor then compiles no kernel for the folded
  weights (measured in benchmarks/qat_compile.py).

:func:`prepare_qat` also keeps QAT steps cheap without changing what is computed at
inference: static activation observers reuse their range while their statistics are
unchanged; ``mse``/``auto`` weight observers carry their searched clip ratio on their
own (see :class:`qdsl.quantizers.observers.MseObserver`) and search again only on
request or every ``weight_search_every`` training forwards when that is set; histogram
and percentile weight observers re-run their search every ``weight_search_every``
(default 8) training forwards.

Guarantees: in eval mode nothing changes versus plain ``qdsl.apply``; ``qdsl.remove``
restores the model's state as before (the patch layer owns and removes every hook;
QAT state lives on the patch and proxy objects, which go away with it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from qdsl.quantizers import weight_op

__all__ = ["prepare_qat", "fold_factor", "freeze_bn_stats", "unfreeze_bn_stats", "qat_fold_active"]


# (the fold factor's inverse std: qdsl::bn_inv_std, in qdsl.quantizers.weight_op, which uses it
# too and may not import this module: qat is a higher layer than quantizers)
_inv_std = weight_op.bn_inv_std


def fold_factor(bn: nn.Module) -> Tensor:
    """``γ / sqrt(σ²_running + ε)`` per channel (γ = 1 without affine); differentiable in γ.

    Traceable (no graph break); under ``torch.compile`` the inverse std is saved for
    backward, never recomputed from ``running_var`` (see ``qdsl.quantizers.weight_op.bn_inv_std``).
    """
    if torch.compiler.is_compiling():
        inv_std = _inv_std(bn.running_var, float(bn.eps))
    else:  # the op's dispatch costs a few times the arithmetic; eager autograd saves the result
        inv_std = torch.rsqrt(bn.running_var + bn.eps)
    return inv_std if bn.weight is None else bn.weight * inv_std


def _frozen_state(patch) -> bool:
    from qdsl.patch.handle import State

    return patch.handle.state in (State.FROZEN, State.EXPORTED)


def qat_fold_active(patch) -> bool:
    """Does this folded layer use the live-statistics training form right now?"""
    bn = patch.bn
    if bn is None or not bn.training or _frozen_state(patch) or getattr(patch, "_qat_bn_frozen", False):
        return False
    after = getattr(patch, "_qat_freeze_after", None)
    if after is not None and int(bn.num_batches_tracked) >= after:
        patch._qat_bn_frozen = True
        return False
    return True


class _QatFold:
    """The QAT training form of one folded layer: the patch's ``refresh`` and its BN's
    hooks.  An object (held by the patch and the BN's hook dicts), not closures, so an
    applied model pickles and deep-copies, and a copy's hooks act on the copy's layer."""

    def __init__(self, patch) -> None:
        self.patch = patch
        self.stash: list = []

    def __getstate__(self) -> dict:
        # ``restore`` lives from a compiled forward's refresh to its end (tensors of it)
        return {k: v for k, v in self.__dict__.items() if k != "restore"}

    def refresh(self) -> None:
        # installed as the patch's ``refresh`` (instance attribute); the class's own
        # refresh (the inference fold) runs whenever the live form is not active
        from qdsl.patch.layer import LayerPatch

        patch = self.patch
        if not qat_fold_active(patch):
            return LayerPatch.refresh(patch)
        w, b = patch.master("weight"), patch.master("bias")
        wq = None
        if torch.compiler.is_compiling():
            # the layer's attributes as they are now, put back after its forward (:meth:`after`)
            d = patch.module.__dict__
            self.restore = {n: d.get(n) for n in ("weight", "bias") if n in patch._moved}
            # the fold, the weight's qparams and its fake quantization as one extern op
            # (qdsl.quantizers.weight_op; no generated kernel), where it covers the quantizer
            wq = weight_op.folded(patch.wq, w, patch.bn) if w is not None else None
        if wq is not None:
            return self._set(wq, b)
        f = fold_factor(patch.bn)
        # a zero γ would make 1/f blow up; such a channel's BN output is β whatever W is
        f = torch.where(f == 0, torch.full_like(f, torch.finfo(f.dtype).tiny), f)
        f = f.reshape(-1, *([1] * (w.dim() - 1)))
        wq = w if patch.wq is None else patch.wq(w * f) / f
        return self._set(wq, b)

    def _set(self, wq, b) -> None:
        patch = self.patch
        d = patch.module.__dict__
        if "weight" in patch._moved:
            d["weight"] = wq
        if "bias" in patch._moved:
            d["bias"] = b  # float during live-statistics training; the folded bias is quantized once frozen
        patch._cache_key = None

    def after(self, module, args, output):
        """The layer's forward hook: under compile, ``module.weight``/``bias`` go back to what
        they were before the forward.  A compiled graph then does not output the weights
        it computed (an attribute left changed is an output, with a gradient input in the
        backward: a layout copy and an add kernel per layer that inductor compiled).  So
        after a compiled live-statistics forward the attributes hold the last eager
        forward's weights; every forward recomputes them (``refresh``), and so do
        ``qdsl.freeze`` and export."""
        r = self.__dict__.pop("restore", None)
        if r is not None and torch.compiler.is_compiling():
            module.__dict__.update(r)
        return None

    def pre(self, module, args):
        if qat_fold_active(self.patch) or not args or not isinstance(args[0], torch.Tensor):
            self.stash.append(None)
            return None
        # Inference fold: the layer already applied the BN.  Run the BN in eval mode
        # (its statistics must not learn from normalised activations; model.train()
        # sets training again, so this is re-asserted every call) on an empty batch
        # (free), and hand the real input on in the forward hook.
        module.training = False
        self.stash.append(args[0])
        return (args[0][:0],) + tuple(args[1:])

    def post(self, module, args, output):
        x = self.stash.pop()
        return output if x is None else x


def _carries(q) -> bool:
    """Does the weight observer carry a searched clip ratio itself (MseObserver, exact)?"""
    return bool(getattr(q.observer, "_exact", False)) and hasattr(q.observer, "clip_ratio")


def _searching(q) -> bool:
    from qdsl.quantizers import observers as O

    # histogram, percentile (and any searching subclass that does not carry its result)
    return isinstance(q.observer, O.HistogramObserver) and not _carries(q)


class _ThrottledQparams:
    """``q.qparams`` after :func:`_throttle_search` (an object, not a closure: the model
    pickles, and a deep copy's proxy computes with its own state)."""

    def __init__(self, q) -> None:
        self.q = q
        self.n = 0
        self.value: tuple | None = None
        self.shape: tuple | None = None

    def __call__(self, x=None, **kw):  # kw: ``src`` (TensorQuantizer.qparams)
        q = self.q
        every = q._qat_search_every
        training = x is not None and torch.is_grad_enabled() and x.requires_grad
        if every <= 1 or not training or torch.compiler.is_compiling():
            return type(q).qparams(q, x, **kw)
        n = self.n
        self.n = n + 1
        if self.value is None or n % every == 0 or self.shape != tuple(x.shape):
            p = type(q).qparams(q, x, **kw)
            if p is None:
                return None
            self.value = tuple(t.detach() if isinstance(t, Tensor) else t for t in p)
            self.shape = tuple(x.shape)
        return self.value


def _throttle_search(q, every: int) -> None:
    """Let a stateless weight proxy with a *searching* observer reuse its last qparams
    for ``every - 1`` training forwards (grad enabled and the weight requires grad).

    Eval, no-grad calls (``qdsl.freeze``, inference) and compiled regions always compute
    fresh qparams, so frozen scales and exported weights are exactly PTQ's.
    """
    q._qat_search_every = int(every)
    if "qparams" not in q.__dict__:
        q.qparams = _ThrottledQparams(q)


def _prepare_patch(patch) -> None:
    if getattr(patch, "_qat_prepared", False):
        return
    bn = patch.bn
    # replace the patch's own BN hooks (the inference-only skip) with ours
    for h in list(patch._hooks):
        if h.id in bn._forward_hooks or h.id in bn._forward_pre_hooks:
            h.remove()
            patch._hooks.remove(h)
    fold = _QatFold(patch)
    # registered through the patch's own hook list, so qdsl.remove() removes them
    patch._hooks.append(bn.register_forward_pre_hook(fold.pre))
    patch._hooks.append(bn.register_forward_hook(fold.post))
    patch._hooks.append(patch.module.register_forward_hook(fold.after))
    patch.refresh = fold.refresh
    patch._qat_prepared = True


def _folded_patches(model: nn.Module):
    from qdsl.patch.handle import get_handle

    return [p for p in get_handle(model).layers.values() if p.bn is not None]


class _MemoRange:
    """``obs.range`` after :func:`_memoize_range` (an object, not a closure; see
    :class:`_ThrottledQparams`)."""

    def __init__(self, obs: nn.Module) -> None:
        self.obs = obs
        self.key: tuple | None = None
        self.value = None

    def __getstate__(self) -> dict:
        # the key names the observer's buffers by id(): meaningless in a copy
        return {**self.__dict__, "key": None, "value": None}

    def __call__(self):
        obs = self.obs
        if torch.compiler.is_compiling():
            return type(obs).range(obs)
        # the key holds the buffers themselves (compared by identity): an id alone can be
        # reused by a new buffer once the old one is freed (every observation reassigns
        # them), and a fresh buffer's version is 0 again - a stale range after recalibration
        key = tuple((t, t._version) for t in (getattr(obs, k) for k in obs._state))
        old = self.key
        if old is None or len(old) != len(key) or any(a is not b or va != vb for (a, va), (b, vb) in zip(old, key)):
            self.value = type(obs).range(obs)
            self.key = key
        return self.value


def _memoize_range(obs: nn.Module) -> None:
    """Make ``obs.range()`` reuse its last result while the statistics are unchanged.

    After calibration a static activation observer no longer changes, but the proxy asks
    for its range on every forward, and a histogram search (percentile, mse) costs as
    much as a small layer.  The key is each state buffer's identity and version counter:
    observing (buffers are reassigned), ``load_state_dict`` (in-place copies) and
    :func:`qdsl.qat.sync_observers` (reassigned) all invalidate it.
    """
    if "range" in obs.__dict__ or not getattr(obs, "_state", None):
        return
    obs.range = _MemoRange(obs)


_THROTTLE_DEFAULT = 8


def prepare_qat(model: nn.Module, *, freeze_bn_after: Optional[int] = None,
                weight_search_every: Optional[int] = None) -> int:
    """Give every BN-folded layer of an applied model its QAT training form (idempotent).

    ``freeze_bn_after``: freeze a BatchNorm's statistics once it has tracked that many
    training batches (its ``num_batches_tracked``).  ``weight_search_every``: how often a
    weight quantizer whose observer *searches* its range re-runs the search.  The ``mse``
    search (also ``auto`` below 8 bits) carries its result between searches as a clip
    ratio per channel applied to the current weight's min/max
    (:class:`qdsl.quantizers.observers.MseObserver`), so it searches again only on
    request (:func:`qdsl.qat.research_ranges`) unless this is set (N: every N training
    forwards; a spec's ``observer=mse(search_every=N)`` wins over it).  ``histogram`` /
    ``percentile`` weight observers reuse their last scale for ``N - 1`` training
    forwards (default 8; 1 = every forward, exactly the PTQ behaviour).  A search costs
    tens of times a layer's own gradient computation while the weights move little per
    step; min/max-type observers and learned scales are cheap and always follow the
    current weight.
    Static activation observers reuse their range while their statistics are unchanged
    (same result, computed once).  PTQ-only adjustments (bias-correction offsets, fixed
    GPTQ codes) are dropped: they were computed for the calibrated weights, training
    moves those weights, and fixed codes would block their gradient; QAT learns the
    equivalent (measured: W2A2 DigitsResNet QAT 43.9% with stale offsets, 97.3% without).
    Every proxy of this model (and no other) trains with the QAT gradient path
    (:func:`qdsl.quantizers.proxy_grad.install`).  Returns the number of folded layers.
    """
    from qdsl.patch.handle import get_handle
    from qdsl.quantizers.proxy_grad import install

    quantizers = get_handle(model).container.quantizers.values()
    install(quantizers)
    for q in quantizers:
        q.clear_ptq_adjustments()
        if q.observer is None or q.learned:
            continue
        if not q.stateless:
            _memoize_range(q.observer)
        elif q.role.is_param and not q.dynamic and _carries(q):
            if weight_search_every is not None and getattr(q.observer.params, "search_every", None) is None:
                q.observer.search_every = int(weight_search_every)  # the spec's own setting wins
        elif q.role.is_param and not q.dynamic and _searching(q):
            _throttle_search(q, _THROTTLE_DEFAULT if weight_search_every is None else weight_search_every)
    patches = _folded_patches(model)
    for patch in patches:
        patch._qat_freeze_after = freeze_bn_after
        _prepare_patch(patch)
    return len(patches)


def freeze_bn_stats(model: nn.Module) -> int:
    """Freeze the running statistics of every folded BatchNorm of an applied model.

    Training then uses the inference fold (running statistics), so the training forward
    equals the inference forward, as Krishnamoorthi recommends late in QAT.  Prepares
    the model (:func:`prepare_qat`) if needed.  Returns how many were newly frozen.
    """
    n = 0
    for patch in _folded_patches(model):
        _prepare_patch(patch)
        if not getattr(patch, "_qat_bn_frozen", False):
            patch._qat_bn_frozen = True  # on the patch, not the BN: nothing outlives qdsl.remove
            n += 1
    return n


def unfreeze_bn_stats(model: nn.Module) -> int:
    """Undo :func:`freeze_bn_stats` (BN follows ``model.train()``/``eval()`` again)."""
    n = 0
    for patch in _folded_patches(model):
        if getattr(patch, "_qat_bn_frozen", False):
            patch._qat_bn_frozen = False
            patch.bn.training = model.training
            n += 1
    return n

"""Memory-lean low-bit weights for QAT: packed codes on the module, fp32 masters in the optimizer.

This class keeps the normal QAT path's values and gradients exactly, so it saves no
process memory (fp32 masters, full fp32 gradients and moments, the dequantized fp32 leaf):
:class:`qdsl.qat.LeanAdam` (:mod:`qdsl.qat.lean_adam`) is the one that lowers peak RSS.

:class:`LeanOptimizer` takes an applied (and calibrated) model and, for every patched
layer with an ``int`` weight quantizer of at most 8 bits and no folded BatchNorm:

* moves the fp32 master weight (``module.weight_float``) off the module: it lives only
  in the wrapped optimizer's parameter list (and its state);
* keeps on the module the weight's integer codes, packed (``weight_lean_codes``: one
  byte per code when the code range spans at most 256 values, two codes per byte when
  it spans at most 16), plus the scale and zero point the codes were made with
  (non-persistent buffers, so ``model.to`` moves them and ``state_dict`` is unchanged);
* in every forward, dequantizes the codes (``(code − z)·s``, the very value the normal
  QAT path computes) into one fp32 leaf tensor that requires grad, shared by all
  forwards until the next ``step()`` (so gradient accumulation works) and dropped after;
* in :meth:`LeanOptimizer.step`, turns the leaf's gradient into the master's gradient by
  re-running the layer's weight quantizer on the master and back-propagating the leaf's
  gradient through it (so the master gets exactly the gradient of the normal QAT path:
  the clipping-mask STE, any learned-scale gradient), steps the optimizer, and
  re-quantizes the codes from the updated masters with the same quantizer.

Skipped layers (listed in :attr:`LeanOptimizer.skipped` with the reason) train as usual.
Values and gradients equal those of the normal QAT path, so the same seed and data give
the same loss trajectory and parameters (tests/qat/test_lean.py: 4-bit per-channel,
8-bit symmetric, asymmetric and learned-scale weights, with gradient accumulation).

Memory, measured by ``benchmarks/qat_memory.py`` (bytes of the weight tensors held after
a training step, ``weight_bytes``; per-channel symmetric weights, no BN folding; the
normal path holds the fp32 master plus the fp32 fake-quantized ``module.weight`` of the
last forward, 8 bytes per weight; Adam moments, equal in both, left out):

==================  ====  =======  ========  ===========  =============
model               bits  weights  normal    lean module  lean + master
==================  ====  =======  ========  ===========  =============
ConvBnReluNet       4     56800    454400    29096 15.6x  256296 1.77x
ConvBnReluNet       8     56800    454400    57496 7.9x   284696 1.60x
DigitsResNet        4     42448    339584    22268 15.2x  192060 1.77x
DigitsResNet        8     42448    339584    43492 7.8x   213284 1.59x
==================  ====  =======  ========  ===========  =============

i.e. module-resident weight memory shrinks ~16x (4-bit) / ~8x (8-bit) (the fp32
per-channel scales are the rest), and the total including the optimizer's fp32 masters
by ~1.77x / ~1.6x (8 B per weight -> 4.5 B / 5 B).  Each step runs the weight quantizer
once more than the normal path (to back-propagate to the master); the observer sees each
new master once per step either way (the proxy skips re-observing the unchanged master),
and a searched range (``mse``/``auto``) is carried, not searched again: the optimizer
starts the observers carrying (``MseObserver.start_carrying``) because ``requantize``
observes without grad.
During a forward/backward the dequantized fp32 leaf exists as the fake-quantized weight
does in the normal path; its fp32 gradient lives from ``backward()`` until ``step()``
moves it to the master (one layer at a time).  Gradients are fp32: a bf16 dequantized
weight would not carry the exact fake-quantized values.

``model.state_dict()`` in lean form holds the masters under their usual keys
(``layer.weight_float``), and loading a state dict fills the masters (codes follow at the
next forward).  Before ``qdsl.freeze``, ``qdsl.remove`` or export, call :meth:`LeanOptimizer.finish`:
it puts the masters back (the same ``nn.Parameter`` objects, so the wrapped optimizer
keeps working) and the model is in normal form again; ``qdsl.freeze`` and
``qdsl.remove`` on a model still in lean form raise a :class:`QdslError` saying so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qdsl.patch.handle import get_handle
from qdsl.patch.layer import MASTER_SUFFIX
from qdsl.patch.attention import AttentionPatch
from qdsl.patch.recurrent import RecurrentPatch
from qdsl.quantizers import functional as F
from qdsl.quantizers.proxy_grad import install as install_grad_path
from qdsl.spec.diagnostics import QdslError

__all__ = ["LeanOptimizer", "LEAN_ATTR", "pack_codes", "unpack_codes", "weight_bytes"]

LEAN_ATTR = "_qdsl_lean"
"""Set on a module while its weight is in lean form (qdsl.freeze/remove check it)."""

_CODES, _SCALE, _ZP = "weight_lean_codes", "weight_lean_scale", "weight_lean_zero_point"


def pack_codes(codes: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Codes in ``[qmin, qmax]`` as a flat uint8 tensor: ``code − qmin`` per byte, or two
    per byte (low nibble first) when ``qmax − qmin < 16``."""
    span = qmax - qmin
    if span > 255:
        raise QdslError(f"lean weights hold at most 8-bit codes, not the range [{qmin}, {qmax}]")
    u = (codes.reshape(-1).to(torch.int16) - qmin).to(torch.uint8)
    if span > 15:
        return u
    if u.numel() % 2:
        u = torch.cat([u, u.new_zeros(1)])
    return u[0::2] | (u[1::2] << 4)


def unpack_codes(packed: torch.Tensor, numel: int, qmin: int, qmax: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``numel`` codes as a flat int16 tensor."""
    if qmax - qmin > 15:
        u = packed
    else:
        u = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:numel]
    return u.to(torch.int16) + qmin


def _unsupported(patch) -> str | None:
    q = patch.wq
    if isinstance(patch, RecurrentPatch):
        return "a recurrent layer (lean form is for one Linear/Conv weight; its float weights stay on the module)"
    if isinstance(patch, AttentionPatch):
        return "an attention layer's in_proj (lean form is for one Linear/Conv weight; its float weight stays on the module)"
    if q is None or "weight" not in patch._moved or patch.master("weight") is None:
        return "no quantized weight"
    if patch.bn is not None:
        return "BatchNorm folded into the weight (its float weight is not the master)"
    if not q.format.fixed_codes:
        return f"{q.format.name} weights (lean form holds int codes)"
    if q.qmax - q.qmin > 255:
        return f"{q.recipe.bits}-bit weights (lean form holds at most 8 bits)"
    return None


class _LeanLayer:
    """One layer in lean form (see the module docstring)."""

    def __init__(self, patch) -> None:
        self.patch = patch
        m = self.module = patch.module
        self.order = list(m._parameters)  # finish() restores it (state_dict key order)
        self.master: nn.Parameter = m._parameters.pop("weight" + MASTER_SUFFIX)
        self.shape = tuple(self.master.shape)
        self.leaf: torch.Tensor | None = None
        q = patch.wq
        for name in (_CODES, _SCALE, _ZP):
            m.register_buffer(name, torch.empty(0), persistent=False)
        setattr(m, LEAN_ATTR, True)
        # registered after the patch's own pre-hook, so it runs after it: the patch
        # quantizes the input and the bias (reading the weight scale the last
        # requantize left in the proxy), then this sets the weight
        self.hooks = [
            m.register_forward_pre_hook(self._pre),
            # before the patch's hook: a derived bias scale reads the weight scale requantize sets
            m.register_forward_pre_hook(self._requantize_if_stale, prepend=True),
            m.register_forward_hook(self._post),
            # state_dict() stays complete (the master under its usual key) and loading one
            # fills the master; the codes follow at the next forward (after the proxies,
            # later in the model, have loaded their scales)
            # (a plain function: torch marks public state-dict hooks with an attribute)
            m.register_state_dict_post_hook(lambda *a: self._save_master(*a)),
            m.register_load_state_dict_pre_hook(self._load_master),
        ]
        self.stale = False
        self.qmin, self.qmax = q.qmin, q.qmax
        if hasattr(q.observer, "start_carrying"):
            # requantize() observes the master without grad, but it is training: a searched
            # range is carried as in the normal QAT path (qdsl.quantizers.observers.MseObserver)
            q.observer.start_carrying()
        self.requantize()

    def requantize(self) -> None:
        q, w = self.patch.wq, self.master
        with torch.no_grad():
            q(w)  # records the scale this weight uses (a derived bias scale reads it)
            scale, zp, _ = q.qparams(w + q.offset if q.offset.numel() else w)
            codes = q.int_repr(w)
        m = self.module
        setattr(m, _CODES, pack_codes(codes, self.qmin, self.qmax))
        setattr(m, _SCALE, scale.detach().to(torch.float32).clone())
        zp = zp.detach().to(torch.int32)
        # symmetric weights: one scalar zero instead of a per-channel vector of zeros
        setattr(m, _ZP, zp.new_zeros(()) if not bool(zp.any()) else zp.clone())
        self.leaf = None
        m.__dict__["weight"] = None

    def dequantize(self) -> torch.Tensor:
        m, q = self.module, self.patch.wq
        numel = 1
        for d in self.shape:
            numel *= d
        codes = unpack_codes(getattr(m, _CODES), numel, self.qmin, self.qmax).to(torch.float32).reshape(self.shape)
        s = F.param_view(getattr(m, _SCALE), codes, q.axis, q.group_size)
        z = F.param_view(getattr(m, _ZP).to(torch.float32), codes, q.axis, q.group_size)
        w = (codes - z) * s  # the order of F.fake_quant_affine: the same float value
        return w.to(self.master.dtype)  # a half-precision model computes in its own dtype

    def _save_master(self, module, state_dict, prefix, local_metadata):
        state_dict[prefix + "weight" + MASTER_SUFFIX] = self.master.detach()

    def _load_master(self, module, state_dict, prefix, *args):
        key = prefix + "weight" + MASTER_SUFFIX
        if key in state_dict:
            with torch.no_grad():
                self.master.copy_(state_dict.pop(key))
            self.stale = True

    def _post(self, module, args, output):
        if not torch.is_grad_enabled():
            module.__dict__["weight"] = None  # no fp32 copy kept after an inference forward
        return None

    def _requantize_if_stale(self, module, args):
        if self.stale:
            self.stale = False
            self.requantize()
        return None

    def _pre(self, module, args):
        if not torch.is_grad_enabled():
            module.__dict__["weight"] = self.dequantize()
            return None
        if self.leaf is None:
            # one leaf until the next step: gradients of several forwards accumulate in it
            self.leaf = self.dequantize().requires_grad_(True)
        module.__dict__["weight"] = self.leaf
        return None

    def backprop(self) -> None:
        """Move the leaf's gradient to the master through the weight quantizer's STE."""
        if self.leaf is None or self.leaf.grad is None:
            return
        with torch.enable_grad():
            torch.autograd.backward(self.patch.wq(self.master), self.leaf.grad)
        # free the leaf and its gradient now, not after the step: the extra fp32 copies
        # exist for one layer at a time
        self.leaf = None
        self.module.__dict__["weight"] = None

    def finish(self) -> None:
        m = self.module
        for h in self.hooks:
            h.remove()
        for name in (_CODES, _SCALE, _ZP):
            m._buffers.pop(name, None)
        m.__dict__.pop(LEAN_ATTR, None)
        params = dict(m._parameters, **{"weight" + MASTER_SUFFIX: self.master})
        m._parameters.clear()
        m._parameters.update({k: params.pop(k) for k in self.order if k in params})
        m._parameters.update(params)
        self.leaf = None
        self.patch.refresh_now()


class LeanOptimizer:
    """``LeanOptimizer(model, torch.optim.Adam, lr=1e-3)``: QAT with packed low-bit weights.

    ``optimizer`` is the wrapped ``optimizer_cls`` instance over every trainable
    parameter of the model plus the lean layers' fp32 masters (give it to an LR
    scheduler).  Use ``zero_grad()`` / ``step()`` on this object, then ``finish()``.
    """

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        handle = get_handle(model)
        self.model = model
        install_grad_path(handle.container.quantizers.values())  # QAT gradients for this model only
        self.skipped: dict[str, str] = {}
        self.layers: dict[str, _LeanLayer] = {}
        for fqn, patch in handle.layers.items():
            if getattr(patch.module, LEAN_ATTR, False):
                raise QdslError(f"layer '{fqn}' is already in lean form: call finish() on its LeanOptimizer first")
            reason = _unsupported(patch)
            if reason is None:
                self.layers[fqn] = _LeanLayer(patch)
            else:
                self.skipped[fqn] = reason
        if not self.layers:
            self.finished = True
            raise QdslError(
                "no layer can keep lean weights (needs an int weight quantizer of at most 8 bits "
                "and no folded BatchNorm): " + "; ".join(f"{k}: {v}" for k, v in self.skipped.items())
            )
        params = [p for p in model.parameters() if p.requires_grad]
        params += [lay.master for lay in self.layers.values()]
        self.optimizer = optimizer_cls(params, **kwargs)
        self.finished = False

    def _check(self) -> None:
        if self.finished:
            raise QdslError("this LeanOptimizer is finished: use its .optimizer on the model in normal form")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._check()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for lay in self.layers.values():
            if lay.leaf is not None:
                lay.leaf.grad = None

    def step(self) -> None:
        """Masters' gradients from the leaves, an optimizer step, codes re-quantized."""
        self._check()
        for lay in self.layers.values():
            lay.backprop()
        self.optimizer.step()
        for lay in self.layers.values():
            lay.requantize()

    def finish(self) -> nn.Module:
        """Put the fp32 masters back on their modules (normal form); returns the model."""
        self._check()
        for lay in self.layers.values():
            lay.finish()
        self.finished = True
        return self.model


def weight_bytes(model: nn.Module, optimizer: LeanOptimizer | None = None) -> tuple[int, int]:
    """``(module_bytes, master_bytes)``: bytes of the weight tensors the patched layers'
    modules hold (float master, cached fake-quantized weight, or packed codes and their
    scale/zero point), and of the fp32 masters held only by ``optimizer``."""
    handle = get_handle(model)
    seen: set[int] = set()
    total = 0
    for patch in handle.layers.values():
        m = patch.module
        tensors = [m._parameters.get("weight" + MASTER_SUFFIX), m.__dict__.get("weight")]
        tensors += [m._buffers.get(n) for n in (_CODES, _SCALE, _ZP)]
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    masters = 0 if optimizer is None else sum(
        lay.master.numel() * lay.master.element_size() for lay in optimizer.layers.values())
    return total, masters

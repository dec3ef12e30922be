"""``LeanAdam``: QAT of low-bit ``int`` Linear weights that lowers peak process memory.

``opt = qdsl.qat.LeanAdam(model, lr=1e-3)`` takes a model patched with ``qdsl.apply`` (and
optionally calibrated; calibrating after this call also works and never materializes the
fake-quantized weights) and puts every quantized ``nn.Linear`` weight in lean form:

* **packed codes are the weights**: each layer holds its integer codes (two 4-bit codes per
  byte, :func:`qdsl.qat.lean_state.pack_rows`) and the scale/zero point they were made with.
  ``module.weight`` no longer holds an fp32 fake-quantized copy and the float master leaves
  the module (``master=`` below says what replaces it);
* **no fp32 weight, ever, for a whole layer**: the forward walks the weight a row block at a
  time (``chunk`` values, 1M by default), dequantizes the block (``(code − z)·s``, the value the
  normal QAT path computes) and multiplies; autograd saves only the layer's input; the
  backward dequantizes each block again (recomputation, no saved weight) for the input's
  gradient, forms that block's weight gradient and **updates the block at once** (Adam).
  No layer's full weight gradient exists, and no full set of gradients ever does: the other
  trainable parameters (biases, learned activation scales, skipped layers) are updated as
  soon as their gradient is accumulated (``Tensor.register_post_accumulate_grad_hook``);
* ``grad_dtype=torch.bfloat16`` (default): the weight gradient is rounded to bfloat16 as it
  is produced (the block product is computed in float32 on CPU, where bf16 GEMMs are slow);
* ``state_bits=8`` (default) keeps both Adam moments of the lean weights block-wise
  quantized (:class:`qdsl.qat.lean_state.BlockQuantized`, 1.02 B per value), 32 keeps float32;
* ``master=``: ``"fp32"`` (a float32 master per weight: the update of ``torch.optim.Adam``),
  ``"bf16"`` (default; bfloat16 master updated with stochastic rounding) or ``"none"`` (no
  master: the update is added to the dequantized codes and rounded stochastically back to
  codes, so small updates survive in expectation);
* ``scale=``: ``"track"`` recomputes a per-channel scale from the updated master after every
  step, as the normal QAT path's stateless weight quantizer does (minmax observer, channel
  axis 0); ``"fixed"`` keeps the scale the weight quantizer gave the initial weight (and
  applies the clipping-mask gradient of the normal path); ``"auto"`` (default) tracks when it
  can (a master and a per-channel minmax weight quantizer) and fixes otherwise.

Bytes per weight held by a lean layer: 0.5 (codes) + 2 (bf16 master; 4 fp32, 0 none) + 2.03
(8-bit moments; 8 fp32), vs 16 for fp32 Adam (weight, gradient, two moments).

Activations are those of normal QAT: a lean layer saves only its (quantized) input, as
``nn.Linear`` does.  Activation checkpointing is not supported: its recomputed forward
counts as a second use of the layer (below).

Loop: one forward with grad and one ``backward()`` per step, then ``opt.step()`` (it closes
the step: the update already happened during backward).  Evaluate under ``torch.no_grad()``.
A second training forward of a lean layer before ``step()`` (a layer shared twice in one
forward, or gradient accumulation) is a :class:`QdslError`: its update happens in backward.

Unsupported layers are listed in one :class:`~qdsl.spec.diagnostics.SpecError`, each located
at the spec line that quantized its weight: a weight that is not ``int`` of at most 8 bits,
a learned or group-wise weight scale, a layer that is not an ``nn.Linear``, BatchNorm folded
into the weight, a simulated narrow accumulator, weights shared by two layers, a non-float32
weight.  ``skip_unsupported=True`` trains those normally instead (``opt.skipped`` says why).

Apply with ``qdsl.apply(model, spec, materialize=False)``: a plain ``apply`` computes every
layer's fake-quantized fp32 weight at once (as large as the weights), which this class then
drops; with ``materialize=False`` that copy is never made (``module.weight`` computes on first
use, :mod:`qdsl.patch.lazy_weight`), and setup no longer sets the process's peak.

Measured (``benchmarks/qat_lean_rss.py``, one subprocess per variant, peak RSS of the whole
process; 50.4M-parameter MLP 4096x4, 4-bit per-channel weights, batch 64, 20 steps; busy
shared machine, so the step times are only indicative):

==============  =======  ========  ========  =====  =====================================
variant         peak MB  setup MB  train MB  ratio  note
==============  =======  ========  ========  =====  =====================================
baseline            232                             python + torch + qdsl imported
fp32 Adam          1244       514      1244   1.00  float model, torch.optim.Adam
LeanAdam            586       536       586   0.47  bf16 grads/master, 8-bit moments,
                                                    ``apply(..., materialize=False)``
==============  =======  ========  ========  =====  =====================================

``ratio`` is the whole process's peak over fp32 Adam's (the training steps set it now;
with a plain ``apply`` the setup peaked at 0.62x).  Losses (512-wide MLP, 200 steps, Adam lr 1e-3,
a teacher's labels): ``master="fp32", grad_dtype=float32, state_bits=32`` gives normal QAT's
losses bit for bit; the defaults end with the mean of the last 10 training losses +0.15%
of normal QAT's and a held-out loss 2.5% lower; ``master="none"`` (fixed scale, stochastic
codes) trains, but 12-14% behind.  ``benchmarks/qat_lean_loss.py`` (1024-wide, 200 steps, lr
1e-4): the defaults -0.26% (last 10) and -0.21% (held-out) vs normal QAT on the same seed,
where a second seed of normal QAT is -2.0% and -3.8%; at 4096 wide (50M), 200 steps: +0.13% and +0.35%.

After training, :meth:`LeanAdam.finish` puts float32 weights (the dequantized codes) back
and, by default, freezes each lean weight quantizer at the scale/zero point the codes were
made with, so ``qdsl.freeze`` and ``qdsl.export`` reproduce the trained codes exactly.
``qdsl.freeze``/``qdsl.remove`` on a model still in lean form raise a :class:`QdslError`.
In lean form ``model.state_dict()`` does not hold the lean weights (call ``finish()`` first).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qdsl.patch.handle import get_handle
from qdsl.patch.layer import MASTER_SUFFIX
from qdsl.qat.lean import LEAN_ATTR
from qdsl.qat.lean_state import (BlockQuantized, RandomBits, pack_rows, packed_cols, round_bf16_stochastic,
                                 stochastic_codes, unpack_rows)
from qdsl.quantizers.observers import MinMaxObserver
from qdsl.quantizers.proxy_grad import install as install_grad_path
from qdsl.spec.diagnostics import Diagnostic, QdslError, SpecError
from qdsl.spec.model import Role

__all__ = ["LeanAdam"]

_MASTERS = ("fp32", "bf16", "none")
_SCALES = ("auto", "track", "fixed")


def _rows(t: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of a per-channel parameter as a column (or a scalar as is)."""
    return t if t.dim() == 0 else t[r0:r1].unsqueeze(1)


class _LeanLinearFn(torch.autograd.Function):
    """``y = x·Wᵀ + b`` with ``W`` dequantized block by block; the backward updates ``W``."""

    @staticmethod
    def forward(ctx, x, bias, anchor, layer):
        ctx.layer = layer
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x)
        return layer.matmul(x, bias)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        gx = ctx.layer.backward(x, g, ctx.needs_input_grad[0])
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[1] else None
        return gx, gb, None, None


class _Adam:
    """Hyper-parameters and one Adam update of float32 rows (``torch.optim.Adam``'s formula)."""

    def __init__(self, lr, betas, eps, weight_decay) -> None:
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, weight_decay

    def apply(self, w, g, m, v, t) -> None:
        """``w``, ``m``, ``v`` updated in place from gradient ``g`` at step ``t`` (1-based)."""
        m.lerp_(g, 1 - self.b1)  # (the operations and order of torch.optim.Adam's single-tensor path)
        v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
        denom = v.sqrt().div_((1 - self.b2 ** t) ** 0.5).add_(self.eps)
        if self.wd:
            w.mul_(1 - self.lr * self.wd)  # decoupled (AdamW) weight decay
        w.addcdiv_(m, denom, value=-self.lr / (1 - self.b1 ** t))


class _LeanLayer:
    """One ``nn.Linear`` in lean form (see the module docstring)."""

    def __init__(self, opt: "LeanAdam", fqn: str, patch) -> None:
        self.opt, self.fqn, self.patch = opt, fqn, patch
        m = self.module = patch.module
        q = self.q = patch.wq
        self.order = list(m._parameters)
        w = m._parameters.pop("weight" + MASTER_SUFFIX)
        self.rows, self.cols = w.shape
        self.qmin, self.qmax = q.qmin, q.qmax
        self.step_rows = max(1, opt.chunk // self.cols)
        self.track = opt.scale == "track" or (
            opt.scale == "auto" and opt.master != "none" and _trackable(q))
        with torch.no_grad():
            scale, zp, _ = q.qparams(w)  # the weight quantizer's own scale for this weight
            self.scale = scale.detach().to(torch.float32).clone()
            self.zp = zp.detach().to(torch.int32).clone()
            self.symmetric = not bool(self.zp.any())
            self.codes = torch.empty(self.rows, packed_cols(self.cols, self.qmin, self.qmax), dtype=torch.uint8)
            for r0, r1 in self.blocks():
                self.codes[r0:r1] = pack_rows(self._quantize(w[r0:r1], r0, r1), self.qmin, self.qmax)
            self.master = None
            if opt.master == "fp32":
                self.master = w.detach()
            elif opt.master == "bf16":
                self.master = w.detach().to(torch.bfloat16)
        del w
        n = (self.rows, self.cols)
        if opt.state_bits == 8:
            self.m, self.v = BlockQuantized(*n, signed=True), BlockQuantized(*n, signed=False)
        else:
            self.m, self.v = torch.zeros(n), torch.zeros(n)
        self.t = 0
        self.forwards = 0
        self.updated = False
        self.stash: list[torch.Tensor] = []
        self.anchor = torch.zeros((), requires_grad=True)  # backward runs even for a first layer
        self.dummy = torch.zeros(()).expand(self.rows, self.cols)  # what nn.Linear sees (empty batch)
        q._last_scale = self.scale  # a derived (input*weight) bias reads the weight's current scale
        # drops the fake-quantized copy qdsl.apply computed (or its lazy stand-in: materialize=False)
        m.__dict__["weight"] = self.dummy
        setattr(m, LEAN_ATTR, True)
        # the 32-bit accumulator check reads the whole weight each forward: off in lean form
        # (narrower accumulators are refused; qdsl lint bounds a 32-bit sum statically)
        self.acc_sim = patch.acc_sim
        if self.acc_sim is not None:
            self.acc_sim.enabled = False
        self.hooks = [m.register_forward_pre_hook(self._pre),
                      # before the patch's output quantizer and accumulator hooks: they read our output
                      m.register_forward_hook(self._post, prepend=True)]

    # ------------------------------------------------------------------ blocks
    def blocks(self):
        for r0 in range(0, self.rows, self.step_rows):
            yield r0, min(self.rows, r0 + self.step_rows)

    def _quantize(self, w: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        q = self.q
        return q._ops.codes(q, w, self.scale if self.scale.dim() == 0 else self.scale[r0:r1],
                            self.zp if self.zp.dim() == 0 else self.zp[r0:r1], None)

    def dequantize(self, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` as float32: ``(code − z)·s``, the normal QAT path's value."""
        c = unpack_rows(self.codes[r0:r1], self.cols, self.qmin, self.qmax, torch.float32)
        if not self.symmetric:
            c.sub_(_rows(self.zp, r0, r1).to(torch.float32))
        return c.mul_(_rows(self.scale, r0, r1))

    def _float_rows(self, r0: int, r1: int) -> torch.Tensor:
        return self.master[r0:r1].to(torch.float32)

    # ------------------------------------------------------------ arithmetic
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, float_weights: bool = False) -> torch.Tensor:
        x2 = x.reshape(-1, self.cols)
        out = torch.empty(x2.shape[0], self.rows, dtype=torch.float32, device=x.device)
        for r0, r1 in self.blocks():
            w = self._float_rows(r0, r1) if float_weights else self.dequantize(r0, r1)
            if bias is None:
                out[:, r0:r1] = x2 @ w.t()
            else:
                out[:, r0:r1] = torch.addmm(bias[r0:r1], x2, w.t())
        return out.reshape(*x.shape[:-1], self.rows)

    def backward(self, x: torch.Tensor, g: torch.Tensor, need_gx: bool) -> torch.Tensor | None:
        if self.updated:
            raise QdslError(f"lean layer '{self.fqn}' got a second backward before opt.step(): "
                            "its weight is updated during backward (one backward per step)")
        self.updated = True
        self.t += 1
        x2 = x.reshape(-1, self.cols)
        g2 = g.reshape(-1, self.rows).to(torch.float32)
        gx = torch.zeros_like(x2) if need_gx else None
        with torch.no_grad():
            for r0, r1 in self.blocks():
                gr = g2[:, r0:r1]
                if gx is not None:
                    gx.addmm_(gr, self.dequantize(r0, r1))  # the weight before this step's update
                gw = gr.t() @ x2
                if self.opt.grad_dtype != torch.float32:
                    gw = gw.to(self.opt.grad_dtype).to(torch.float32)
                self.update(r0, r1, gw)
        return None if gx is None else gx.reshape(x.shape)

    def update(self, r0: int, r1: int, g: torch.Tensor) -> None:
        """One Adam step of rows ``[r0, r1)``, then their codes (and scale) again."""
        opt, q = self.opt, self.q
        if self.master is None:
            w = self.dequantize(r0, r1)
        else:
            w = self.master[r0:r1] if self.master.dtype == torch.float32 else self._float_rows(r0, r1)
            if not self.track:
                # the clipping-mask STE of the normal path: no gradient where the code clamps
                c = torch.round(w * _rows(self.scale, r0, r1).reciprocal()) + _rows(self.zp, r0, r1)
                g = g.masked_fill_((c < self.qmin) | (c > self.qmax), 0.0)
        if isinstance(self.m, BlockQuantized):
            m, v = self.m.read(r0, r1), self.v.read(r0, r1)
        else:
            m, v = self.m[r0:r1], self.v[r0:r1]
        opt.adam.apply(w, g, m, v, self.t)
        if isinstance(self.m, BlockQuantized):
            self.m.write(r0, r1, m)
            self.v.write(r0, r1, v)
        if self.master is not None and self.master.dtype != torch.float32:
            self.master[r0:r1] = round_bf16_stochastic(w, bits=opt.random.take(w.shape))
            w = self._float_rows(r0, r1)
        if self.master is None:
            s, z = _rows(self.scale, r0, r1), _rows(self.zp, r0, r1)
            c = stochastic_codes(w.mul_(s.reciprocal()).add_(z), bits=opt.random.take(w.shape))
            c = c.clamp_(self.qmin, self.qmax)
            self.codes[r0:r1] = pack_rows(c, self.qmin, self.qmax)
            return
        if self.track:  # the stateless weight quantizer's scale of the updated rows
            s, z, _ = q._ops.qparams(q, None, w.amin(dim=1), w.amax(dim=1), q.scale_rule)
            self.scale[r0:r1] = s.detach()
            self.zp[r0:r1] = z.detach().to(torch.int32)
        self.codes[r0:r1] = pack_rows(self._quantize(w, r0, r1), self.qmin, self.qmax)

    # ----------------------------------------------------------------- hooks
    def _pre(self, module, args):
        if not args or not isinstance(args[0], torch.Tensor):
            raise QdslError(f"lean layer '{self.fqn}' was called without a tensor input")
        self.stash.append(args[0])
        module.__dict__["weight"] = self.dummy  # the patch's refresh set it to None
        return (args[0].new_empty(0, self.cols),) + tuple(args[1:])

    def _post(self, module, args, output):
        x = self.stash.pop()
        bias = module.bias
        if not torch.is_grad_enabled():
            iq = self.patch.iq
            # calibration observes the float network (qdsl.calibration.run), as without lean form
            calibrating = iq is not None and iq.observing and self.master is not None
            return self.matmul(x, bias, float_weights=calibrating)
        self.forwards += 1
        if self.forwards > 1:
            raise QdslError(
                f"lean layer '{self.fqn}' ran twice with gradients before opt.step(): lean training "
                "updates a weight during backward, so a layer shared twice in one forward and "
                "gradient accumulation are not supported (evaluate under torch.no_grad())")
        return _LeanLinearFn.apply(x, bias, self.anchor, self)

    # ---------------------------------------------------------------- finish
    def nbytes(self) -> int:
        n = self.codes.numel() + self.scale.numel() * 4 + self.zp.numel() * 4
        if self.master is not None:
            n += self.master.numel() * self.master.element_size()
        for s in (self.m, self.v):
            n += s.nbytes() if isinstance(s, BlockQuantized) else s.numel() * 4
        return n

    def finish(self, freeze_weights: bool) -> None:
        m, q = self.module, self.q
        for h in self.hooks:
            h.remove()
        if self.acc_sim is not None:
            del self.acc_sim.enabled  # the class default again
        w = torch.empty(self.rows, self.cols)
        for r0, r1 in self.blocks():
            w[r0:r1] = self.dequantize(r0, r1)
        m.__dict__.pop("weight", None)
        m.__dict__.pop(LEAN_ATTR, None)
        params = dict(m._parameters, **{"weight" + MASTER_SUFFIX: nn.Parameter(w)})
        m._parameters.clear()
        m._parameters.update({k: params.pop(k) for k in self.order if k in params})
        m._parameters.update(params)
        if freeze_weights:
            _freeze_at(q, self.scale, self.zp)
        else:
            q._last_scale = None
        self.patch.refresh_now()


def _trackable(q) -> bool:
    return isinstance(q.observer, MinMaxObserver) and q.axis == 0 and q.group_size is None


def _freeze_at(q, scale: torch.Tensor, zp: torch.Tensor) -> None:
    """Freeze weight quantizer ``q`` at the scale/zero point the codes were made with (what
    ``TensorQuantizer.freeze`` stores, without re-deriving them from the weight)."""
    q.scale = scale.clone()
    q.zero_point = zp.expand(scale.shape).clone() if zp.dim() == 0 else zp.clone()
    q.threshold = torch.empty(0)
    q.frozen_flag.fill_(True)
    q._refresh()


def _unsupported(fqn: str, patch, masters: dict[int, str]) -> Diagnostic | None:
    q, plan, m = patch.wq, patch.plan, patch.module
    recipe = plan.recipe(Role.WEIGHT)

    def at(field: str, message: str, hint: str) -> Diagnostic:
        p = plan.provenance.get((Role.WEIGHT, field)) or plan.provenance.get((Role.WEIGHT, "kind"))
        span = p.set_by.span if p is not None and p.set_by.span.known else recipe.span
        return Diagnostic.error("E520", f"layer '{fqn}': {message}", span, hint)

    if not (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward):
        return at("kind", f"lean training holds nn.Linear weights, not {type(m).__name__}",
                  "pass skip_unsupported=True to train it normally, or use qdsl.qat.LeanOptimizer")
    if not q.format.fixed_codes:
        return at("kind", f"a {q.format.name} weight: lean training holds int codes",
                  "use an int weight quantizer, or skip_unsupported=True")
    if q.qmax - q.qmin > 255:
        return at("bits", f"{recipe.bits}-bit weight codes: lean training packs at most 8 bits",
                  "use bits <= 8")
    if q.learned:
        return at("scale", f"a learned weight scale ({recipe.scale}): the scale is not trained in lean form",
                  "use a float scale, or qdsl.qat.LeanOptimizer")
    if q.group_size is not None or (q.axis not in (None, 0)):
        return at("granularity", "a group-wise weight scale (or one along an axis other than 0)",
                  "use per_channel or per_tensor weights")
    if patch.bn is not None:
        return at("kind", "BatchNorm is folded into the weight (its float weight is not the master)",
                  "set fold_bn off for lean training")
    if patch.acc_sim is not None and patch.plan.accumulator.bits < 32:
        return at("kind", f"a simulated {patch.plan.accumulator.bits}-bit accumulator reads the whole weight",
                  "use the default 32-bit accumulator for lean training")
    w = patch.master("weight")
    if w is None or w.dtype != torch.float32:
        return at("kind", f"a {None if w is None else w.dtype} weight: lean training needs float32 weights",
                  "keep the model in float32")
    if id(w) in masters:
        return at("kind", f"its weight is the same tensor as layer '{masters[id(w)]}''s (tied weights)",
                  "untie the weights, or skip_unsupported=True")
    masters[id(w)] = fqn
    return None


class LeanAdam:
    """Adam over an applied model with its quantized Linear weights in lean form; see the
    module docstring.  ``layers``: the lean layers by name; ``skipped``: layers trained
    normally, with the reason."""

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, master: str = "bf16",
                 grad_dtype: torch.dtype = torch.bfloat16, state_bits: int = 8, scale: str = "auto",
                 chunk: int = 1 << 20, seed: int = 0, skip_unsupported: bool = False) -> None:
        if master not in _MASTERS:
            raise QdslError(f"master must be one of {', '.join(_MASTERS)}, not {master!r}")
        if scale not in _SCALES:
            raise QdslError(f"scale must be one of {', '.join(_SCALES)}, not {scale!r}")
        if scale == "track" and master == "none":
            raise QdslError("scale='track' recomputes the scale from a master: it needs master='fp32' or 'bf16'")
        if state_bits not in (8, 32):
            raise QdslError(f"state_bits must be 8 or 32, not {state_bits}")
        if grad_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise QdslError(f"grad_dtype must be torch.float32, torch.bfloat16 or torch.float16, not {grad_dtype}")
        handle = get_handle(model)
        self.model = model
        self.adam = _Adam(lr, betas, eps, weight_decay)
        self.master, self.grad_dtype, self.state_bits, self.scale = master, grad_dtype, state_bits, scale
        self.chunk = int(chunk)
        self.generator = torch.Generator().manual_seed(seed)
        self._random: RandomBits | None = None
        install_grad_path(handle.container.quantizers.values())  # QAT gradients for this model only
        diags: list[Diagnostic] = []
        self.skipped: dict[str, str] = {}
        chosen = []
        masters: dict[int, str] = {}
        for fqn, patch in handle.layers.items():
            if getattr(patch.module, LEAN_ATTR, False):
                raise QdslError(f"layer '{fqn}' is already in lean form: finish() its optimizer first")
            if patch.wq is None or "weight" not in patch._moved:
                continue
            d = _unsupported(fqn, patch, masters)
            if d is None:
                chosen.append((fqn, patch))
            elif skip_unsupported:
                self.skipped[fqn] = d.message
            else:
                diags.append(d)
        if diags:
            raise SpecError(diags)
        if scale == "track":
            bad = [fqn for fqn, p in chosen if not _trackable(p.wq)]
            if bad:
                raise QdslError(f"scale='track' needs per-channel (axis 0) minmax weight quantizers: {', '.join(bad)}")
        if not chosen:
            raise QdslError("no layer can train in lean form (quantized nn.Linear weights, int of at most 8 bits)")
        # one layer at a time: its float weight is freed before the next is converted
        self.layers = {fqn: _LeanLayer(self, fqn, patch) for fqn, patch in chosen}
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.state: dict[int, tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._param_hook) for p in self.params]
        self.finished = False

    @property
    def random(self) -> RandomBits:
        """Random bits for the stochastic roundings (drawn at the first update)."""
        if self._random is None:
            n = max(lay.step_rows * lay.cols for lay in self.layers.values())
            self._random = RandomBits(n, self.generator)
        return self._random

    @property
    def lr(self) -> float:
        return self.adam.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.adam.lr = float(value)

    def _param_hook(self, p: torch.Tensor) -> None:
        # a parameter outside the lean layers (bias, learned scale, skipped layer): float32
        # Adam as soon as its gradient is complete, and the gradient is freed at once
        st = self.state.get(id(p))
        if st is None:
            st = self.state[id(p)] = (torch.zeros_like(p, dtype=torch.float32),
                                      torch.zeros_like(p, dtype=torch.float32), [0])
        st[2][0] += 1
        with torch.no_grad():
            w = p if p.dtype == torch.float32 else p.detach().float()
            self.adam.apply(w, p.grad.to(torch.float32), st[0], st[1], st[2][0])
            if w is not p:
                p.copy_(w)
        p.grad = None

    def _check(self) -> None:
        if self.finished:
            raise QdslError("this LeanAdam is finished: the model is in normal form again")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear (gradients are consumed during backward); kept for the usual loop."""
        self._check()

    def step(self) -> None:
        """Close a training step (the updates already happened during ``backward()``)."""
        self._check()
        for lay in self.layers.values():
            lay.forwards = 0
            lay.updated = False

    def nbytes(self) -> int:
        """Bytes the lean layers hold (codes, scales, masters, Adam moments)."""
        return sum(lay.nbytes() for lay in self.layers.values())

    def finish(self, freeze_weights: bool = True) -> nn.Module:
        """Normal form again: each lean layer gets a float32 ``weight_float`` equal to its
        dequantized codes; ``freeze_weights`` freezes its weight quantizer at the codes'
        scale/zero point (so ``qdsl.freeze``/``export`` keep exactly these codes); without it
        the quantizer keeps deriving its scale from the weight.  Returns the model."""
        self._check()
        for h in self._hooks:
            h.remove()
        for lay in self.layers.values():
            lay.finish(freeze_weights)
        self.finished = True
        return self.model

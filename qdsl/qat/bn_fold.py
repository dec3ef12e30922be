"""BatchNorm folding during QAT (Krishnamoorthi 2018, §3.2), on an unmodified model.

For a ``Conv1d``/``Conv2d`` followed by a ``BatchNorm1d``/``BatchNorm2d`` the integer
graph computes ``conv(x, Q(W·f)) + b'`` with the folded weight ``W·f`` and
``f = γ / sqrt(σ²_running + ε)`` per output channel.  QAT must therefore fake-quantize
*that* weight, while BatchNorm keeps normalising with batch statistics (and keeping its
running statistics up to date) until they are frozen.

How (no class is replaced, nothing is copied): the conv's weight gets a
parametrization ``W ↦ Q(W·f) / f``.  Because a convolution is linear in each output
channel's weight,

    conv(x, Q(W·f)/f) = conv(x, Q(W·f)) / f        (per output channel)

so the unmodified BatchNorm after the conv sees exactly the pre-BN activation of the
folded, quantized layer, rescaled back by ``1/f``:

* training, live statistics: ``BN(conv(x, Q(Wf))/f)`` = ``conv(x, Q(Wf))·σ_run/σ_B·...``,
  i.e. the whitepaper's batch-statistics form with correction factor ``σ_run/σ_B``,
  and BN updates its running statistics from the batch as usual;
* frozen statistics (:func:`freeze_bn_stats`) or eval: BN uses the running statistics,
  and ``BN(conv(x, Q(Wf))/f) = conv(x, Q(Wf)) + β - γμ/σ + (b - μ)·f`` - exactly what
  the folded integer graph computes, so the training forward equals inference.

:func:`fold` then turns a QAT fold into a real fold (weight ``W·f``, bias
``β + (b - μ)·f``, BN bypassed) that :func:`unfold` reverses exactly, for export.

Guarantees: with an identity quantizer, outputs, gradients and BN running statistics
equal the unfolded model's (float tolerance); ``remove`` restores the model's
``state_dict`` bit for bit.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

__all__ = [
    "CONV_TYPES",
    "BN_TYPES",
    "fold_factor",
    "find_conv_bn_pairs",
    "FoldedWeight",
    "QatBnFold",
    "freeze_bn_stats",
    "unfreeze_bn_stats",
    "folded_weight_and_bias",
]

CONV_TYPES = (nn.Conv1d, nn.Conv2d)
BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d)


def fold_factor(bn: nn.modules.batchnorm._BatchNorm) -> Tensor:
    """``γ / sqrt(σ²_running + ε)`` per channel (γ = 1 without affine); differentiable in γ."""
    inv_std = torch.rsqrt(bn.running_var + bn.eps)
    return inv_std if bn.weight is None else bn.weight * inv_std


def folded_weight_and_bias(conv: nn.Module, bn: nn.modules.batchnorm._BatchNorm, weight: Optional[Tensor] = None):
    """The inference fold: ``(W·f, β + (b - μ)·f)`` with running statistics.

    ``weight`` defaults to the conv's current (float master) weight.
    """
    w = conv.weight if weight is None else weight
    f = fold_factor(bn)
    b = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
    beta = bn.bias if bn.bias is not None else torch.zeros_like(bn.running_mean)
    return w * _per_out(f, w), beta + (b - bn.running_mean) * f


def _per_out(f: Tensor, w: Tensor) -> Tensor:
    return f.reshape(-1, *([1] * (w.dim() - 1)))


def find_conv_bn_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """``(conv_fqn, bn_fqn)`` for every conv whose output feeds only a BatchNorm.

    Found by ``torch.fx`` tracing (residual blocks call ``self.bn1(self.conv1(x))``
    without a ``Sequential``); if the model cannot be traced, falls back to adjacent
    children of ``nn.Sequential`` containers.  Channel counts must match.
    """
    modules = dict(model.named_modules())
    pairs: list[tuple[str, str]] = []
    try:
        import torch.fx

        graph = torch.fx.symbolic_trace(model).graph
        for node in graph.nodes:
            if node.op != "call_module" or not isinstance(modules.get(node.target), CONV_TYPES):
                continue
            users = list(node.users)
            if len(users) == 1 and users[0].op == "call_module" and isinstance(modules.get(users[0].target), BN_TYPES):
                pairs.append((node.target, users[0].target))
    except Exception:  # untraceable control flow: the Sequential structure is still reliable
        pairs = list(_sequential_pairs(model))
    out = []
    for c, b in pairs:
        conv, bn = modules[c], modules[b]
        if _conv_kind(conv) == _bn_kind(bn) and conv.out_channels == bn.num_features and bn.track_running_stats:
            out.append((c, b))
    return out


def _conv_kind(m: nn.Module) -> int:
    return 1 if isinstance(m, nn.Conv1d) else 2


def _bn_kind(m: nn.Module) -> int:
    return 1 if isinstance(m, nn.BatchNorm1d) else 2


def _sequential_pairs(model: nn.Module) -> Iterator[tuple[str, str]]:
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Sequential):
            kids = list(mod.named_children())
            for (n1, m1), (n2, m2) in zip(kids, kids[1:]):
                if isinstance(m1, CONV_TYPES) and isinstance(m2, BN_TYPES):
                    pre = f"{name}." if name else ""
                    yield pre + n1, pre + n2


class FoldedWeight(nn.Module):
    """Parametrization ``W ↦ Q(W·f) / f`` with ``f`` from the BatchNorm (see module docs).

    ``quantizer`` fake-quantizes the folded weight (any module or callable; ``None`` =
    identity, i.e. plain folding).  The BatchNorm is referenced, not owned, so it
    appears once in ``state_dict``/``named_modules``.
    """

    _qdsl_internal = True

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, quantizer: Optional[Callable[[Tensor], Tensor]] = None):
        super().__init__()
        self.__dict__["bn"] = bn  # not a submodule: the model already owns it
        if isinstance(quantizer, nn.Module):
            self.quantizer = quantizer
        else:
            self.__dict__["quantizer"] = quantizer

    def folded(self, w: Tensor) -> Tensor:
        """The weight the integer graph will hold (before quantization): ``W·f``."""
        return w * _per_out(fold_factor(self.bn), w)

    def forward(self, w: Tensor) -> Tensor:
        f = _per_out(fold_factor(self.bn), w)
        # a zero γ would make 1/f blow up; such a channel's output is β regardless of W
        f = torch.where(f == 0, torch.full_like(f, torch.finfo(f.dtype).tiny), f)
        wf = w * f
        q = wf if self.quantizer is None else self.quantizer(wf)
        return q / f


class QatBnFold:
    """Installs :class:`FoldedWeight` on every conv-BN pair of a model; ``remove()`` undoes it.

    ``quantizers`` maps a conv fqn to the quantizer of its folded weight (missing =
    identity).  The conv must not already be parametrized on ``weight``: the fold
    wraps the weight quantizer rather than stacking after it, because the quantizer
    must see ``W·f``.
    """

    def __init__(self, model: nn.Module, pairs=None, quantizers: Optional[dict] = None):
        self.model = model
        self.pairs = list(find_conv_bn_pairs(model) if pairs is None else pairs)
        modules = dict(model.named_modules())
        self._installed: list[str] = []
        quantizers = quantizers or {}
        for conv_name, bn_name in self.pairs:
            conv, bn = modules[conv_name], modules[bn_name]
            if parametrize.is_parametrized(conv, "weight"):
                raise ValueError(f"{conv_name}.weight is already parametrized; install the BN fold first")
            parametrize.register_parametrization(conv, "weight", FoldedWeight(bn, quantizers.get(conv_name)))
            self._installed.append(conv_name)

    def parametrizations(self) -> dict[str, FoldedWeight]:
        modules = dict(self.model.named_modules())
        return {n: modules[n].parametrizations.weight[0] for n in self._installed}

    def remove(self) -> None:
        """Restore every conv's plain weight parameter (the float master, unchanged)."""
        modules = dict(self.model.named_modules())
        for name in self._installed:
            parametrize.remove_parametrizations(modules[name], "weight", leave_parametrized=False)
        self._installed = []


def _freeze_hook(bn: nn.Module, args):
    # model.train() sets bn.training = True again; re-assert the frozen state on every
    # call so "frozen" survives train()/eval() toggling without touching BN's class.
    bn.training = False


def freeze_bn_stats(model: nn.Module, bns=None) -> int:
    """Stop updating BN running statistics and normalise with them, also in ``train()``.

    After this, a training forward equals the folded inference forward (Krishnamoorthi
    freezes BN statistics late in QAT for exactly this reason).  Applies to every
    BatchNorm that follows a conv (or the given ones); returns how many were frozen.
    """
    if bns is None:
        modules = dict(model.named_modules())
        bns = [modules[b] for _, b in find_conv_bn_pairs(model)]
    n = 0
    for bn in bns:
        if getattr(bn, "_qdsl_bn_freeze", None) is None:
            bn._qdsl_bn_freeze = bn.register_forward_pre_hook(_freeze_hook)
            n += 1
    return n


def unfreeze_bn_stats(model: nn.Module) -> int:
    """Undo :func:`freeze_bn_stats` (BN follows ``model.train()``/``eval()`` again)."""
    n = 0
    for m in model.modules():
        h = getattr(m, "_qdsl_bn_freeze", None)
        if h is not None:
            h.remove()
            del m._qdsl_bn_freeze
            m.training = getattr(model, "training", True)
            n += 1
    return n

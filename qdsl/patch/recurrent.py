"""The patch of one recurrent module: ``nn.LSTM``, ``GRU``, ``RNN`` and their cells.

A :class:`RecurrentPatch` stands where a :class:`~qdsl.patch.layer.LayerPatch` stands in
``handle.layers`` (same lifecycle methods), but quantizes what an integer recurrent
kernel sees at every time step, which a hook around torch's fused kernel cannot reach:

* its forward **pre-hook** computes the module's result with
  :func:`qdsl.patch.recurrent_math.run_layers` (the same function as torch's, with the
  quantizers in it), keeps it, and hands the module an empty batch (``N = 0``, one time
  step: free) so its own forward does no work; its forward **hook** (prepended, so hooks
  registered later see the real result) returns the kept result, with the ``output``
  quantizer applied to the output sequence (cells: to ``h'``).  No class is replaced,
  no ``forward`` rebound, and the parameters stay where they are (torch's flat-weight
  bookkeeping keeps pointing at them; ``state_dict()`` keys do not change): the weight
  proxies read them on each forward, so QAT gradients reach them through the STE.
  ``remove()`` only removes the two hooks, so the model is restored exactly.
* proxies, one per tensor torch keeps separately (keys in ``model._qdsl.quantizers``):
  ``<fqn>:weight_ih_l0``, ``:weight_hh_l0_reverse``, ``:bias_ih_l1``, ``:bias_hh_l1``,
  ``:hidden_l0``, ``:cell_l0_reverse``, ``:input`` (layer 0), ``:input_l1`` (the
  previous layer's output, both directions, requantized to one scale), ``:output``;
  cells drop the ``_l0`` suffix.  ``granularity = channel`` on a weight is per row, i.e.
  per gate and hidden unit; ``granularity = gate`` is one scale per gate block (the proxy
  is per channel over the weight viewed as ``(gates, rows·cols)``; its scale has one entry
  per gate, repeated over the gate's rows for the bias).  A derived (``input*weight``) bias is quantized per
  accumulator: ``bias_ih`` at ``s_input · s_weight_ih``, ``bias_hh`` at
  ``s_hidden · s_weight_hh``.

Refused (E511 at apply): ``proj_size > 0`` (an LSTM with projections has a third weight
``weight_hr`` qdsl has no role for).  A ``PackedSequence`` input is refused at the forward
(a QdslError naming the module).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from qdsl.patch.computed import ComputedPatch
from qdsl.patch.recurrent_math import GATES, DirParams, run_layers
from qdsl.resolve.plan import LayerPlan
from qdsl.spec.diagnostics import QdslError
from qdsl.spec.model import GranularityKind, Role

__all__ = ["RecurrentPatch", "is_recurrent"]

_RECURRENT = (nn.RNNBase, nn.RNNCellBase)


def is_recurrent(module: nn.Module) -> bool:
    """A torch recurrent layer qdsl patches with :class:`RecurrentPatch`."""
    return isinstance(module, _RECURRENT)


def _kind(module: nn.Module) -> str:
    if isinstance(module, (nn.LSTM, nn.LSTMCell)):
        return "LSTM"
    if isinstance(module, (nn.GRU, nn.GRUCell)):
        return "GRU"
    return "RNN"


class RecurrentPatch(ComputedPatch):
    """See the module docstring."""

    def __init__(self, handle, plan: LayerPlan, module: nn.Module, make: Callable[[Role, str], Any]):
        super().__init__(handle, plan, module)
        self.kind = _kind(module)
        self.cell = isinstance(module, nn.RNNCellBase)
        self.layers = 1 if self.cell else int(module.num_layers)
        self.dirs = 2 if getattr(module, "bidirectional", False) else 1
        self.suffixes = [""] if self.cell else [
            f"_l{layer}{'_reverse' if d else ''}" for layer in range(self.layers) for d in range(self.dirs)]
        proxy = functools.partial(self._proxy, make)
        self.inputs = [proxy(Role.INPUT, "" if layer == 0 else f"_l{layer}") for layer in range(self.layers)]
        self.w_ih = [proxy(Role.WEIGHT_IH, s) for s in self.suffixes]
        self.w_hh = [proxy(Role.WEIGHT_HH, s) for s in self.suffixes]
        has_bias = bool(module.bias)
        self.b_ih = [proxy(Role.BIAS, "_ih" + s) if has_bias else None for s in self.suffixes]
        self.b_hh = [proxy(Role.BIAS, "_hh" + s) if has_bias else None for s in self.suffixes]
        self.hidden = [proxy(Role.HIDDEN, s) for s in self.suffixes]
        self.cells = [proxy(Role.CELL, s) if self.kind == "LSTM" else None for s in self.suffixes]
        self.out = proxy(Role.OUTPUT, "")
        # granularity = gate: the proxy is per channel over the weight viewed as (gates, rows·cols)
        self.gated = {r: (q := plan.roles.get(r)) is not None and q.granularity.kind is GranularityKind.GATE
                      for r in (Role.WEIGHT_IH, Role.WEIGHT_HH)}

    # ----------------------------------------------------- LayerPatch's interface
    def param_proxies(self) -> list[Any]:
        """Every weight and bias proxy, per layer and direction (None where absent)."""
        return self.w_ih + self.w_hh + self.b_ih + self.b_hh

    def freeze(self) -> None:
        """Activations first, then weights, then biases (a derived scale needs both)."""
        for q in self.inputs + self.hidden + self.cells + [self.out]:
            if q is not None and not q.frozen:
                q.freeze()
        with torch.no_grad():
            for i, s in enumerate(self.suffixes):
                for wq, name in ((self.w_ih[i], "weight_ih"), (self.w_hh[i], "weight_hh")):
                    if wq is not None and not wq.frozen:
                        wq.freeze(self._view(self.master(name + s), name))
                for side, bq, xq, wq in (("ih", self.b_ih[i], self._input_of(i), self.w_ih[i]),
                                         ("hh", self.b_hh[i], self.hidden[i], self.w_hh[i])):
                    if bq is None or bq.frozen:
                        continue
                    if bq.derived:
                        if xq.dynamic:
                            continue  # the bias scale follows the input's per-batch scale
                        bq.set_derived_scale(xq.scale * self._per_row(wq.scale, side))
                    bq.freeze(self.master(f"bias_{side}{s}"))

    # ------------------------------------------------------------------ forward
    def _view(self, w: torch.Tensor, name: str) -> torch.Tensor:
        """The tensor the weight proxy quantizes: ``(gates, rows·cols)`` under gate granularity."""
        gated = self.gated[Role.WEIGHT_IH if name == "weight_ih" else Role.WEIGHT_HH]
        return w.reshape(GATES[self.kind], -1) if gated else w

    def _per_row(self, s_w: torch.Tensor, side: str) -> torch.Tensor:
        """A weight scale per output row (a gate's scale repeated for its rows)."""
        if self.gated[Role.WEIGHT_IH if side == "ih" else Role.WEIGHT_HH] and s_w.numel() > 1:
            return s_w.repeat_interleave(int(self.module.hidden_size))
        return s_w

    def _input_of(self, i: int) -> Any:
        return self.inputs[i // self.dirs]

    def _weights(self, i: int, side: str) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None]]:
        s = self.suffixes[i]
        wq = self.w_ih[i] if side == "ih" else self.w_hh[i]
        bq = self.b_ih[i] if side == "ih" else self.b_hh[i]
        xq = self._input_of(i) if side == "ih" else self.hidden[i]

        def get() -> tuple[torch.Tensor, torch.Tensor | None]:
            w = self.master(f"weight_{side}{s}")
            b = self.master(f"bias_{side}{s}")
            if wq is not None:
                w = wq(self._view(w, f"weight_{side}")).reshape(w.shape)
            if bq is not None and b is not None:
                if bq.derived and not bq.frozen:
                    # the scale the activation and weight proxies just used (LayerPatch.refresh)
                    s_x = xq.current_scale() if xq is not None else None
                    s_w = wq.current_scale() if wq is not None else None
                    bq.set_derived_scale(None if s_x is None or s_w is None
                                         else s_x.detach() * self._per_row(s_w.detach(), side))
                b = bq(b)
            return w, b
        return get

    def _forward(self, x: torch.Tensor, hx: Any) -> Any:
        m = self.module
        hid = int(m.hidden_size)
        if self.cell:
            unbatched = x.dim() == 1
            seq = x.reshape(1, 1, -1) if unbatched else x.unsqueeze(0)
        else:
            unbatched = x.dim() == 2
            seq = x.unsqueeze(1) if unbatched else (x.transpose(0, 1) if m.batch_first else x)
        n = seq.shape[1]
        h0 = c0 = None
        if hx is not None:
            h0, c0 = hx if self.kind == "LSTM" else (hx, None)
        shape = (self.layers * self.dirs, n, hid)

        def state(t: torch.Tensor | None) -> torch.Tensor:
            if t is None:
                return seq.new_zeros(shape)
            return t.reshape(shape)  # cells: (N, H) or (H,); unbatched layers: (L·D, H)
        h0 = state(h0)
        c0 = state(c0) if self.kind == "LSTM" else None
        dirs = [DirParams(self._weights(i, "ih"), self._weights(i, "hh"),
                          self.hidden[i] or _identity, self.cells[i] or _identity)
                for i in range(len(self.suffixes))]
        inputs = [q or _identity for q in self.inputs]
        out, h_n, c_n = run_layers(self.kind, seq, h0, c0, dirs, inputs, self.dirs,
                                   dropout=float(getattr(m, "dropout", 0.0)), training=m.training,
                                   relu=getattr(m, "nonlinearity", "tanh") == "relu")
        if self.cell:
            h, c = h_n[0], (c_n[0] if c_n is not None else None)
            if unbatched:
                h, c = h[0], (c[0] if c is not None else None)
            if self.out is not None:
                h = self.out(h)
            return (h, c) if self.kind == "LSTM" else h
        if unbatched:
            out, h_n = out[:, 0], h_n[:, 0]
            c_n = c_n[:, 0] if c_n is not None else None
        elif m.batch_first:
            out = out.transpose(0, 1)
        if self.out is not None:
            out = self.out(out)
        return (out, (h_n, c_n)) if self.kind == "LSTM" else (out, h_n)

    def _pre(self, module, args, kwargs):
        x = args[0] if args else kwargs.get("input")
        hx = args[1] if len(args) > 1 else kwargs.get("hx")
        if isinstance(x, PackedSequence):
            raise QdslError(f"'{self.fqn or '<model>'}' ({type(module).__name__}) got a PackedSequence: qdsl's "
                            "quantized recurrent forward takes padded tensors only; pad the batch "
                            "(torch.nn.utils.rnn.pad_packed_sequence) or skip this layer")
        if not isinstance(x, torch.Tensor):
            raise QdslError(f"'{self.fqn or '<model>'}' ({type(module).__name__}) was called without an input tensor")
        self._stash.append(self._forward(x, hx))
        # the module's own forward runs on an empty batch (no work); _post returns ours
        if self.cell:
            empty = x.new_zeros((0, x.shape[-1]))
        else:
            empty = x.new_zeros((0, 1, x.shape[-1]) if module.batch_first else (1, 0, x.shape[-1]))
        return (empty,), {}



def _identity(x: torch.Tensor) -> torch.Tensor:
    return x

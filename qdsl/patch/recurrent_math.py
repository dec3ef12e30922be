"""The recurrent layers' forward, step by step, with a quantizer at every state update.

torch's ``nn.LSTM``/``GRU``/``RNN`` run a fused kernel on their flat weights, so neither
a hook nor a moved parameter can reach the state at each time step.  While qdsl is
applied, :mod:`qdsl.patch.recurrent` computes the layer with :func:`run_layers` instead:
the same function as torch (equal to it within float rounding when every quantizer is
the identity; ``tests/patch/test_recurrent.py`` checks ~1e-6), written the way an integer
accelerator evaluates it, so the quantizers sit where it would requantize:

* per layer ``l``: ``x_l = q_input_l(x)`` (layer 0: the module input; ``l > 0``: the
  previous layer's output sequence, both directions concatenated, requantized to one
  scale), then ``A_ih = x_l · W_ih^T + b_ih`` for every time step (one accumulator at
  scale ``s_x · s_wih``);
* per step ``t`` and direction: ``A_hh = h_{t-1} · W_hh^T + b_hh`` (scale ``s_h · s_whh``),
  then the gates, and

  - LSTM (gates i, f, g, o):  ``c_t = q_cell(σ(f)·c_{t-1} + σ(i)·tanh(g))``,
    ``h_t = q_hidden(σ(o)·tanh(c_t))``
  - GRU (gates r, z, n):  ``n = tanh(A_ih[n] + σ(r)·A_hh[n])``,
    ``h_t = q_hidden((1 − z)·n + z·h_{t-1})``
  - RNN: ``h_t = q_hidden(tanh(A_ih + A_hh))`` (or relu)

  with ``h_0 = q_hidden(h0)`` and ``c_0 = q_cell(c0)`` (zeros when not given: exactly 0).

A quantizer that is absent is the identity.  Dropout between layers is torch's
(``F.dropout`` on each layer's output but the last, in training mode).
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs
import torch
import torch.nn.functional as F

__all__ = ["DirParams", "run_layers", "GATES"]

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
"""Gate blocks stacked in ``weight_ih``/``weight_hh`` rows (torch's order: LSTM i, f, g, o; GRU r, z, n)."""

Quant = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@attrs.define
class DirParams:
    """One layer and direction: a callback giving the (fake-quantized) weights once the
    activations they pair with are quantized, and the state quantizers."""

    weights_ih: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    """``(W_ih, b_ih)``, called after this layer's input quantizer ran."""
    weights_hh: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    """``(W_hh, b_hh)``, called after ``h_0`` was quantized."""
    hidden: Quant = _identity
    cell: Quant = _identity


def _step(kind: str, a_ih: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None, w_hh: torch.Tensor,
          b_hh: torch.Tensor | None, p: DirParams, relu: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    a_hh = F.linear(h, w_hh, b_hh)
    if kind == "LSTM":
        i, f, g, o = (a_ih + a_hh).chunk(4, -1)
        c = p.cell(torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g))
        return p.hidden(torch.sigmoid(o) * torch.tanh(c)), c
    if kind == "GRU":
        xr, xz, xn = a_ih.chunk(3, -1)
        hr, hz, hn = a_hh.chunk(3, -1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return p.hidden((1 - z) * n + z * h), None
    pre = a_ih + a_hh
    return p.hidden(torch.relu(pre) if relu else torch.tanh(pre)), None


def run_layers(kind: str, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None,
               dirs: Sequence[DirParams], inputs: Sequence[Quant], directions: int, *,
               dropout: float = 0.0, training: bool = False, relu: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(output, h_n, c_n)`` of a stacked recurrent layer (see the module docstring).

    ``x`` is ``(T, N, F)``; ``h0``/``c0`` are ``(layers·directions, N, H)``; ``dirs`` has
    one entry per layer and direction (layer-major, forward first), ``inputs`` one input
    quantizer per layer.  ``c_n`` is None except for an LSTM.
    """
    steps = x.shape[0]
    h_n: list[torch.Tensor] = []
    c_n: list[torch.Tensor] = []
    for layer, q_in in enumerate(inputs):
        x = q_in(x)
        outs = []
        for d in range(directions):
            p = dirs[layer * directions + d]
            w_ih, b_ih = p.weights_ih()
            a_ih = F.linear(x, w_ih, b_ih)
            h = p.hidden(h0[layer * directions + d])
            c = p.cell(c0[layer * directions + d]) if c0 is not None else None
            w_hh, b_hh = p.weights_hh()
            ys: list[torch.Tensor | None] = [None] * steps
            order = range(steps) if d == 0 else range(steps - 1, -1, -1)
            for t in order:
                h, c = _step(kind, a_ih[t], h, c, w_hh, b_hh, p, relu)
                ys[t] = h
            outs.append(torch.stack(ys) if steps else x.new_zeros((0,) + tuple(h.shape)))
            h_n.append(h)
            if c is not None:
                c_n.append(c)
        x = outs[0] if directions == 1 else torch.cat(outs, -1)
        if dropout and training and layer < len(inputs) - 1:
            x = F.dropout(x, dropout, True)
    return x, torch.stack(h_n), (torch.stack(c_n) if c_n else None)

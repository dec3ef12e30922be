"""Fake quantization that computes the integer graph's LayerNorm and softmax.

The graph's LAYERNORM and SOFTMAX/SOFTMAX_MASKED (qdsl/graph/ops) are fixed integer
functions of their input codes: an exact exp table at the scores grid, ``floor`` of a
2^30 fraction, 14-bit gamma codes, a 16-bit normalized value.  Float ``F.layer_norm`` and
``torch.softmax`` on the fake-quantized values land within a fraction of an LSB of them,
but on the other side of a rounding boundary in a few percent of the codes the next
quantizer writes (MiniLM: 2-5% of the first q/k/v codes after a LayerNorm), and the scores
grid (~0.3) turns a 1-2 LSB score difference into up to 20 LSB of probability; through
six layers the two rounding patterns drift apart (hidden cosine graph/fake-quant 0.9895).

So once the grids are fixed, the fake-quant forward of these two ops *is* the graph's op:
the input's codes go through the reference executor's own functions
(:func:`qdsl.graph.ops.layernorm.layernorm`, :func:`qdsl.graph.ops.softmax_masked.softmax_kept`,
numpy int64 on the CPU) with the constants the exporter derives
(:func:`~qdsl.graph.ops.layernorm.layernorm_constants`, :func:`~qdsl.graph.ops.softmax.softmax_table`),
and the result comes back as ``float + (integer - float).detach()``: the forward value is
the integer one, the gradient the float formula's (straight-through), so QAT still trains.

When (the rule):

* softmax (:func:`simulated_probs`): the ``scores`` and ``probs`` quantizers are both frozen,
  static, per-tensor integer quantizers of at most 8 bits, the softmax runs along the last
  axis (the only one the graph lowers).  Before that (calibration, QAT before freeze) the
  grids still move and the float softmax runs; a disabled quantizer, or kept scores off the
  scores grid (an additive mask other than 0/-inf, which export refuses), also keep it.
* LayerNorm (:class:`LayerNormSim`, a forward hook on every ``nn.LayerNorm`` over one
  axis of a patched model): the model is frozen (or exported) and not every quantizer is
  disabled (``q.enabled = False`` on all of them gives the float model back).  Its input is read as the
  graph reads it: the codes of its own input quantizer (the narrow form: frozen, static,
  per-tensor, at most 8 bits), else the float residual sum on a fine power-of-two grid
  (the wide form, :func:`wide_grid`).  The graph's wide grid ``s_t`` comes from the
  operands' worst case (qdsl.graph.ops.layernorm.wide_sum_grid: ``2^30`` steps for it); this one
  from the value (``2^29`` codes for the largest entry).  Both grids are powers of two and
  LAYERNORM keeps 24 bits of ``N·(x - mean)`` per row after its row shift ``k``, whose step
  ``s_t·2^k`` does not depend on ``s_t`` once ``k > 0``: the two agree up to the graph's rounding
  of each term onto ``s_t`` and the float32 sum's (measured: see docs/qgraph.md §6); a sum of
  marked terms (qdsl.patch.residual_sim) uses the graph's grid and terms instead.
  The result is the wide output ``acc·unit`` (the op's I32 accumulator); the next
  quantizer rounds it as the graph's REQUANTIZE does (float32 of ``acc·unit`` aside).

* A pre-norm ``nn.TransformerEncoderLayer``'s second residual add
  (:class:`PreNormResidualSim`): the first residual sum ``h = x + attn(norm1(x))`` is returned
  by no module; ``norm2``'s (implied) input quantizer reads it, and the exporter reads the
  second add's operand ``h`` at that grid too (qdsl.export.lower_layers.add_pending: the graph
  has those codes).  Frozen, the fake-quant layer's output is likewise ``q(h) + ff(norm2(h))``
  (was ``h + ff``, half an LSB of ``norm2``'s grid from it: 64.7% of a small encoder's output
  codes equal to the graph's, now 100%).

* Post-norm residual sums (qdsl.patch.residual_sim): a frozen Linear with an 8-bit output
  quantizer (:class:`LinearSim`) gives the graph's LINEAR codes (exact sum on codes, one
  rounding); one without marks its output as a residual term, as do simulated LayerNorms and
  embedding lookups (:class:`EmbeddingMark`); a wide LayerNorm whose input is the float32 sum
  of marked outputs reads the graph's integer terms on the exporter's grid; an 8-bit input
  quantizer reading a wide LayerNorm output gets its REQUANTIZE codes (:class:`WideReadSim`).
  MiniLM's frozen fake-quant hidden states then equal the graph's to the bit.

Cost: one numpy pass per op on the CPU, one more product per simulated Linear (on its
codes, float32 in exact chunks; qdsl.patch.residual_sim.exact_accumulator).  The C++
runtime's int8 GEMM gives the same sums 3-5x cheaper, but the runtime is a higher layer than
patch (tests/test_layering.py), so it is not used here.  It is what makes a frozen transformer evaluate
slower than before ``freeze`` (MiniLM transformer-int8 3.5-4.4x float vs 1.2x; README): the
price of frozen outputs equal to the graph's codes, not a cache that misses.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from qdsl.graph.ops.layernorm import layernorm
from qdsl.graph.ops.softmax import SOFTMAX_FRAC_BITS, softmax_table
from qdsl.graph.ops.softmax_masked import softmax_kept
from qdsl.graph.requant import INT32_MAX, INT32_MIN, make_rescale
from qdsl.graph.schema import Rescale, RescaleKind, Rounding
from qdsl.patch.residual_sim import (CodesTerm, LinearTerm, TermLog, WideTerm, layernorm_constants_at, linear_codes,
                                     mark_wide, residual_terms, wide_codes, wide_term)

__all__ = ["simulated_probs", "simulated_layernorm", "LayerNormSim", "LinearSim", "EmbeddingMark", "WideReadSim", "SoftmaxModuleSim", "PreNormResidualSim",
           "install_layernorm_sims", "mark_graph_value", "wide_grid", "grid_of"]

_ROUNDINGS = {"half_even": Rounding.HALF_EVEN, "half_away": Rounding.HALF_AWAY, "floor": Rounding.FLOOR}
"""The quantizer roundings the graph has (qdsl.export.values.ROUNDINGS)."""

WIDE_CODE_BITS = 29
"""The wide-form grid puts the largest input entry at about 2^29 codes (int32 with headroom)."""


def grid_of(q: Any) -> tuple[float, int, int, int, Rounding] | None:
    """``(scale, zero point, qmin, qmax, rounding)`` of a frozen, static, per-tensor integer
    quantizer of at most 8 bits (the graph's activation grids), else None."""
    if q is None or not getattr(q, "frozen", False) or not getattr(q, "enabled", True) or q.dynamic \
            or q.scale.numel() != 1:
        return None
    if q.format.activation_lowering(q.recipe.signed) != "int" or q.recipe.bits > 8:
        return None
    rounding = _ROUNDINGS.get(q.recipe.rounding)
    if rounding is None:
        return None
    return (float(q.scale.detach().reshape(-1)[0]), int(q.zero_point.reshape(-1)[0]), int(q.qmin), int(q.qmax),
            rounding)


def _codes(x: torch.Tensor, scale: float, zp: int) -> np.ndarray:
    """The integer codes of a fake-quantized value ``(q - zp)·scale`` (exact: |q| <= 255)."""
    return np.rint(x.detach().double().cpu().numpy() / scale).astype(np.int64) + zp


def _straight_through(value: np.ndarray | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    v = (value if isinstance(value, torch.Tensor) else torch.from_numpy(value)).to(like.dtype).to(like.device)
    return like + (v - like).detach() if like.requires_grad else v


def simulated_probs(x: torch.Tensor, keep: torch.Tensor, probs: torch.Tensor, sq: Any, pq: Any) -> torch.Tensor:
    """The graph's SOFTMAX_MASKED of the fake-quantized scores ``x`` (kept entries on ``sq``'s
    grid) over the positions ``keep`` marks, on ``pq``'s grid, straight-through to the
    float ``probs`` (what the fake-quant path computed); ``probs`` itself when a grid is not
    fixed yet (module docstring)."""
    gs, gp = grid_of(sq), grid_of(pq)
    if gs is None or gp is None:
        return probs
    s_s, zp_s = gs[0], gs[1]
    s_p, zp_p, qmin, qmax, rounding = gp
    keep_np = keep.detach().cpu().numpy()
    codes = np.where(keep_np, _codes(x.masked_fill(~keep, 0.0), s_s, zp_s), zp_s)
    if codes.size and (codes.min() < gs[2] or codes.max() > gs[3]):
        # kept scores off the grid: an additive mask other than 0/-inf, which the graph refuses
        return probs
    rescale = make_rescale(2.0**-SOFTMAX_FRAC_BITS / s_p, rounding, single=True)
    a = dict(table=softmax_table(s_s), **rescale.attrs(), out_zp=zp_p, out_min=qmin, out_max=qmax)
    out = softmax_kept(codes, keep_np, a)
    return _straight_through((out - zp_p).astype(np.float64) * s_p, probs)


def wide_grid(x: torch.Tensor) -> float:
    """A power-of-two grid putting the largest ``|x|`` at about ``2^WIDE_CODE_BITS`` codes."""
    m = float(x.detach().abs().max()) if x.numel() else 0.0
    if not math.isfinite(m) or m == 0.0:
        return 1.0
    return math.ldexp(1.0, math.frexp(m)[1] - WIDE_CODE_BITS)


_IDENTITY = Rescale(RescaleKind.POT, [1], [0])


def simulated_layernorm(module: nn.LayerNorm, x: torch.Tensor, y: torch.Tensor, grid: tuple | None,
                        log: TermLog | None = None, rounding: Rounding = Rounding.HALF_EVEN) -> torch.Tensor:
    """The graph's LAYERNORM of ``x`` (``module``'s input) as its wide output ``acc·unit``,
    straight-through to the float result ``y``.  ``grid``: the input quantizer's
    :func:`grid_of` (the narrow form: ``x`` holds its codes), or None (the wide form: the
    graph's residual sum when ``log`` finds its terms, qdsl.patch.residual_sim; else ``x`` on
    :func:`wide_grid`).  ``rounding``: the LAYERNORM's input rounding (its output quantizer's;
    half even for the wide output).  With ``log``, the result is marked as a wide term."""
    found = None
    if grid is not None:
        s_in, zp = grid[0], grid[1]
        codes, in_a = [_codes(x, s_in, zp)], _in_attrs(zp)
    elif log is not None and (found := residual_terms(module, x, log, rounding)) is not None:
        codes, in_a, s_in = found
    else:
        s_in = wide_grid(x)
        codes, in_a = [np.rint(x.detach().double().cpu().numpy() / s_in).astype(np.int64)], _in_attrs(0)
    g_int, b_int, unit, eps_int = layernorm_constants_at(module, s_in)
    a = dict(in_a, gamma=g_int, beta=b_int, eps=eps_int, **_IDENTITY.attrs(), out_zp=0, out_min=INT32_MIN,
             out_max=INT32_MAX)
    acc = layernorm(codes, a)
    # float32(acc)·float32(unit): the graph's DEQUANTIZE of the wide output, to the bit
    out = _straight_through(acc.astype(np.float32) * np.float32(unit), y)
    if log is not None:
        log.mark(out, wide_term(g_int, b_int, unit, acc))
    return out


def _in_attrs(zp: int) -> dict:
    return dict(in_zp=(zp,), in_kind=(int(_IDENTITY.kind),), in_multiplier=(1,), in_shift=(0,),
                in_rounding=(int(_IDENTITY.rounding),))


class LayerNormSim:
    """The forward hook of one ``nn.LayerNorm`` (see the module docstring)."""

    def __init__(self, handle: Any, fqn: str, log: TermLog | None = None):
        self.handle, self.fqn, self.log = handle, fqn, log

    def active(self) -> bool:
        """Frozen (or exported), and some quantizer of the model enabled (all disabled: the
        float model)."""
        return _frozen_and_quantized(self.handle)

    def __call__(self, module: nn.LayerNorm, args: tuple, output: Any) -> Any:
        if not self.active() or not args or not isinstance(args[0], torch.Tensor) \
                or not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        patch = self.handle.layers.get(self.fqn)
        iq = getattr(patch, "iq", None)
        grid = grid_of(iq)
        if iq is not None and grid is None:
            return None  # disabled, or a grid the graph cannot read as 8-bit codes (export refuses it)
        out_grid = grid_of(getattr(patch, "oq", None))
        rounding = out_grid[4] if out_grid is not None else Rounding.HALF_EVEN
        return simulated_layernorm(module, args[0], output, grid, self.log, rounding)


def _frozen_and_quantized(handle: Any) -> bool:
    """Frozen (or exported), and some quantizer of the model enabled (all disabled: the float model)."""
    if getattr(handle.state, "value", None) not in ("frozen", "exported"):
        return False
    return any(getattr(q, "enabled", True) for q in handle.container.quantizers.values())


class PreNormResidualSim:
    """The hooks of one pre-norm ``nn.TransformerEncoderLayer`` (see the module docstring):
    ``norm2``'s input as its quantizer wrote it, ``ff`` as ``dropout2`` returns it, and the
    layer's output replaced by their sum."""

    def __init__(self, handle: Any, fqn: str):
        self.handle, self.norm2 = handle, f"{fqn}.norm2" if fqn else "norm2"
        self.h_q: torch.Tensor | None = None
        self.ff: torch.Tensor | None = None

    def install(self, layer: nn.TransformerEncoderLayer) -> list[Any]:
        # appended: norm2's pre-hook runs after its input quantizer's; the layer's hook
        # prepended: before a layer `output` quantizer, which then reads the graph's sum
        return [layer.norm2.register_forward_pre_hook(self._read_h),
                layer.dropout2.register_forward_hook(self._read_ff),
                layer.register_forward_pre_hook(self._reset),
                layer.register_forward_hook(self._output, prepend=True)]

    def _reset(self, module: nn.Module, args: tuple) -> None:
        self.h_q = self.ff = None

    def _read_h(self, module: nn.Module, args: tuple) -> None:
        patch = self.handle.layers.get(self.norm2)
        if args and isinstance(args[0], torch.Tensor) and grid_of(getattr(patch, "iq", None)) is not None:
            self.h_q = args[0]

    def _read_ff(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.ff = output if isinstance(output, torch.Tensor) else None

    def _output(self, module: nn.TransformerEncoderLayer, args: tuple, output: Any) -> Any:
        h_q, ff, self.h_q, self.ff = self.h_q, self.ff, None, None
        if not module.norm_first or module.training or h_q is None or ff is None \
                or not isinstance(output, torch.Tensor) or output.shape != ff.shape \
                or not _frozen_and_quantized(self.handle):
            return None
        v = h_q + ff
        return output + (v - output).detach() if output.requires_grad else v


class SoftmaxModuleSim:
    """The forward hook of one ``nn.Softmax`` whose input and output quantizers are the
    scores and probabilities grids (an implied input, "implied by softmax")."""

    def __init__(self, handle: Any, fqn: str):
        self.handle, self.fqn = handle, fqn

    def __call__(self, module: nn.Softmax, args: tuple, output: Any) -> Any:
        patch = self.handle.layers.get(self.fqn)
        iq, oq = getattr(patch, "iq", None), getattr(patch, "oq", None)
        if iq is None or oq is None or not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        if module.dim not in (-1, x.dim() - 1):
            return None
        keep = ~(x <= torch.finfo(x.dtype).min / 2)  # softmax_roles.masked_positions
        return simulated_probs(x, keep, output, iq, oq)


class LinearSim:
    """The forward hook of one patched ``nn.Linear`` with a frozen 8-bit input grid and int
    weights, once frozen (before its output quantizer's hook):

    * with an 8-bit output quantizer, the output is the graph's LINEAR codes
      (residual_sim.linear_codes: the exact sum on codes, one rounding of ``s_acc/s_out``),
      straight-through; the output quantizer then reads them unchanged;
    * without one (the graph's accumulator, read by a residual sum), the output is marked as a
      residual term (residual_sim.LinearTerm)."""

    def __init__(self, handle: Any, fqn: str, log: TermLog):
        self.handle, self.fqn, self.log = handle, fqn, log

    def __call__(self, module: nn.Linear, args: tuple, output: Any) -> Any:
        grid = self._grid(args, output)
        if grid is None:
            return None
        patch = self.handle.layers[self.fqn]
        out_grid = grid_of(getattr(patch, "oq", None))
        if out_grid is None:
            return None
        codes = linear_codes(patch, args[0], grid, out_grid)  # binary64, a fresh tensor: in place
        return _straight_through(codes.sub_(out_grid[1]).mul_(out_grid[0]), output)

    def mark(self, module: nn.Linear, args: tuple, output: Any) -> None:
        """The last forward hook: a result with no output quantizer is marked as a term."""
        if self._grid(args, output) is not None and getattr(self.handle.layers.get(self.fqn), "oq", None) is None:
            self.log.mark(output, LinearTerm(self.handle.layers[self.fqn], args[0], self._grid(args, output)))

    def _grid(self, args: tuple, output: Any) -> tuple | None:
        """The input grid when the layer is simulated (class doc), else None."""
        if not isinstance(output, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor) \
                or not _frozen_and_quantized(self.handle):
            return None
        patch = self.handle.layers.get(self.fqn)
        wq, grid = getattr(patch, "wq", None), grid_of(getattr(patch, "iq", None))
        if grid is None or wq is None or not wq.frozen or not wq.enabled or wq.group_size is not None \
                or wq.axis not in (None, 0, -2) or wq.format.name != "int" or patch.plan.accumulator.bits != 32:
            return None
        return grid


class EmbeddingMark:
    """The forward hook (after its output quantizer's) of a patched ``nn.Embedding`` with a
    frozen 8-bit output grid: once frozen, its output is marked as a wide sum's term
    (residual_sim.CodesTerm), ``fixed`` when the ids are not one of the model's inputs (BERT's
    position and token-type ids from its buffers: the exporter folds those lookups into a
    constant)."""

    def __init__(self, handle: Any, fqn: str, log: TermLog):
        self.handle, self.fqn, self.log = handle, fqn, log

    def __call__(self, module: nn.Embedding, args: tuple, output: Any) -> None:
        if not isinstance(output, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor) \
                or not _frozen_and_quantized(self.handle):
            return None
        grid = grid_of(getattr(self.handle.layers.get(self.fqn), "oq", None))
        if grid is not None:
            fixed = args[0].untyped_storage().data_ptr() not in self.log.inputs
            self.log.mark(output, CodesTerm(output, grid, fixed))
        return None


class WideReadSim:
    """The forward pre-hook (before its input quantizer's) of a patched module with a frozen
    8-bit input grid: once frozen, an input that is a simulated LayerNorm's wide output (marked
    in the term log) is replaced by the graph's REQUANTIZE codes of its accumulator
    (residual_sim.wide_codes), straight-through; the input quantizer then reads them unchanged."""

    def __init__(self, handle: Any, fqn: str, log: TermLog):
        self.handle, self.fqn, self.log = handle, fqn, log

    def __call__(self, module: nn.Module, args: tuple) -> Any:
        if not args or not isinstance(args[0], torch.Tensor) or not _frozen_and_quantized(self.handle):
            return None
        term = self.log.term_of(args[0])
        if not isinstance(term, WideTerm):
            return None
        grid = grid_of(getattr(self.handle.layers.get(self.fqn), "iq", None))
        if grid is None or term.acc.shape != tuple(args[0].shape):
            return None
        codes = wide_codes(term, grid)  # binary64, a fresh tensor: in place
        return (_straight_through(codes.sub_(grid[1]).mul_(grid[0]), args[0]),) + tuple(args[1:])


def mark_graph_value(handle: Any, value: torch.Tensor, layernorm: nn.LayerNorm, acc: np.ndarray) -> None:
    """``value``, fed to the frozen model in place of ``layernorm``'s output, is the graph's
    wide LAYERNORM output with accumulator ``acc``: the residual sums reading it are then
    simulated as the graph computes them (qdsl.patch.residual_sim; what benchmarks/fq_agreement.py
    and the tests do to feed one block the graph's own input)."""
    mark_wide(handle.term_log, value, layernorm, acc)


def install_layernorm_sims(handle: Any, model: nn.Module) -> list[Any]:
    """A :class:`LayerNormSim` on every ``nn.LayerNorm`` over one axis, a
    :class:`SoftmaxModuleSim` on every ``nn.Softmax`` (each before any output quantizer's
    hook: it reads the module's result) and a :class:`PreNormResidualSim` on every pre-norm
    ``nn.TransformerEncoderLayer``; returns the hook handles."""
    hooks, log, inputs_hooked = [], TermLog(), False
    handle.term_log = log  # read by mark_graph_value
    for fqn, m in model.named_modules():
        if isinstance(m, nn.TransformerEncoderLayer) and m.norm_first:
            hooks += PreNormResidualSim(handle, fqn).install(m)
        if isinstance(m, nn.Linear) and fqn in handle.layers:
            sim = LinearSim(handle, fqn, log)  # codes before the output quantizer, the mark after every hook
            hooks += [m.register_forward_hook(sim, prepend=True), m.register_forward_hook(sim.mark)]
        if fqn in handle.layers and getattr(handle.layers[fqn], "iq", None) is not None:
            hooks.append(m.register_forward_pre_hook(WideReadSim(handle, fqn, log), prepend=True))
        if isinstance(m, nn.Embedding) and fqn in handle.layers and not inputs_hooked:
            # the model's own input tensors (their storages): an embedding of other ids is fixed
            hooks.append(model.register_forward_pre_hook(log.read_inputs, with_kwargs=True))
            inputs_hooked = True
        if isinstance(m, nn.Embedding) and fqn in handle.layers:
            hooks.append(m.register_forward_hook(EmbeddingMark(handle, fqn, log)))
        if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
            hooks.append(m.register_forward_hook(LayerNormSim(handle, fqn, log), prepend=True))
        elif isinstance(m, nn.Softmax):
            hooks.append(m.register_forward_hook(SoftmaxModuleSim(handle, fqn), prepend=True))
    return hooks

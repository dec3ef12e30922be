"""Lowering of a patched ``nn.LSTM``/``GRU``/``RNN`` and their cells
(:class:`qdsl.patch.recurrent.RecurrentPatch`): one LSTM/GRU/RNN op per layer and direction
(qdsl/graph/ops/recurrent.py), in the order of the fake-quant forward
(qdsl/patch/recurrent_math.py)::

    x ─QUANTIZE/REQUANTIZE (:input)─┬─ LSTM l0 ──────────┬─ CONCAT (:input_l1) ─┬─ LSTM l1 ─ ...
                                    └─ LSTM l0 reverse ──┘                      └─ LSTM l1 reverse

Each op reads its layer's input codes, the int8 codes of ``weight_ih``/``weight_hh`` (per
row scales; ``granularity = gate`` repeats a gate's scale over its rows), the int32 biases
at ``s_input·s_wih[row]`` and ``s_hidden·s_whh[row]`` (the bias quantizers' codes; a float
bias is rounded at that scale), and writes its output sequence and ``h_n`` on its
``hidden`` quantizer's grid and ``c_n`` on its ``cell`` quantizer's.  A bidirectional
layer's two outputs meet in a CONCAT that rescales both to the next layer's ``input_l<k>``
grid (the fake-quant model's ``q_input_l(cat(...))``).  The module's ``output`` quantizer,
when set, requantizes the output sequence (cells: ``h'``).

What the model reads of the result: the output sequence, ``h_n``/``c_n`` indexed by layer
and direction (``h_n[-1]``, ``torch.cat([h_n[-2], h_n[-1]], 1)``: a tuple of per-slice
values here) and ``out[:, -1]`` (that step is ``h_n`` of the last layer for a
unidirectional module; a bidirectional one's joins the forward ``h_n`` with the reverse
output at the last position, a SELECT).

An initial state ``lstm(x, (h0, c0))`` / ``gru(x, h0)``: each of ``h0``/``c0`` is a graph
input ``(layers·directions, N, H)`` declared with that static first dim (the slot, not the
batch: the graph then runs at the exported batch size N); a SELECT per layer and direction
reads its ``[N, H]`` slice, quantized on that slot's hidden/cell grid as the fake-quant
model's ``q_hidden(h0[k])`` (dynamic: the F32 slice, quantized per step by the op).  A
constant all-zero state is no state.  ``batch_first=False``: the module reads a
:class:`~qdsl.export.lower_attn.SeqFirst` (``x.transpose(0, 1)`` of a batch-first value),
runs on the batch-first value, and its output sequence is a SeqFirst again (``out[-1]``
is the last step, ``out.transpose(0, 1)`` the batch-first sequence).

An ``nn.LSTM`` (``nn.GRU``) whose input quantizers are ``dynamic`` (specs/int8-dynamic.qspec)
becomes one LSTM_DYNAMIC (GRU_DYNAMIC) per layer and direction instead
(qdsl/graph/ops/recurrent_dynamic.py): F32 in and out, the input and each step's hidden state quantized when the graph runs, float
gates and cell; a bidirectional layer's two F32 outputs are the next layer's two input
parts (the graph has no float concat).

Refused with the module named: ``batch_first=False`` on a value that is not a transposed
batch-first one (a (T, N, F) graph input: the graph's first axis is the batch), a state that
is neither a graph input nor zero, a cell state wider than 8 bits given as ``c0`` (QUANTIZE
writes 8-bit codes), an unbatched call, a dynamic RNN or cell, ``out[:, -1]`` of a dynamic bidirectional module, and quantizers the ops cannot
reproduce (static: wider than 8 bits for the hidden state or 16 for the cell, not
half-even rounding, asymmetric weights; dynamic: per-row scales, a quantized bias, cell
or output).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from qdsl.export.lower_attn import SeqFirst
from qdsl.export.lower_dynamic import as_float, dynamic_attrs
from qdsl.export.lower_layers import act_target, concat_value
from qdsl.export.values import ROUNDINGS, ConstVal, ExportError, FloatVal, Pending, QVal, Target
from qdsl.graph.ir import DType, Op, OpType, Rounding
from qdsl.graph.ops.dynamic import f32_bits
from qdsl.graph.ops.recurrent import BIAS_LIMIT, factor, sigmoid_table
from qdsl.patch.recurrent import RecurrentPatch

__all__ = ["lower_recurrent", "last_step", "is_recurrent_sequence"]

_LAST = "_qdsl_recurrent_last"  # lw attribute: {id(output sequence value): (value, its last step, fqn, class)}


def _fail(fqn: str, message: str, hint: str | None = None):
    raise ExportError(fqn, message, hint)


def _to(lw, value: Any, t: Target) -> QVal:
    """``value`` on the grid ``t`` (lw.quantize's static branch, for a proxy with no (fqn, role) key)."""
    if isinstance(value, Pending):
        return value.materialize(lw.b, t)
    if isinstance(value, QVal):
        return lw.requantize(value, t)
    if isinstance(value, FloatVal) and value.name is not None and value.reshape is None:
        name = lw.b.op(OpType.QUANTIZE, t.where, [value.name], t.dtype, value.shape,
                       dict(scale=t.scale, zero_point=t.zp, qmin=t.qmin, qmax=t.qmax, rounding=int(t.rounding)))
        return lw.b.q(name, t.scale, t.zp, t.qmin, t.qmax, t.dtype, value.shape)
    origin = getattr(value, "origin", "?")
    raise ExportError(t.where, f"the recurrent layer reads an unquantized value from '{origin}'",
                      f"quantize '{origin}' (an output quantizer) or set `input = a8` for this layer")


def _act(proxy, where: str) -> Target:
    if proxy is None:
        _fail(where.partition(":")[0], f"'{where}' is not quantized, so the integer graph cannot compute it",
              "quantize the layer's input, hidden and (LSTM) cell states in the spec")
    t = act_target(proxy, where)
    if t.dtype is DType.BIN or t.rounding is not Rounding.HALF_EVEN:
        _fail(where.partition(":")[0], f"'{where}' must be an int quantizer rounding half to even for the "
              "recurrent op", "use `rounding = half_even` (the default) and an int format")
    return t


def _cell_target(proxy, where: str) -> Target:
    """The cell state's grid: up to 16 bits (I32 container above 8)."""
    fqn = where.partition(":")[0]
    if proxy is None:
        _fail(fqn, f"'{where}' is not quantized", "set `cell = int(bits=16, signed, symmetric)` (or 8 bits)")
    if proxy.dynamic or not proxy.frozen or proxy.scale.numel() != 1:
        _fail(fqn, f"'{where}' must be a frozen per-tensor static quantizer", "calibrate and freeze; per tensor")
    if proxy.format.activation_lowering(proxy.recipe.signed) != "int" or proxy.recipe.bits > 16:
        _fail(fqn, f"'{where}' must be an int quantizer of at most 16 bits")
    if ROUNDINGS.get(proxy.recipe.rounding) is not Rounding.HALF_EVEN:
        _fail(fqn, f"'{where}' must round half to even for the recurrent op", "use `rounding = half_even`")
    qmin, qmax, zp = int(proxy.qmin), int(proxy.qmax), int(proxy.zero_point.reshape(-1)[0])
    dtype = DType.I8 if (qmin >= -128 and qmax <= 127) else DType.U8 if (qmin >= 0 and qmax <= 255) else DType.I32
    if dtype is DType.I32 and zp != 0:
        _fail(fqn, f"'{where}' wider than 8 bits must be symmetric (zero point 0)", "set `symmetric` on the cell")
    return Target(float(proxy.scale.reshape(-1)[0]), zp, qmin, qmax, dtype, Rounding.HALF_EVEN, where)


def _weight(patch, i: int, side: str, where: str) -> tuple[np.ndarray, torch.Tensor]:
    """int8 codes ``[G·H, K]`` and the float32 per-row scale of ``weight_<side>`` of slice ``i``."""
    wq = patch.w_ih[i] if side == "ih" else patch.w_hh[i]
    name = f"weight_{side}"
    if wq is None:
        _fail(patch.fqn, f"{name} is left in float, so the recurrent op has no integer weight",
              f"quantize it: `{name} = w8` in a rule for '{patch.fqn}'")
    if not wq.frozen:
        _fail(patch.fqn, f"the {name} quantizer is not frozen", "call qdsl.freeze(model)")
    w = patch.master(name + patch.suffixes[i]).detach()
    codes = wq.int_repr(patch._view(w, name)).reshape(w.shape).to(torch.int64).numpy()
    if (wq.format.activation_lowering(wq.recipe.signed) != "int" or codes.min(initial=0) < -128
            or codes.max(initial=0) > 127 or bool((wq.zero_point != 0).any())):
        _fail(patch.fqn, f"{name} must be signed symmetric int (<= 8 bits) for the recurrent op",
              "use a signed symmetric weight quantizer")
    scale = patch._per_row(wq.scale.detach().float().reshape(-1), side)
    return codes, torch.broadcast_to(scale, (w.shape[0],)).clone()


def _bias(patch, i: int, side: str, s_acc: torch.Tensor) -> np.ndarray:
    """int32 bias at ``s_acc`` (float32, as the fake-quant derived scale), zeros without one."""
    b = patch.master(f"bias_{side}{patch.suffixes[i]}")
    if b is None:
        return np.zeros(s_acc.shape[0], dtype=np.int64)
    b = b.detach()
    bq = patch.b_ih[i] if side == "ih" else patch.b_hh[i]
    if bq is not None:
        if not bq.frozen:
            _fail(patch.fqn, "the bias quantizer is not frozen", "call qdsl.freeze(model)")
        codes = bq.int_repr(b).double()
        exact = codes * (bq.scale.detach().double().reshape(-1) / s_acc.double())
        vals = torch.where(exact == exact.round(), exact, torch.round(exact))
    else:
        vals = torch.round(b.double() / s_acc.double())
    if bool((vals.abs() > BIAS_LIMIT).any()):
        _fail(patch.fqn, "the bias does not fit ±2^30 at scale input·weight", "the input or weight scale is too small")
    return vals.to(torch.int64).numpy()


def _factors(values) -> tuple[tuple[int, ...], tuple[int, ...]]:
    pairs = [factor(float(v)) for v in values]
    return tuple(m for m, _ in pairs), tuple(s for _, s in pairs)


def _direction(lw, patch, i: int, x: QVal, t_h: Target, t_c: Target | None, state: list[QVal], reverse: bool,
               where: str) -> tuple[QVal, QVal, QVal | None]:
    """One LSTM/GRU op: (output sequence, h_n, c_n)."""
    m = patch.module
    hid = int(m.hidden_size)
    w_ih, s_wih = _weight(patch, i, "ih", where)
    w_hh, s_whh = _weight(patch, i, "hh", where)
    s_x = torch.tensor(x.scale, dtype=torch.float32)
    s_h = torch.tensor(t_h.scale, dtype=torch.float32)
    acc_ih, acc_hh = s_x * s_wih, s_h * s_whh  # the fake-quant derived bias scales (binary32)
    b_ih, b_hh = _bias(patch, i, "ih", acc_ih), _bias(patch, i, "hh", acc_hh)
    try:
        ih = _factors(acc_ih.double() * 2.0**20)
        hh = _factors(acc_hh.double() * 2.0**20)
        relu = patch.kind == "RNN" and getattr(patch.module, "nonlinearity", "tanh") == "relu"
        # the hidden factor: LSTM and RNN-tanh from a Q24 gate value, RNN-relu from the Q20
        # pre-activation, GRU from its U in units of 2^-24 of a code
        h_real = 1.0 / t_h.scale if patch.kind == "GRU" else (2.0**-20 if relu else 2.0**-24) / t_h.scale
        h_m, h_s = factor(h_real)
        extra: dict = {}
        if t_c is not None:
            c_m, c_s = factor(1.0 / t_c.scale)
            ct_m, ct_s = factor(t_c.scale * 2.0**20)
            extra = dict(c_zp=t_c.zp, c_qmin=t_c.qmin, c_qmax=t_c.qmax, c_mult=c_m, c_shift=c_s,
                         ct_mult=ct_m, ct_shift=ct_s)
    except ValueError as exc:
        raise ExportError(patch.fqn, f"a scale of the recurrent layer is out of the op's range: {exc}") from None
    a = dict(reverse=int(reverse), x_zp=x.zp, h_zp=t_h.zp, h_qmin=t_h.qmin, h_qmax=t_h.qmax,
             ih_mult=ih[0], ih_shift=ih[1], hh_mult=hh[0], hh_shift=hh[1], h_mult=h_m, h_shift=h_s,
             sigmoid=sigmoid_table(), **extra)
    b = lw.b
    consts = [b.tensor(f"{where}.weight_ih", DType.I8, w_ih.shape, w_ih),
              b.tensor(f"{where}.weight_hh", DType.I8, w_hh.shape, w_hh),
              b.tensor(f"{where}.bias_ih", DType.I32, b_ih.shape, b_ih),
              b.tensor(f"{where}.bias_hh", DType.I32, b_hh.shape, b_hh)]
    b.info[consts[0]] = (s_wih.double().numpy(), np.zeros(len(b_ih), dtype=np.int64))
    b.info[consts[1]] = (s_whh.double().numpy(), np.zeros(len(b_hh), dtype=np.int64))
    shape = tuple(x.shape[:-1]) + (hid,)
    n_shape = (-1, hid)
    y = b.tensor(f"{where}:y", t_h.dtype, shape)
    h_n = b.tensor(f"{where}:h_n", t_h.dtype, n_shape)
    outs = [y, h_n]
    if t_c is not None:
        outs.append(b.tensor(f"{where}:c_n", t_c.dtype, n_shape))
    op = {"LSTM": OpType.LSTM, "GRU": OpType.GRU, "RNN": OpType.RNN}[patch.kind]
    if op is OpType.RNN:
        a["relu"] = int(relu)
    b.ops.append(Op(op, where, [x.name] + consts + [s.name for s in state], outs, a))
    qy = b.q(y, t_h.scale, t_h.zp, t_h.qmin, t_h.qmax, t_h.dtype, shape)
    qh = b.q(h_n, t_h.scale, t_h.zp, t_h.qmin, t_h.qmax, t_h.dtype, n_shape)
    qc = None if t_c is None else b.q(outs[2], t_c.scale, t_c.zp, t_c.qmin, t_c.qmax, t_c.dtype, n_shape)
    return qy, qh, qc


def _initial_state(lw, patch, hx: Any, lstm: bool, t_h: Target, t_c: Target | None) -> list[QVal]:
    if hx is None:
        return []
    h, c = (hx if lstm else (hx, None))
    state = [_to(lw, h, t_h)]
    if lstm:
        if t_c.dtype is DType.I32:
            _fail(patch.fqn, "an initial cell state on a cell grid wider than 8 bits has no integer lowering "
                             "(the graph's activations are 8-bit)", "quantize the cell to 8 bits, or pass no state")
        state.append(_to(lw, c, t_c))
    return state


def _state_input(lw, patch, value: Any, what: str) -> FloatVal | None:
    """A module's ``(layers·directions, N, H)`` initial ``what`` (h0/c0): the graph input,
    redeclared with its static first dim (layer and direction, not the batch); None for a
    constant that is exactly zero (the op's start without a state)."""
    slots = patch.layers * patch.dirs
    if isinstance(value, ConstVal) and not bool(torch.as_tensor(value.value).any()):
        return None
    if not (isinstance(value, FloatVal) and value.name is not None and value.reshape is None
            and value.name in lw.input_names and len(value.shape) == 3):
        origin = getattr(value, "origin", type(value).__name__)
        _fail(patch.fqn, f"the initial {what} of nn.{type(patch.module).__name__} comes from '{origin}'; the integer "
                         "graph takes it as a graph input (or a constant zero state)",
              f"pass {what} as an argument of the model's forward")
    lw.b.redeclare(value.name, (slots,) + tuple(value.shape[1:]))
    return FloatVal(value.origin, (slots,) + tuple(value.shape[1:]), value.name)


def _state_slice(lw, value: FloatVal | None, i: int, where: str) -> FloatVal | None:
    """``value[i]``, an F32 ``[N, H]`` (SELECT along the slot axis)."""
    if value is None:
        return None
    shape = tuple(value.shape[1:])
    name = lw.b.op(OpType.SELECT, where, [value.name], DType.F32, shape, dict(axis=0, index=i))
    return FloatVal(value.origin, shape, name)


def _module_states(lw, patch, hx: Any, lstm: bool) -> tuple[FloatVal | None, FloatVal | None]:
    if hx is None:
        return None, None
    h, c = (hx if lstm else (hx, None))
    h0, c0 = _state_input(lw, patch, h, "h0"), (None if c is None else _state_input(lw, patch, c, "c0"))
    if lstm and (h0 is None) != (c0 is None):
        _fail(patch.fqn, f"nn.{type(patch.module).__name__} gets one of h0/c0 as a graph input and the other as a "
                         "constant zero; the integer op takes both or neither", "pass both as forward arguments")
    return h0, c0


def lower_recurrent(lw, node, m: nn.Module, fqn: str) -> Any:
    """The value(s) the recurrent module call ``node`` returns (see the module doc)."""
    patch = lw.handle.layers.get(fqn)
    if not isinstance(patch, RecurrentPatch):
        _fail(fqn, f"nn.{type(m).__name__} is left in float, so it cannot be part of the integer graph",
              "quantize its weight_ih, weight_hh, input, hidden (and cell) in the spec")
    args = torch.fx.node.map_arg(node.args, lambda n: lw.env[n])
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: lw.env[n])
    x = args[0] if args else kwargs.get("input")
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    lstm = patch.kind == "LSTM"
    seq_first = not patch.cell and not m.batch_first
    if seq_first:
        if not isinstance(x, SeqFirst):
            _fail(fqn, f"nn.{type(m).__name__} with batch_first=False reads a (T, N, F) value, but the graph's first "
                       "axis is the batch and no op moves it",
                  "feed it x.transpose(0, 1) of a batch-first (N, T, F) input, or build it with batch_first=True")
        x = x.value  # the op runs on the batch-first value; its output sequence is swapped back
    rank = 2 if patch.cell else 3
    if len(getattr(x, "shape", ())) != rank:
        _fail(fqn, f"an unbatched call of nn.{type(m).__name__} has no integer lowering",
              "give it a batched input (the graph's first axis is the batch)")
    states = (None, None) if patch.cell else _module_states(lw, patch, hx, lstm)
    if patch.inputs[0] is not None and patch.inputs[0].dynamic:
        return _lower_dynamic(lw, patch, m, fqn, x, states, seq_first)
    dirs = patch.dirs
    hidden = [_act(patch.hidden[i], f"{fqn}:hidden{patch.suffixes[i]}") for i in range(len(patch.suffixes))]
    cells = [_cell_target(patch.cells[i], f"{fqn}:cell{patch.suffixes[i]}") if lstm else None
             for i in range(len(patch.suffixes))]
    value: Any = x
    h_n: list[QVal] = []
    c_n: list[QVal] = []
    ys: list[QVal] = []
    for layer in range(patch.layers):
        role = "input" if layer == 0 else f"input_l{layer}"
        xq = _to(lw, value, _act(patch.inputs[layer], f"{fqn}:{role}"))
        ys = []
        for d in range(dirs):
            i = layer * dirs + d
            where = fqn + ("" if patch.cell else f".l{layer}{'_reverse' if d else ''}")
            if patch.cell:
                state = _initial_state(lw, patch, hx, lstm, hidden[i], cells[i])
            else:
                h0, c0 = (_state_slice(lw, v, i, where) for v in states)
                state = _initial_state(lw, patch, None if h0 is None else ((h0, c0) if lstm else h0), lstm,
                                       hidden[i], cells[i])
            y, h, c = _direction(lw, patch, i, xq, hidden[i], cells[i], state, bool(d), where)
            ys.append(y)
            h_n.append(h)
            if c is not None:
                c_n.append(c)
        if dirs == 1:
            value = ys[0]
        else:
            shape = ys[0].shape[:-1] + (sum(y.shape[-1] for y in ys),)
            value = concat_value(lw.b, f"{fqn}.l{layer}", ys, -1, shape)
    if patch.cell:
        h = h_n[0] if patch.out is None else _to(lw, h_n[0], _act(patch.out, f"{fqn}:output"))
        return (h, c_n[0]) if lstm else h
    out = value
    # out[:, -1]: a unidirectional module's is the last h_n; a bidirectional one's is the
    # forward h_n and the reverse direction's output at the last position (SELECT), joined
    # on the sequence's grid (the CONCAT the sequence itself is)
    last: Any = h_n[-1]
    if dirs == 2:
        last = lambda: _bidir_last(lw, fqn, h_n[-2], ys[1])  # noqa: E731
    if patch.out is not None:
        t = _act(patch.out, f"{fqn}:output")
        out = _to(lw, value, t)
        last = (lambda step=last, t=t: _to(lw, step() if callable(step) else step, t))
    if seq_first:
        out = SeqFirst(out)
    _register_last(lw, out, last, fqn, type(m).__name__, seq_first)
    hn = tuple(h_n)
    return (out, (hn, tuple(c_n))) if lstm else (out, hn)


def _bidir_last(lw, fqn: str, h_fwd: QVal, y_rev: QVal) -> Any:
    """``out[:, -1]`` of a bidirectional layer: ``cat(h_n forward, y_reverse[:, T - 1])``,
    joined as the output sequence's own halves are (concat_value)."""
    steps = y_rev.shape[1]
    if steps < 1:
        _fail(fqn, "out[:, -1] of a bidirectional layer needs a static sequence length")
    shape = (y_rev.shape[0], y_rev.shape[2])
    name = lw.b.op(OpType.SELECT, f"{fqn}.last", [y_rev.name], y_rev.dtype, shape, dict(axis=1, index=steps - 1))
    rev = lw.b.q(name, y_rev.scale, y_rev.zp, y_rev.qmin, y_rev.qmax, y_rev.dtype, shape)
    return concat_value(lw.b, f"{fqn}.last", [h_fwd, rev], -1, (shape[0], h_fwd.shape[-1] + shape[1]))


def _register_last(lw, out: Any, last: Any, fqn: str, kind: str, seq_first: bool = False) -> None:
    if getattr(lw, _LAST, None) is None:
        setattr(lw, _LAST, {})
    # by identity (a bidirectional sequence without an output quantizer is a pending CONCAT)
    getattr(lw, _LAST)[id(out)] = (out, last, fqn, kind, seq_first)


def _dyn_q(proxy, where: str, shape, prefix: str) -> dict:
    fqn = where.partition(":")[0]
    if proxy is None or not proxy.dynamic:
        _fail(fqn, f"'{where}' must be a dynamic quantizer in a dynamically quantized LSTM (torch.ao quantizes "
                   "the input and the hidden state of every step at run time)",
              f"set `{where.partition(':')[2].split('_l')[0]} = d8` (dynamic) for '{fqn}' in the spec")
    a = dynamic_attrs(proxy, where, shape)
    if a["per_row"]:
        _fail(fqn, f"'{where}' must be per tensor for LSTM_DYNAMIC", "use `granularity = tensor`")
    return {f"{prefix}_{k}": v for k, v in a.items() if k != "per_row"}


def _lower_dynamic(lw, patch, m: nn.Module, fqn: str, x: Any, states: tuple, seq_first: bool) -> Any:
    """LSTM_DYNAMIC / GRU_DYNAMIC per layer and direction (F32 in and out; qdsl/graph/ops/recurrent_dynamic.py)."""
    kind = type(m).__name__
    if patch.kind not in ("LSTM", "GRU") or patch.cell:
        _fail(fqn, f"a dynamically quantized nn.{kind} has no integer lowering (the graph has LSTM_DYNAMIC and "
                   "GRU_DYNAMIC for nn.LSTM and nn.GRU only)", "quantize it statically (calibrate; no `dynamic`)")
    lstm = patch.kind == "LSTM"
    if patch.out is not None or any(q is not None for q in patch.cells):
        _fail(fqn, "a dynamically quantized LSTM keeps its cell state and output float (as torch.ao's)",
              "remove the `cell`/`output` quantizers of this layer")
    if any(b is not None for b in patch.b_ih + patch.b_hh):
        _fail(fqn, "a dynamically quantized LSTM keeps its bias float (its scale would follow the run-time input "
                   "scale)", "set `bias = float` for this layer")
    hid, dirs = int(m.hidden_size), patch.dirs
    b = lw.b
    parts = [as_float(b, x, f"{fqn}:input")]
    h_n: list[FloatVal] = []
    c_n: list[FloatVal] = []
    for layer in range(patch.layers):
        shape = tuple(parts[0].shape[:-1]) + (sum(p.shape[-1] for p in parts),)
        role = "input" if layer == 0 else f"input_l{layer}"
        qin = _dyn_q(patch.inputs[layer], f"{fqn}:{role}", shape, "in")
        outs = []
        for d in range(dirs):
            i = layer * dirs + d
            where = f"{fqn}.l{layer}{'_reverse' if d else ''}"
            a = dict(reverse=int(d), **qin, **_dyn_q(patch.hidden[i], f"{fqn}:hidden{patch.suffixes[i]}", (-1, hid), "h"))
            consts = []
            for side in ("ih", "hh"):
                codes, scale = _weight(patch, i, side, where)
                a[f"w_{side}_scale"] = f32_bits(scale.numpy())
                bias = patch.master(f"bias_{side}{patch.suffixes[i]}")
                a[f"b_{side}"] = () if bias is None else f32_bits(bias.detach().float().numpy())
                consts.append(b.tensor(f"{where}.weight_{side}", DType.I8, codes.shape, codes))
                b.info[consts[-1]] = (scale.double().numpy(), np.zeros(len(scale), dtype=np.int64))
            y_shape = shape[:-1] + (hid,)
            names = [b.tensor(f"{where}:y", DType.F32, y_shape), b.tensor(f"{where}:h_n", DType.F32, (-1, hid))]
            if lstm:
                names.append(b.tensor(f"{where}:c_n", DType.F32, (-1, hid)))
            init = [_state_slice(lw, v, i, where) for v in states]
            init = [v.name for v in init if v is not None]
            b.ops.append(Op(OpType.LSTM_DYNAMIC if lstm else OpType.GRU_DYNAMIC, where, [parts[0].name] + consts + [p.name for p in parts[1:]] + init,
                            names, a))
            outs.append(FloatVal(where, y_shape, names[0]))
            h_n.append(FloatVal(where, (-1, hid), names[1]))
            if lstm:
                c_n.append(FloatVal(where, (-1, hid), names[2]))
        parts = outs
    # a bidirectional sequence is two F32 tensors: the graph has no float concat to join them
    out = parts[0] if dirs == 1 else FloatVal(fqn, parts[0].shape[:-1] + (dirs * hid,))
    if seq_first:
        out = SeqFirst(out)
    _register_last(lw, out, h_n[-1] if dirs == 1 else None, fqn, kind, seq_first)
    return (out, (tuple(h_n), tuple(c_n))) if lstm else (out, tuple(h_n))


def is_recurrent_sequence(lw, value: Any) -> bool:
    """``value`` is a recurrent module's output sequence (what :func:`last_step` reads)."""
    entry = (getattr(lw, _LAST, None) or {}).get(id(value))
    return entry is not None and entry[0] is value


def last_step(lw, value: Any, index: Any) -> QVal | None:
    """``value[:, -1]`` (or ``[:, -1, :]``) when ``value`` is a recurrent module's output
    sequence: a unidirectional module's last step (its last layer's ``h_n``); a bidirectional
    one's is refused (its reverse half is that direction's first step, not a state the op
    returns).  None for any other value or index."""
    entry = (getattr(lw, _LAST, None) or {}).get(id(value))
    if entry is None or entry[0] is not value:
        return None
    _, last, fqn, kind, seq_first = entry
    full = slice(None)
    index = index if isinstance(index, tuple) else (index,)
    if seq_first:  # out[-1], out[-1, :], out[-1, :, :] of a (T, N, H) sequence
        if not (1 <= len(index) <= 3 and index[0] == -1 and all(i == full for i in index[1:])):
            return None
    elif len(index) not in (2, 3) or index[1] != -1 or index[0] != full or (len(index) == 3 and index[2] != full):
        return None
    if last is None:
        _fail(fqn, f"the last step of a dynamically quantized bidirectional nn.{kind} has no integer lowering (the "
                   "graph has no float concat)", "read the final states instead: torch.cat([h_n[-2], h_n[-1]], 1)")
    return last() if callable(last) else last

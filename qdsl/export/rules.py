"""Export's lowering rules, one place per rule, dispatched by the catalog's ``lowering`` name.

A construct's row in ``qdsl/graph/catalog.py`` names its rule (``lowering``); the
lowerer (``lower.py``) looks the name up here by the construct's form and calls it:

* ``@module_rule(name)``: ``fn(lw, node, m, x, shape, fqn)`` for a module call;
* ``@function_rule(name)``: ``fn(lw, node, fn, args, kwargs, where)`` for a function call;
* ``@method_rule(name)``: ``fn(lw, node, name, args, where)`` for a tensor method.

``lw`` is the running lowerer (its builder ``lw.b``, ``lw.shape(node)``, ``lw.need_q``,
``lw.handle``...).  A rule raises :class:`NoLowering` when this call is outside what it
lowers, and the lowerer reports the construct as having no integer lowering.  A rule with
much code keeps it in its own module (``lower_layers.py``, ``lower_lut.py``) and is an
entry here.  ``tests/export/test_catalog.py`` checks these names against ``LOWERINGS``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from torch import nn

from qdsl.export.lower_attn import (SeqFirst, View, layernorm_pending, permute_value, product, scale_pending,
                                     softmax_pending)
from qdsl.export.lower_embedding import embedding_pending
from qdsl.export.lower_dynamic import DynIn, DynOut, linear_dynamic
from qdsl.export.lower_layers import add_pending, concat_value, layer_pending, pool_pending, raw
from qdsl.export.lower_lut import lut_pending
from qdsl.export.lower_mul import mul_pending
from qdsl.export.lower_recurrent import last_step, lower_recurrent
from qdsl.export.lower_resize import function_call, module_call, resize_value
from qdsl.export.values import ConstVal, ExportError, FloatVal, OffsetVal, Pending, QVal, Target
from qdsl.graph.ir import DType, OpType, Rounding
from qdsl.patch.attention import is_attention
from qdsl.patch.constructs import functions, methods, module_construct, resolve_path
from qdsl.patch.trace import quantizer_mark

__all__ = ["MODULE_RULES", "FUNCTION_RULES", "METHOD_RULES", "NoLowering", "module_rule", "function_rule",
           "method_rule"]

MODULE_RULES: dict[str, Callable[..., Any]] = {}
FUNCTION_RULES: dict[str, Callable[..., Any]] = {}
METHOD_RULES: dict[str, Callable[..., Any]] = {}


class NoLowering(Exception):
    """This call is not one the rule lowers (the lowerer reports it with its usual message)."""


def _registrar(table: dict[str, Callable[..., Any]]):
    def register(*names: str):
        def deco(fn):
            for name in names:
                table[name] = fn
            return fn
        return deco
    return register


module_rule = _registrar(MODULE_RULES)
function_rule = _registrar(FUNCTION_RULES)
method_rule = _registrar(METHOD_RULES)


def _is_value(a: Any) -> bool:
    return isinstance(a, (QVal, Pending, FloatVal))


# ---------------------------------------------------------------- layer, batch_norm, pass
@module_rule("layer")
def _layer(lw, node, m, x, shape, fqn):
    patch = lw.handle.layers.get(fqn)
    if isinstance(x, DynIn):  # a dynamic input: QUANTIZE_DYNAMIC + LINEAR_DYNAMIC, float output
        return linear_dynamic(lw.b, fqn, m, patch, x, shape)
    return layer_pending(lw.b, fqn, m, patch, lw.need_layer_input(x, fqn, patch), shape)


@module_rule("embedding")
def _embedding(lw, node, m, x, shape, fqn):
    return embedding_pending(lw.b, fqn, m, lw.handle.layers.get(fqn), x, shape)


@module_rule("recurrent")
def _recurrent(lw, node, m, x, shape, fqn):  # LSTM/GRU (cells too) -> one op per layer and direction
    return lower_recurrent(lw, node, m, fqn)


@module_rule("batch_norm")
def _batch_norm(lw, node, m, x, shape, fqn):
    if fqn in lw.folded_bns:
        return x
    raise ExportError(fqn, "a BatchNorm that is not folded into the layer before it has no integer lowering",
                      "set `fold_bn` in the spec (the BN must directly follow a Conv/Linear)")


@module_rule("pass")
def _pass(lw, node, m, x, shape, fqn):
    return x


# ---------------------------------------------------------------- relu, relu6, hardtanh -> CLAMP
def relu(lw, value: Any, lo: float, hi: float, where: str) -> Any:
    """Fused into a pending output stage, else a CLAMP in the value's codes."""
    if isinstance(value, Pending):
        return value.clamped(lo, hi)
    if isinstance(value, DynOut):  # fused into LINEAR_DYNAMIC (``relu``)
        return value.with_relu(lo, hi, where)
    v = lw.need_q(value, where, "ReLU/clamp")
    t = Target(v.scale, v.zp, v.qmin, v.qmax, v.dtype, Rounding.HALF_EVEN, where)
    out_min, out_max = t.clamp_codes(lo, hi)
    name = lw.b.op(OpType.CLAMP, where, [v.name], v.dtype, v.shape, {"out_min": out_min, "out_max": out_max})
    return lw.b.q(name, v.scale, v.zp, v.qmin, v.qmax, v.dtype, v.shape)


module_rule("relu")(lambda lw, node, m, x, shape, fqn: relu(lw, x, 0.0, math.inf, fqn))
function_rule("relu")(lambda lw, node, fn, args, kwargs, where: relu(lw, args[0], 0.0, math.inf, where))
method_rule("relu")(lambda lw, node, name, args, where: relu(lw, args[0], 0.0, math.inf, where))
module_rule("relu6")(lambda lw, node, m, x, shape, fqn: relu(lw, x, 0.0, 6.0, fqn))
function_rule("relu6")(lambda lw, node, fn, args, kwargs, where: relu(lw, args[0], 0.0, 6.0, where))
module_rule("hardtanh")(lambda lw, node, m, x, shape, fqn: relu(lw, x, float(m.min_val), float(m.max_val), fqn))


@function_rule("hardtanh")
def _hardtanh_fn(lw, node, fn, args, kwargs, where):
    lo = args[1] if len(args) > 1 else kwargs.get("min_val", -1.0)
    hi = args[2] if len(args) > 2 else kwargs.get("max_val", 1.0)
    return relu(lw, args[0], float(lo), float(hi), where)


# ---------------------------------------------------------------- reshape -> RESHAPE
def reshape(lw, value: Any, shape: tuple[int, ...], where: str) -> Any:
    if isinstance(value, View):
        raise ExportError(where, "a reshape of a transposed activation has no integer lowering (only a product "
                                 "reads a transpose, as its operand permutation)")
    if tuple(value.shape) == shape:
        return value
    a = {"shape": shape[1:]}
    if isinstance(value, Pending):
        return value.then(OpType.RESHAPE, a, shape)
    if isinstance(value, FloatVal) and value.name is not None:
        return FloatVal(value.origin, shape, value.name, shape[1:])
    v = lw.need_q(value, where, "a reshape")
    name = lw.b.op(OpType.RESHAPE, where, [v.name], v.dtype, shape, a)
    return lw.b.q(name, v.scale, v.zp, v.qmin, v.qmax, v.dtype, shape)


module_rule("reshape")(lambda lw, node, m, x, shape, fqn: reshape(lw, x, shape, fqn))
function_rule("reshape")(lambda lw, node, fn, args, kwargs, where: reshape(lw, args[0], lw.shape(node), where))
method_rule("reshape")(lambda lw, node, name, args, where: reshape(lw, args[0], lw.shape(node), where))


# ---------------------------------------------------------------- pool -> MAXPOOL*/AVGPOOL*/GLOBAL_AVGPOOL
def _maxpool(lw, value: Any, m: nn.Module, shape, where: str) -> Any:
    rank = 1 if isinstance(m, nn.MaxPool1d) else 2
    if m.ceil_mode or m.return_indices:
        raise ExportError(where, "max pool with ceil_mode or return_indices has no integer lowering")
    tup = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v,) * rank  # noqa: E731
    a = dict(kernel=tup(m.kernel_size), stride=tup(m.stride if m.stride is not None else m.kernel_size),
             padding=tup(m.padding), dilation=tup(m.dilation))
    op = OpType.MAXPOOL1D if rank == 1 else OpType.MAXPOOL2D
    if isinstance(value, Pending):  # max commutes with the (monotone) quantizer
        return value.then(op, a, shape)
    v = lw.need_q(value, where, "max pool")
    name = lw.b.op(op, where, [v.name], v.dtype, shape, a)
    return lw.b.q(name, v.scale, v.zp, v.qmin, v.qmax, v.dtype, shape)


@module_rule("pool")
def pool(lw, node, m: nn.Module, x: Any, shape, where: str) -> Any:
    if isinstance(m, (nn.MaxPool1d, nn.MaxPool2d)):
        return _maxpool(lw, x, m, shape, where)
    # an unquantized layer result is pooled from its int32 accumulator, the pool's
    # per-channel stage applying s_acc[c] / (area · s_out) with one rounding
    if isinstance(x, Pending):
        v, scales = raw(lw.b, x, where)
        return pool_pending(where, m, v, shape, scales)
    return pool_pending(where, m, lw.need_q(x, where, "average pool"), shape)


# functional pool -> (module class, positional options it shares with the constructor)
_FUNCTIONAL_POOLS = {fn: (resolve_path(c.like[0]), c.like[1])
                     for fn, c in functions(lambda c: c.lowering == "pool").items()}


@function_rule("pool")
def _pool_fn(lw, node, fn, args, kwargs, where):
    module_type, n_positional = _FUNCTIONAL_POOLS[fn]
    if len(args) - 1 > n_positional:
        raise ExportError(where, f"pass the options of {fn.__name__} by keyword ('{node.name}')")
    try:  # same parameter names (and leading order) as the module's constructor
        m = module_type(*args[1:], **kwargs)
    except TypeError as e:
        raise ExportError(where, f"{fn.__name__} options not understood: {e}") from None
    return pool(lw, node, m, args[0], lw.shape(node), where)


# ---------------------------------------------------------------- add -> ADD, concat -> CONCAT
def _layernorm_input(lw) -> Callable[[Any], bool]:
    """A LayerNorm's input quantizer: the pre-norm residual sum (x + attn(norm1(x))) it read
    is the one the next residual add reads too (lower_layers.add_pending)."""
    return lambda t: t.where.endswith(":input") and isinstance(lw.modules.get(t.where[:-len(":input")]), nn.LayerNorm)


def _add_constant(where: str, a: Any, c: ConstVal) -> Any:
    """``a + c`` for a constant ``c``: folded with a constant, else an :class:`OffsetVal` (the
    embeddings' ``word + token_type + position``, which only a LayerNorm reads)."""
    if isinstance(a, ConstVal):
        return ConstVal(where, a.value + c.value)
    if isinstance(a, OffsetVal):
        return OffsetVal(a.base, a.const + c.value, where)
    value = c.value
    if value.dim() == len(a.shape) and value.shape[0] > 1:  # expanded over the example's batch
        if not bool((value == value[:1]).all()):
            raise ExportError(where, "a constant added to an activation differs between batch rows")
        value = value[:1]
    if value.dim() != len(a.shape) or tuple(value.shape[1:]) != tuple(a.shape[1:]):
        raise ExportError(where, f"a constant of shape {tuple(value.shape)} added to an activation {a.shape} has no "
                                 "integer lowering (a (1, ...) constant of the same shape only)")
    if not (isinstance(a, QVal) and a.dtype in (DType.I8, DType.U8)):
        origin = getattr(a, "origin", "?")
        raise ExportError(where, f"a constant is added to an unquantized value from '{origin}'",
                          f"add `output = a8` (an activation quantizer) for '{origin}'")
    return OffsetVal(a, value, where)


def _add(lw, node, a, b, where):
    for x, c in ((a, b), (b, a)):
        if isinstance(c, ConstVal):
            return _add_constant(where, x, c)
    return add_pending(where, a, b, lw.shape(node), _layernorm_input(lw))


@function_rule("add")
def _add_fn(lw, node, fn, args, kwargs, where):
    consts = any(isinstance(a, ConstVal) for a in args)
    if len(args) != 2 or kwargs.get("alpha", 1) != 1 or not all(_is_value(a) or consts for a in args):
        raise ExportError(where, f"'{node.name}' is not a plain two-tensor add")
    return _add(lw, node, args[0], args[1], where)


@method_rule("add")
def _add_method(lw, node, name, args, where):
    if len(args) != 2:
        raise NoLowering
    return _add(lw, node, args[0], args[1], where)


@function_rule("concat")
def _concat_fn(lw, node, fn, args, kwargs, where):
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    return concat_value(lw.b, where, list(args[0]), dim, lw.shape(node))


# ---------------------------------------------------------------- mul -> MUL (lower_mul.py)
def _mul(lw, node, args, where):
    if len(args) != 2:
        raise NoLowering
    for v, c in ((args[0], args[1]), (args[1], args[0])):
        if isinstance(c, (int, float)) and (scaled := scale_pending(where, v, float(c))) is not None:
            return scaled  # attention's scores * (1/sqrt(d)): folded into the product's rescale
    if not any(_is_value(a) for a in args):
        return None  # shape arithmetic (x.size(1) * x.size(2)): not a tensor
    return mul_pending(where, args[0], args[1], lw.shape(node))


@function_rule("mul")
def _mul_fn(lw, node, fn, args, kwargs, where):
    if kwargs:  # torch.mul(a, b, out=...)
        raise NoLowering
    return _mul(lw, node, args, where)


method_rule("mul")(lambda lw, node, name, args, where: _mul(lw, node, args, where))


# ---------------------------------------------------------------- matmul, transposes -> MATMUL (lower_attn.py)
def _matmul(lw, node, args, where):
    if len(args) != 2 or not any(_is_value(a) or isinstance(a, View) for a in args):
        raise NoLowering
    if not all(_is_value(a) or isinstance(a, View) for a in args):
        raise ExportError(where, f"'{node.name}' multiplies an activation by a constant: no integer lowering",
                          "use an nn.Linear for a product with a weight")
    return product(where, args[0], args[1])


@function_rule("matmul")
def _matmul_fn(lw, node, fn, args, kwargs, where):
    if kwargs:  # torch.matmul(a, b, out=...)
        raise NoLowering
    return _matmul(lw, node, args, where)


method_rule("matmul")(lambda lw, node, name, args, where: _matmul(lw, node, args, where))


def _transpose(lw, node, value, d0, d1, where):
    rank = len(value.shape)
    perm = list(range(rank))
    d0, d1 = d0 % rank, d1 % rank
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return permute_value(where, value, perm)


@function_rule("transpose")
def _transpose_fn(lw, node, fn, args, kwargs, where):
    if len(args) != 3 or kwargs or not (_is_value(args[0]) or isinstance(args[0], (View, SeqFirst))):
        raise NoLowering
    return _transpose(lw, node, args[0], int(args[1]), int(args[2]), where)


@method_rule("transpose")
def _transpose_method(lw, node, name, args, where):
    if name == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        return permute_value(where, args[0], [int(d) % len(args[0].shape) for d in dims])
    if len(args) != 3:
        raise NoLowering
    return _transpose(lw, node, args[0], int(args[1]), int(args[2]), where)


@function_rule("div")
def _div_fn(lw, node, fn, args, kwargs, where):
    if len(args) != 2 or kwargs or not isinstance(args[1], (int, float)):
        raise NoLowering
    scaled = scale_pending(where, args[0], 1.0 / float(args[1]))
    if scaled is None:
        raise NoLowering
    return scaled


method_rule("pass")(lambda lw, node, name, args, where: args[0])


# ---------------------------------------------------------------- softmax -> SOFTMAX, layer_norm -> LAYERNORM
module_rule("softmax")(lambda lw, node, m, x, shape, fqn: softmax_pending(fqn, x, m.dim, shape))


@function_rule("softmax")
def _softmax_fn(lw, node, fn, args, kwargs, where):
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or kwargs.get("dtype") is not None:
        raise NoLowering
    return softmax_pending(where, args[0], int(dim), lw.shape(node))


@method_rule("softmax")
def _softmax_method(lw, node, name, args, where):
    if len(args) != 2:
        raise NoLowering
    return softmax_pending(where, args[0], int(args[1]), lw.shape(node))


_PASS_FUNCTIONS = functions(lambda c: c.lowering == "pass")
_PASS_METHODS = methods(lambda c: c.lowering == "pass")


def _read_unquantized(lw, node) -> bool:
    """Whether something other than a quantizer reads ``node``'s value (through Identity,
    Dropout and other pass-through calls): a residual add, the model output.  Quantizer
    markers and attention modules (which quantize their inputs themselves) do not."""
    todo, seen = list(node.users), set()
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op == "call_function" and u.target is quantizer_mark:
            continue
        if u.op == "call_module":
            m = lw.modules[u.target]
            if is_attention(m):
                continue
            c = module_construct(m)
            if c is not None and c.lowering == "pass":
                todo.extend(u.users)
                continue
        if (u.op == "call_function" and u.target in _PASS_FUNCTIONS) or (u.op == "call_method"
                                                                         and u.target in _PASS_METHODS):
            todo.extend(u.users)
            continue
        return True
    return False


@module_rule("layer_norm")
def _layer_norm(lw, node, m, x, shape, fqn):
    weight = None if m.weight is None else m.weight.detach().double().numpy()
    bias = None if m.bias is None else m.bias.detach().double().numpy()
    # a result read unquantized (a residual add, the model output) is kept wide: LAYERNORM's
    # I32 output, which 8-bit readers REQUANTIZE (post-norm BERT's residual stream)
    return layernorm_pending(fqn, x, m.normalized_shape, weight, bias, float(m.eps), shape,
                             wide_out=_read_unquantized(lw, node))


# ---------------------------------------------------------------- lut -> LUT, LUT_CHANNEL (lower_lut.py)
@module_rule("lut")
def _lut_module(lw, node, m, x, shape, fqn):
    # m.forward: m(...) would run qdsl's hooks; a PReLU with a slope per channel is a
    # per-channel function of its input (one table per channel)
    per_channel = isinstance(m, nn.PReLU) and m.num_parameters > 1
    return lut_pending(fqn, x, m.forward, type(m).__name__, shape, per_channel=per_channel)


@function_rule("lut")
def _lut_fn(lw, node, fn, args, kwargs, where):
    if any(_is_value(a) for a in list(args[1:]) + list(kwargs.values())):
        raise ExportError(where, f"'{node.name}' reads more than one tensor")
    rest = tuple(args[1:])
    return lut_pending(where, args[0], lambda t: fn(t, *rest, **kwargs), fn.__name__, lw.shape(node))


# ---------------------------------------------------------------- resize -> RESIZE (lower_resize.py)
module_rule("resize")(lambda lw, node, m, x, shape, fqn: resize_value(lw.b, fqn, x, module_call(m), shape))


@function_rule("resize")
def _resize_fn(lw, node, fn, args, kwargs, where):
    if any(_is_value(a) for a in list(args[1:]) + list(kwargs.values())):
        raise ExportError(where, f"'{node.name}' reads more than one tensor")
    return resize_value(lw.b, where, args[0], function_call(fn, args, kwargs), lw.shape(node))


# ---------------------------------------------------------------- shape, item: not tensors
@function_rule("shape")
def _shape_fn(lw, node, fn, args, kwargs, where):
    return None  # shape arithmetic (x.size(0), ...): not a tensor


@method_rule("shape")
def _shape_method(lw, node, name, args, where):
    return None


def _holds_value(a: Any) -> bool:
    return isinstance(a, tuple) and any(_is_value(v) or _holds_value(v) for v in a)


@function_rule("item")
def _item_fn(lw, node, fn, args, kwargs, where):
    if _holds_value(args[0]):  # a module's tuple result (attention; a recurrent layer's nested (h_n, c_n))
        return args[0][args[1]]
    if _is_value(args[0]) or isinstance(args[0], SeqFirst):  # indexing an activation is not shape arithmetic
        step = last_step(lw, args[0], args[1])  # out[:, -1] (out[-1] seq-first) of a recurrent layer
        if step is not None:
            return step
        raise NoLowering
    return None

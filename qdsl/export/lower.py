"""``qdsl.export(model, example_input)``: lower a frozen patched model to an IntegerGraph.

How: the model is traced with torch.fx by :class:`qdsl.patch.trace.MarkingTracer`, which
bypasses qdsl's hooks (hooks do not belong in a graph) and instead inserts an explicit
marker node wherever a patched module's input or output quantizer sits; the proxies are found by module path through
``qdsl.patch.get_handle(model)``. ShapeProp gives every node's shape. The nodes are then
walked in order, each mapped to a value (values.py); integer ops are emitted when a
quantizer fixes a pending result's scale.

Lowering rules (docs/qgraph.md has the op semantics; the code is in rules.py, one entry
per catalog `lowering` name, dispatched from here):

* a Conv1d/Conv2d/Linear with a weight quantizer and a quantized input becomes
  CONV*/LINEAR (BCONV*/BLINEAR when input and weight are binary) with its BN-folded
  integer weight (int8, packed int4/int2, ternary as int2, binary bit-packed), an int32
  bias at scale ``s_in · s_w`` (the bias quantizer's codes when its scale is exactly that,
  else the float bias rounded half-even at that scale), and the next quantizer's
  requantization: factor ``s_in · s_w[c] / s_out`` (exact shifts when every scale is a
  power of two, else gemmlowp multipliers), ReLU/ReLU6/Hardtanh fused into the clamp;
* a Linear whose input quantizer is ``dynamic`` becomes QUANTIZE_DYNAMIC + LINEAR_DYNAMIC
  with a float output (lower_dynamic.py);
* a residual ``+`` of quantized values and/or layer results becomes ADD at the scale of
  the next quantizer (normally the block's output quantizer);
* max pool and reshapes commute with quantization and are applied after it; average
  pools sum integers and fold the divisor into the requantization; ``torch.cat`` becomes
  CONCAT with per-input rescales; ``a * b`` of two quantized values becomes MUL
  (lower_mul.py); an ``nn.Embedding`` with a quantized table becomes EMBEDDING on an I32
  ids input (lower_embedding.py); folded BatchNorms, Identity and Dropout vanish.

Inputs and outputs (graph_io.py): the example input is a tensor, a tuple of positional or
a dict of keyword inputs (one graph input per tensor: F32, or I32 for integer token ids);
a tuple or dict result gives one graph output per element.

Anything else - an op with no integer lowering, a float layer between integer layers, a
value that must be quantized but has no quantizer - raises :class:`ExportError` naming
the module path and the spec change that fixes it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from qdsl.graph.ir import DType, OpType, OutputStage
from qdsl.export.graph_io import ExampleCall, bind_example, output_names
from qdsl.export.lower_dynamic import DynIn, DynOut, dynamic_input
from qdsl.export.lower_layers import act_target, wide
from qdsl.export.lower_threshold import binarize_codes
from qdsl.export.rules import FUNCTION_RULES, METHOD_RULES, MODULE_RULES, NoLowering
from qdsl.graph.requant import make_rescale
from qdsl.export.values import (Builder, ConstVal, ExportError, FloatVal, IdsVal, OffsetVal, Pending, QVal, Target,
                                wide_scale)
from qdsl.patch.example_trace import tensor_constant
from qdsl.patch.constructs import functions, methods, module_construct
from qdsl.export.lower_attn import SeqFirst, View
from qdsl.export.lower_mha import lower_attention
from qdsl.export.lower_mask import NOT_A_MASK, MaskedQ, MaskedScores, add_mask, mask_step, masked_softmax
from qdsl.export.lower_recurrent import is_recurrent_sequence
from qdsl.patch.softmax_roles import SOFTMAX_FUNCTIONS
from qdsl.patch.attention import is_attention
from qdsl.patch.implied import analyse_operands
from qdsl.patch.recurrent import is_recurrent
from qdsl.export.trace_errors import trace_failure
from qdsl.patch.trace import MarkingTracer, quantizer_mark, trace_graph, trace_model
from qdsl.spec.model import Role

__all__ = ["export", "trace_quantized"]


class _ShapeRecorder(torch.fx.Interpreter):
    """Runs the traced model once and stores each tensor node's shape in ``meta["qdsl_shape"]``.

    (fx's ShapeProp would do, but it imports sympy: seconds per export.)"""

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            n.meta["qdsl_shape"] = tuple(out.shape)
        return out

    def fetch_attr(self, target: str) -> Any:
        return self.module if target == "" else super().fetch_attr(target)  # the model is the layer


def _dropout_active(args, kwargs) -> bool:
    call = dict(zip(("input", "p", "training", "inplace"), args))
    call.update(kwargs)
    # only p = 0 (eager attention's dropout in eval): lint's catalogue still refuses
    # F.dropout with p > 0 (W321), and export agrees with it
    return float(call.get("p", 0.5)) > 0.0


def trace_quantized(model: nn.Module, handle, concrete: dict[str, Any] | None = None,
                    examples: dict[str, Any] | None = None) -> torch.fx.Graph:
    """The model's fx graph with explicit quantizer markers (see module doc); its module
    targets are paths in ``model`` (``""`` when the model itself is the one layer).
    ``concrete``: forward parameters specialized to a non-tensor value (fx concrete_args)."""
    tracer = MarkingTracer(handle)
    if is_single_layer(model, handle):
        # fx traces the root's forward and never treats the root as a call, so a model that
        # is one quantized layer (a bare nn.Linear) would read its weight as a tensor
        # attribute: build the one-call graph input -> layer -> output instead (the root's
        # input and output quantizers apply at the placeholder and the output, as always)
        graph = torch.fx.Graph()
        call = graph.call_module("", (graph.placeholder("x"),))
        call.meta["qdsl_scope"] = ""
        graph.output(call)
        return graph
    try:
        return trace_graph(tracer, model, concrete, examples)
    except Exception as exc:  # fx raises many types for untraceable code
        where, stmt = trace_failure(model, exc)
        at = f" ({stmt})" if stmt else ""
        raise ExportError(where, f"torch.fx cannot trace {type(model).__name__}: {type(exc).__name__}: {exc}{at}",
                          "export needs a model without data-dependent control flow or tensor-valued "
                          "indices/shapes used as Python values (fx traces with proxies)") from None


def _qualified(m: nn.Module) -> str:
    cls = type(m)
    return f"nn.{cls.__name__}" if cls.__module__.startswith("torch.nn") else cls.__name__


def is_single_layer(model: nn.Module, handle) -> bool:
    """The model is one quantized layer (traced as one call, see trace_quantized)."""
    return MarkingTracer(handle).is_leaf_module(model, "")


# lowerings that act on the last axis or elementwise: they commute with swapping a rank-3
# value's first two dims, so inside a seq-first (batch_first=False) block they run on the
# batch-first value (_Lowerer.batch_first)
_SWAP_SAFE = frozenset({"layer", "pass", "relu", "relu6", "hardtanh", "lut", "add", "mul", "layer_norm"})

# fx inserts this check after a parameter specialized by concrete_args; it is no graph op
_ASSERT_IS_NONE = getattr(getattr(torch.fx, "_symbolic_trace", None), "_assert_is_none", None)


# what each module class / function / method lowers to: the shared construct table
# (qdsl/graph/catalog.py); the rules themselves are in rules.py, keyed by its `lowering`
_FUNCTION_RULES = functions(lambda c: c.lowering is not None)
_METHOD_RULES = methods(lambda c: c.lowering is not None)


class _Lowerer:
    def __init__(self, model: nn.Module, handle, graph: torch.fx.Graph, single_rounding: bool, call: ExampleCall):
        self.model, self.handle, self.graph, self.call = model, handle, graph, call
        self.modules = dict(model.named_modules())
        self.folded_bns = {p.bn_fqn for p in handle.layers.values() if p.bn_fqn}
        self.b = Builder(single_rounding)
        self.env: dict[torch.fx.Node, Any] = {}
        self.input_names: list[str] = []
        self.input_shapes: dict[str, tuple[int, ...]] = {}
        self.input_dtypes: dict[str, torch.dtype] = {}
        self.input_examples: dict[str, torch.Tensor] = {}  # integer inputs (a mask's probes: lower_mask.py)
        """The example's dtype per graph input (a bool one is a mask)."""
        self._placeholders = 0

    # ---------------------------------------------------------------- helpers
    def shape(self, node: torch.fx.Node) -> tuple[int, ...]:
        shape = node.meta.get("qdsl_shape")
        if shape is None:
            raise ExportError(node.meta.get("qdsl_scope", ""), f"node {node.name} does not produce one tensor")
        return (-1,) + tuple(int(d) for d in shape[1:])

    def where(self, node: torch.fx.Node) -> str:
        return node.meta.get("qdsl_scope", "")

    def quantize(self, value: Any, fqn: str, role: str) -> QVal | DynIn | SeqFirst:
        if isinstance(value, SeqFirst):  # elementwise: quantize the batch-first value
            return SeqFirst(self.quantize(value.value, fqn, role))
        proxy = self.handle.quantizer(fqn, role)
        if proxy.dynamic:  # a Linear's run-time quantized input (lower_dynamic.py)
            return dynamic_input(self, value, fqn, role, proxy, self.modules.get(fqn))
        if proxy.scale.numel() > 1:  # a per-channel input/output: say which spec line asked for it
            raise ExportError(f"{fqn or '<model>'}:{role}",
                              "per-channel activation scales have no integer lowering"
                              + _granularity_source(self.handle, fqn, role),
                              "use `granularity = tensor` for activations (per-channel ones are a fake-quant option)")
        t = act_target(proxy, f"{fqn or '<model>'}:{role}", float8=self.b.onnx_float8)
        if isinstance(value, ConstVal):  # a constant stays one: its fake-quant value
            with torch.no_grad():
                return ConstVal(value.origin, proxy(value.value))
        if isinstance(value, OffsetVal):
            raise ExportError(fqn, f"the {role} quantizer reads an activation plus a constant ('{value.origin}': "
                                   "position/token-type embeddings at the exported length), which has no integer op",
                              "leave this input unquantized: a LayerNorm reads the sum at a wide grid itself")
        if isinstance(value, DynOut):  # a dynamic Linear's F32 result, quantized statically
            value = value.materialize()
        if isinstance(value, Pending):
            return value.materialize(self.b, t)
        if isinstance(value, QVal):
            return self.requantize(value, t)
        if isinstance(value, FloatVal) and value.name is not None:
            # the graph input before any reshape the model applied to it, or a float result
            shape = self.input_shapes[value.name] if value.reshape is not None else value.shape
            if t.dtype is DType.BIN and t.thresholds is not None:
                raise ExportError(t.where, "a binary quantizer with a learned threshold reads the float graph input "
                                           "(no integer op compares floats per channel)",
                                  "quantize the model input to 8 bits first (an 8-bit first layer, as xnor-binary's)")
            if t.dtype is DType.BIN:
                name = self.b.op(OpType.BINARIZE, t.where, [value.name], DType.BIN, shape, {"zero_point": 0})
            else:
                name = self.b.op(OpType.QUANTIZE, t.where, [value.name], t.dtype, shape,
                                 dict(scale=t.scale, zero_point=t.zp, qmin=t.qmin, qmax=t.qmax, rounding=int(t.rounding)))
            if value.reshape is not None:
                name = self.b.op(OpType.RESHAPE, t.where, [name], t.dtype, (-1,) + value.reshape, {"shape": value.reshape})
                shape = (-1,) + value.reshape
            return self.b.q(name, t.scale, t.zp, t.qmin, t.qmax, t.dtype, shape)
        raise ExportError(fqn, f"the {role} quantizer reads a float value produced by '{value.origin}'",
                          f"'{value.origin}' is left in float between integer layers: quantize it in the spec "
                          "(or skip everything after it too)")

    def requantize(self, v: QVal, t: Target) -> QVal:
        if v.matches(t):
            return v
        if t.dtype is DType.BIN and t.thresholds is not None:
            return binarize_codes(self.b, v, t)
        if t.dtype is DType.BIN:
            if v.dtype is DType.BIN:
                return self.b.q(v.name, t.scale, 0, -1, 1, DType.BIN, v.shape)
            name = self.b.op(OpType.BINARIZE, t.where, [v.name], DType.BIN, v.shape, {"zero_point": v.zp})
            return self.b.q(name, t.scale, 0, -1, 1, DType.BIN, v.shape)
        if v.dtype is DType.BIN:
            raise ExportError(t.where, "an integer quantizer reads a binary activation", "keep both binary or both int")
        stage = OutputStage(make_rescale(v.scale / t.scale, t.rounding, single=self.b.single_rounding), t.zp, t.qmin, t.qmax)
        name = self.b.op(OpType.REQUANTIZE, t.where, [v.name], t.dtype, v.shape, {"in_zp": v.zp, **stage.attrs()})
        return self.b.q(name, t.scale, t.zp, t.qmin, t.qmax, t.dtype, v.shape)

    def need_q(self, value: Any, where: str, what: str) -> QVal:
        if isinstance(value, QVal):
            return value
        origin = getattr(value, "origin", "?")
        raise ExportError(where, f"{what} reads an unquantized value from '{origin}'",
                          f"quantize it: add `output = a8` (any activation quantizer) for '{origin}' in the spec, "
                          f"or `input = a8` for '{where}'")

    def batch_first(self, node, lowering: str | None, args, kwargs, linear: bool = True) -> tuple[tuple, dict, bool]:
        """``(args, kwargs, swapped)``: a rule reading values transposed for a seq-first
        (``batch_first=False``) attention (:class:`SeqFirst`) runs on the batch-first values when
        it acts on the last axis or elementwise (it commutes with the swap; its result is
        swapped back), else the value is refused naming the op."""
        values = list(args) + list(kwargs.values())
        if not any(isinstance(a, SeqFirst) for a in values):
            return tuple(args), dict(kwargs), False
        if lowering not in _SWAP_SAFE or (lowering == "layer" and not linear) \
                or any(isinstance(a, (QVal, Pending, FloatVal, View)) for a in values):
            raise ExportError(self.where(node), f"'{node.name}' reads a value transposed for a batch_first=False "
                                                "attention (its first two dims swapped), which its integer lowering "
                                                "cannot", "transpose it back (transpose(0, 1)) before this op")
        shape = node.meta.get("qdsl_shape")
        if shape is not None and len(shape) == 3:  # the rule sees the batch-first value's shape
            node.meta["qdsl_shape"] = (shape[1], shape[0], shape[2])

        def plain(a):
            return a.value if isinstance(a, SeqFirst) else a
        return tuple(plain(a) for a in args), {k: plain(v) for k, v in kwargs.items()}, True

    # ---------------------------------------------------------------- dispatch (rules.py)
    def call_module(self, node, m: nn.Module, args, kwargs=None) -> Any:
        fqn, x = node.target, args[0] if args else None
        if is_attention(m):  # returns (output, weights): the tuple an `[0]` reads
            return lower_attention(self, node, m, args, kwargs or {})
        tensors = [a for a in args if not isinstance(a, (int, float, bool, str, type(None)))]
        if tensors and all(isinstance(a, ConstVal) for a in tensors) and not kwargs:
            # a module reading only constants (the position/token-type lookup at the exported
            # length): fold it, its weight fake-quantized as in the model (m.forward: no hooks;
            # its quantizer markers apply around this call)
            with torch.no_grad():
                out = m.forward(*[a.value if isinstance(a, ConstVal) else a for a in args])
            return ConstVal(fqn, out)
        construct = module_construct(m)
        rule = MODULE_RULES.get(construct.lowering) if construct is not None and construct.lowering else None
        if rule is not None:
            swapped = False
            if not is_recurrent(m):  # a batch_first=False recurrent layer reads a SeqFirst itself
                args, _, swapped = self.batch_first(node, construct.lowering, args, {}, isinstance(m, nn.Linear))
            x = args[0] if args else None
            try:
                # a recurrent layer returns a tuple: no one shape (its rule reads the call itself)
                out = rule(self, node, m, x, None if is_recurrent(m) else self.shape(node), fqn)
                return SeqFirst(out) if swapped else out
            except NoLowering:
                pass
        raise ExportError(fqn, f"{type(m).__name__} has no integer lowering",
                          "skip the layers from here on in the spec and run them in float after the graph")

    def need_layer_input(self, x: Any, fqn: str, patch) -> QVal:
        if patch is None or patch.wq is None:
            raise ExportError(fqn, "this layer is left in float (no weight quantizer), so it cannot be part of "
                                   "the integer graph", "quantize it in the spec, or export only the part before it")
        if isinstance(x, QVal):
            return x
        origin = getattr(x, "origin", "?")
        raise ExportError(fqn, f"its input (from '{origin}') is not quantized",
                          f"add `input = a8` (an activation quantizer) for '{fqn}' in the spec")

    def call_function(self, node, fn, args, kwargs) -> Any:
        where = self.where(node)
        if fn is quantizer_mark:
            if isinstance(args[0], MaskedScores):  # the scores quantizer reads the scores alone
                return MaskedQ(args[0].origin, self.quantize(args[0].scores, args[1], args[2]), args[0].mask)
            return self.quantize(args[0], args[1], args[2])
        if fn is F.dropout and not _dropout_active(args, kwargs):
            return args[0]  # eager attention's dropout on the probabilities in eval (p = 0): the identity
        masked = self._mask_call("function", fn, args, kwargs, where, node)
        if masked is not NOT_A_MASK:
            return masked
        if fn is _ASSERT_IS_NONE and fn is not None:
            return None
        if fn is tensor_constant:  # computed from buffers at the example's sizes (example_trace.py)
            return ConstVal(where or "<model>", args[0].value)
        construct = _FUNCTION_RULES.get(fn)
        rule = FUNCTION_RULES.get(construct.lowering) if construct is not None else None
        if rule is not None:
            # out[-1] of a batch_first=False recurrent layer's sequence: its rule reads the SeqFirst
            seq_step = construct.lowering == "item" and args and is_recurrent_sequence(self, args[0])
            if construct.lowering != "transpose" and not seq_step:
                args, kwargs, swapped = self.batch_first(node, construct.lowering, args, kwargs,
                                                         fn is torch.nn.functional.linear)
            else:
                swapped = False
            try:
                out = rule(self, node, fn, args, kwargs, where)
                return SeqFirst(out) if swapped else out
            except NoLowering:
                pass
        raise ExportError(where, f"the function {getattr(fn, '__name__', fn)!s} ('{node.name}') has no integer lowering",
                          "use a module the exporter knows (see docs/qgraph.md) or skip this part in the spec")

    def call_method(self, node, name: str, args) -> Any:
        where = self.where(node)
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self.env[n])
        masked = self._mask_call("method", name, args, kwargs, where, node)
        if masked is not NOT_A_MASK:
            return masked
        construct = _METHOD_RULES.get(name)
        rule = METHOD_RULES.get(construct.lowering) if construct is not None else None
        if rule is not None:
            swapped = False
            if construct.lowering != "transpose":
                args, _, swapped = self.batch_first(node, construct.lowering, args, {})
            try:
                out = rule(self, node, name, args, where)
                return SeqFirst(out) if swapped else out
            except NoLowering:
                pass
        raise ExportError(where, f"the method .{name}() ('{node.name}') has no integer lowering")

    def _mask_call(self, kind: str, target: Any, args, kwargs, where: str, node) -> Any:
        """A step of an attention mask computed from an integer input, the scores plus such
        a mask, or the softmax of those scores (qdsl/export/lower_mask.py)."""
        if (kind, target) in (("function", operator.add), ("function", torch.add), ("method", "add")):
            ms = add_mask(where, args[0], args[1])
            if ms is not None:
                return ms
        if args and isinstance(args[0], MaskedQ) and (target in SOFTMAX_FUNCTIONS or target == "softmax"):
            call = dict(zip(("input", "dim"), args))
            call.update(kwargs)
            return masked_softmax(where, args[0], int(call.get("dim", -1)), self.shape(node))
        if args and isinstance(args[0], MaskedScores) and (target in SOFTMAX_FUNCTIONS or target == "softmax"):
            raise ExportError(where, "the softmax reads masked attention scores that no quantizer quantized "
                                     "(no module returns them)",
                              f"give '{where or '<model>'}' the scores and probs roles: "
                              f"rule {where or '<model>'} {{ scores = a8  probs = a8 }}")
        if args and isinstance(args[0], (MaskedScores, MaskedQ)):
            raise ExportError(where, f"the masked attention scores are read by {getattr(target, '__name__', target)} "
                                     f"('{node.name}'), which has no integer lowering: only the softmax may read them")
        return mask_step(self, kind, target, args, kwargs, where)

    # ---------------------------------------------------------------- walk
    def run(self, graph_name: str) -> Any:
        outputs: list[str] = []
        out_node = next(n for n in self.graph.nodes if n.op == "output")
        names = [n for n, _ in output_names(out_node.args[0])]
        clash = sorted(set(names) & set(self.call.tensor_params)) if len(self.call.tensor_params) > 1 else []
        if clash:
            raise ExportError("", f"the model returns output(s) named {', '.join(map(repr, clash))}, "
                                  "which are also its input names", "rename the dict keys")
        self.b.reserved.update(names)
        for node in self.graph.nodes:
            args = torch.fx.node.map_arg(node.args, lambda n: self.env[n])
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self.env[n])
            if node.op == "placeholder":
                self.env[node] = self.placeholder(node)
            elif node.op == "get_attr":
                if node.users and all(u.op == "call_module" and is_attention(self.modules[u.target])
                                      for u in node.users):
                    self.env[node] = node.target  # a constant mask: lower_attention names the masked call
                    continue
                owner = self.modules.get(str(node.target).rpartition(".")[0])
                hint = ("only modules and functional ops on activations can be exported" if owner is None
                        else f"qdsl quantizes '{node.target}' only inside a call of {type(owner).__name__} "
                             f"'{str(node.target).rpartition('.')[0]}': call the {_qualified(owner)} module "
                             "instead of reading its parameter")
                raise ExportError(self.where(node), f"the forward reads the tensor attribute '{node.target}' directly",
                                  hint)
            elif node.op == "call_module":
                self.env[node] = self.call_module(node, self.modules[node.target], args, kwargs)
            elif node.op == "call_function":
                self.env[node] = self.call_function(node, node.target, args, kwargs)
            elif node.op == "call_method":
                self.env[node] = self.call_method(node, node.target, args)
            elif node.op == "output":
                for name, value in output_names(args[0]):
                    if self.handle.quantizer("", "output") is not None:
                        value = self.quantize(value, "", "output")
                    outputs.append(self.dequantize(value, name))
        return self.b.graph(self.input_names, outputs, graph_name).validate()

    def placeholder(self, node: torch.fx.Node) -> Any:
        """A forward parameter: a graph input (a tensor in the example), or the value the
        trace specialized it to (graph_io.py)."""
        i = self._placeholders
        self._placeholders += 1
        if i >= len(self.call.params):  # fx's placeholder for an unused **kwargs (nothing was passed to it)
            return None
        param, example = self.call.params[i], self.call.values[i]
        if not isinstance(example, torch.Tensor):
            return example
        base = "input" if len(self.call.tensor_params) == 1 else param
        shape = self.shape(node)
        if not example.is_floating_point():  # token ids or a bool mask: an I32 input (EMBEDDING, SOFTMAX_MASKED)
            name = self.b.tensor(base, DType.I32, shape)
            self.input_names.append(name)
            self.input_dtypes[name] = example.dtype
            self.input_examples[name] = example
            return IdsVal(f"<input {param}>" if base != "input" else "<input>", shape, name)
        name = self.b.tensor(base, DType.F32, shape)
        self.input_names.append(name)
        self.input_shapes[name] = shape
        value: Any = FloatVal(f"<input {param}>" if base != "input" else "<input>", shape, name)
        if i == 0 and self.handle.quantizer("", "input") is not None:  # the root's hook reads args[0]
            value = self.quantize(value, "", "input")
        return value

    def dequantize(self, value: Any, out: str) -> str:
        if isinstance(value, DynOut):  # already F32 (LINEAR_DYNAMIC)
            return value.materialize().name
        if isinstance(value, Pending) and value.kind == "acc" and not value.post:
            # a float model output from a layer (no output quantizer): convert the int32
            # accumulator kept wide (exact for power-of-two scales)
            w = wide(self.b, value, value.origin)
            return self.b.op(OpType.DEQUANTIZE, "<output>", [w.name], DType.F32, value.shape,
                             {"scale": w.scale, "zero_point": 0}, out=out, exact=True)
        if wide_scale(value) is not None:  # a LayerNorm's wide output: its I32 accumulator
            w = value.wide(self.b)
            return self.b.op(OpType.DEQUANTIZE, "<output>", [w.name], DType.F32, value.shape,
                             {"scale": w.scale, "zero_point": 0}, out=out, exact=True)
        if not isinstance(value, QVal):
            origin = getattr(value, "origin", "?")
            raise ExportError(origin, "the model output is not quantized, so the integer graph cannot produce it",
                              f"add `output = a8` (an activation quantizer) for '{origin}' in the spec")
        return self.b.op(OpType.DEQUANTIZE, "<output>", [value.name], DType.F32, value.shape,
                         {"scale": value.scale, "zero_point": value.zp}, out=out, exact=True)


def _refuse_unplaced(model: nn.Module, handle, concrete: dict[str, Any] | None = None,
                     examples: dict[str, Any] | None = None) -> None:
    """Refuse, before lowering, a model where an integer op reads a value no module returns to
    carry its quantizer (``y * torch.sigmoid(y)``): the walk that places implied quantizers
    decides it (:mod:`qdsl.patch.unplaced`), on the eval-mode trace export lowers (a training-only
    branch, stochastic depth's ``x * noise``, is not exported); lint reports the same records as W321."""
    unplaced = analyse_operands(model, trace_model(model, concrete, examples), handle.plan).unplaced
    if unplaced:
        raise ExportError(unplaced[0].where, unplaced[0].message, unplaced[0].hint)


REQUANT_MODES = ("gemmlowp", "single")


def export(model: nn.Module, example_input: Any, *, name: str | None = None, requant: str = "single",
           with_info: bool = False, onnx_float8: bool = False):
    """Lower the frozen patched ``model`` (see module doc) and mark it EXPORTED.

    ``requant`` picks the form of non-power-of-two requantization: ``"single"`` (the
    default; FIXED_SINGLE: the same int32 multiplier and shift, one exact rounding of
    ``x·m / 2^(31+s)`` with the quantizer's own rounding mode - TFLite's single-rounding
    form - which agrees with the fake-quant model on > 99.7% of codes) or ``"gemmlowp"``
    (FIXED: SRDHM then RDBP, two roundings half away, for targets that implement exactly
    that; 14-21% of output codes are then 1 LSB off on a 10-layer CNN, and codes inside it up
    to 3 LSB, because the two roundings flip a code in a few hundred per layer and that
    compounds; see docs/qgraph.md §4.1 and §6). ``with_info`` also
    returns ``{tensor name: (scale, zero point)}``, the real-value grid of every integer
    tensor (the ONNX exporter builds its QDQ graph from it). ``onnx_float8`` (the ONNX
    exporter's, with ``with_info``) keeps FP8 weights as float8 bit patterns with a
    ``Float8Grid`` and lowers FP8 activations onto placeholder int8 codes whose grid scale is
    an ``F8Scale`` (qdsl/export/float8.py): the graph is then for the ONNX writer only.
    """
    if requant not in REQUANT_MODES:
        raise ExportError("", f"unknown requant mode {requant!r}", f"choose one of {', '.join(REQUANT_MODES)}")
    from qdsl.patch.handle import State, get_handle

    handle = get_handle(model)
    if handle.state not in (State.FROZEN, State.EXPORTED):
        raise ExportError("", f"the model is {handle.state.value}, not frozen",
                          "calibrate it (qdsl.calibrate) and call qdsl.freeze(model) before exporting")
    call = bind_example(model, example_input, is_single_layer(model, handle))
    # the trace only records shapes: run it in the model's own dtype (a float32 example
    # for a bfloat16 model, or the reverse); the integer graph itself has no float dtype
    dt = next((p.dtype for n, p in model.named_parameters() if not n.startswith("_qdsl.") and p.is_floating_point()),
              None)
    values = [v.to(dt) if dt is not None and isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dt
              else v for v in call.values]
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        examples = dict(zip(call.params, values))
        _refuse_unplaced(model, handle, call.concrete, examples)
        graph_fx = trace_quantized(model, handle, call.concrete, examples)
        with torch.no_grad():  # the graph's targets are the model's own submodules (as a GraphModule's would be)
            _ShapeRecorder(model, graph=graph_fx).run(*values)
        lowerer = _Lowerer(model, handle, graph_fx, requant == "single", call)
        lowerer.b.onnx_float8 = onnx_float8
        graph = lowerer.run(name or type(model).__name__)
    finally:
        for m, mode in modes.items():
            m.training = mode
    handle.state = State.EXPORTED
    if with_info:
        return graph, lowerer.b.info
    return graph


def _granularity_source(handle, fqn: str, role: str) -> str:
    """``"; granularity channel(1) set by defaults (m.qspec:5:3)"``, or "" when the plan
    does not say (an implied quantizer)."""
    try:
        prov = handle.plan.layer(fqn).provenance.get((Role(role), "granularity"))
    except (KeyError, ValueError):
        return ""
    if prov is None:
        return ""
    text = f"; granularity {prov.value} set by {prov.set_by}"
    if prov.via:
        text += " via " + " > ".join(str(v) for v in prov.via)
    return text

"""The one table of torch constructs: which op each is, and how export lowers it.

Every torch module class, function and tensor method that qdsl gives a meaning to is one
:class:`Construct` row in :data:`CONSTRUCTS`.  Readers, and what they take from a row:

* export (``qdsl/export/lower.py``) dispatches on ``lowering`` (a rule name of
  :data:`LOWERINGS`, which names the ``OpType`` s each rule may emit); a construct without
  one has no integer lowering;
* lint (``qdsl/lint/ops.py``) maps a traced module/function/method to the profile op
  ``op``, by name (it also runs on a torch-free ``ModelIndex``); ``op = None`` computes
  nothing on the target (``Identity``, shape queries);
* apply's checks (``qdsl/patch/consumers.py``, ``qdsl/patch/coverage.py``) read
  ``passes`` (a layer's result passes through unchanged on its way to its readers) and
  ``product`` (multiplies by a weight or another activation: stays float when called as a
  function).

:data:`OPS` is the profile op vocabulary (lint); :data:`LINT_ONLY_OPS` the ops that lint
checks against a profile but export has no lowering for.  :data:`BOUNDARY_OPS` are the
graph ops emitted at quantizer boundaries rather than for a torch construct.

Torch-free and import-free (it sits below every package that reads it): paths and graph
ops are names; ``qdsl.patch.constructs`` resolves the paths to objects, and
``tests/export/test_catalog.py`` checks the names against ``OpType``.
"""

from __future__ import annotations

from typing import Iterable

import attrs

__all__ = [
    "Construct",
    "CONSTRUCTS",
    "LOWERINGS",
    "BOUNDARY_OPS",
    "OPS",
    "WEIGHTED_OPS",
    "BINARY_FORMS",
    "LINT_ONLY_OPS",
    "constructs",
    "short_name",
]

# lowering rule -> the graph ops it may emit (lower.py / lower_layers.py hold the rules)
LOWERINGS: dict[str, tuple[str, ...]] = {
    "layer": ("CONV1D", "CONV2D", "LINEAR", "BCONV1D", "BCONV2D", "BLINEAR", "CONV_TRANSPOSE1D", "CONV_TRANSPOSE2D",
              "LINEAR_DYNAMIC"),  # LINEAR_DYNAMIC: a Linear whose input quantizer is dynamic (lower_dynamic.py)
    "batch_norm": (),  # folded into the layer before it (`fold_bn`), else an error
    "pass": (),  # Identity / Dropout in eval: the value itself
    "relu": ("CLAMP",),  # fused into a pending output stage, else CLAMP
    "relu6": ("CLAMP",),
    "hardtanh": ("CLAMP",),
    "reshape": ("RESHAPE",),
    "pool": ("MAXPOOL1D", "MAXPOOL2D", "AVGPOOL1D", "AVGPOOL2D", "GLOBAL_AVGPOOL"),
    "add": ("ADD",),
    "concat": ("CONCAT",),
    "mul": ("MUL",),  # two activations (lower_mul.py); a constant factor has no lowering
    "lut": ("LUT", "LUT_CHANNEL"),  # an elementwise function of an 8-bit input: 256-entry tables (lower_lut.py)
    "resize": ("RESIZE",),  # nearest / (bi)linear upsampling (lower_resize.py)
    "matmul": ("MATMUL",),  # two activations, transposes folded in (lower_attn.py)
    "transpose": (),  # a view only a product reads (its operand or output permutation)
    "div": ("MATMUL",),  # a product's result divided by a constant: folded into its rescale
    # last axis of an 8-bit input: exact exp table (lower_attn.py); SOFTMAX_MASKED when a
    # key/attention mask (a graph input or constant) removes positions (masked attention)
    "softmax": ("SOFTMAX", "SOFTMAX_MASKED"),
    "layer_norm": ("LAYERNORM",),  # last axis of an 8-bit input, integer only (lower_attn.py)
    "embedding": ("EMBEDDING",),  # a lookup of I32 token ids in the quantized table (lower_embedding.py)
    "recurrent": ("LSTM", "GRU", "RNN", "LSTM_DYNAMIC", "GRU_DYNAMIC", "SELECT", "CONCAT", "REQUANTIZE", "QUANTIZE", "DEQUANTIZE"),  # one op per
    # layer and direction (lower_recurrent.py); LSTM_DYNAMIC: an nn.LSTM with dynamic input and hidden quantizers
    "shape": (),  # x.size(0), getattr: shape arithmetic, not a tensor
    "item": (),  # operator.getitem on something that is not an activation (a size tuple)
}
"""Export's lowering rules and the graph ops (``OpType`` names) each may emit."""

BOUNDARY_OPS = ("QUANTIZE", "DEQUANTIZE", "REQUANTIZE", "BINARIZE", "BINARIZE_CHANNEL", "QUANTIZE_DYNAMIC")
"""Emitted where a quantizer sits (and at the graph's float input/output), for no construct
(QUANTIZE_DYNAMIC: a dynamic input quantizer, before its LINEAR_DYNAMIC; BINARIZE_CHANNEL:
a binary input quantizer with learned per-channel thresholds reading 8-bit codes)."""

WEIGHTED_OPS = ("conv1d", "conv2d", "linear", "conv_transpose1d", "conv_transpose2d")
"""Ops with a weight (and optional bias): the ones with an integer accumulator."""

BINARY_FORMS: dict[str, str] = {
    "conv1d": "BCONV1D", "conv2d": "BCONV2D", "linear": "BLINEAR",
    # no XNOR-popcount form: the op itself reads the BIN input, ±1 weights as I8
    "conv_transpose1d": "CONV_TRANSPOSE1D", "conv_transpose2d": "CONV_TRANSPOSE2D",
}
"""The graph op (an ``OpType`` name) a weighted op becomes with binary weights and/or binary
inputs; lint reports a binary layer whose op is missing here (W321)."""

OPS = WEIGHTED_OPS + (
    "add", "mul", "concat", "relu", "relu6", "clamp", "leaky_relu", "sigmoid", "tanh", "softmax", "hardswish",
    "hardsigmoid", "gelu", "silu", "max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d", "global_avg_pool", "mean",
    "reshape", "batch_norm", "prelu", "upsample", "matmul", "layer_norm", "embedding", "lstm", "gru", "rnn",
)
"""Every op name a profile may list (in ``ops``, ``op.<name>``, ``fusions``, ``fixed_output``)."""


@attrs.frozen
class Construct:
    """One torch construct (see the module doc)."""

    kind: str
    """``module`` (an ``nn.Module`` class), ``function`` (an fx ``call_function`` target) or
    ``method`` (a tensor method, fx ``call_method``)."""
    path: str
    """Dotted import path (``torch.nn.ReLU6``, ``operator.add``); the method name for methods."""
    op: str | None
    """The profile op (:data:`OPS`) lint sees; ``None``: computes nothing on the target."""
    lowering: str | None = None
    """Export's rule (:data:`LOWERINGS`); ``None``: no integer lowering."""
    passes: bool = False
    """A layer's pending result passes through it unchanged (max commutes with quantizers)."""
    product: bool = False
    """Multiplies by a weight or an activation; as a function qdsl lowers none of these."""
    like: tuple[str, int] | None = None
    """For a function export lowers by building a module (the functional pools): that
    module's path and how many leading positional options the function shares with its
    constructor."""

    @property
    def name(self) -> str:
        """How fx names the target: the class, function or method name."""
        return self.path.rpartition(".")[2]


def _rows(kind: str, prefix: str, entries: Iterable[tuple]) -> list[Construct]:
    return [Construct(kind, prefix + e[0], *e[1:]) for e in entries]


_NN = "torch.nn."
_F = "torch.nn.functional."

CONSTRUCTS: tuple[Construct, ...] = tuple(
    _rows("module", _NN, [
        # (class, op, lowering, passes)
        ("Conv1d", "conv1d", "layer"),
        ("Conv2d", "conv2d", "layer"),
        ("Linear", "linear", "layer"),
        # MultiheadAttention.out_proj's class (lint maps class names; qdsl.patch.attention calls it as a Linear)
        ("modules.linear.NonDynamicallyQuantizableLinear", "linear", "layer"),
        ("ConvTranspose1d", "conv_transpose1d", "layer"),
        ("ConvTranspose2d", "conv_transpose2d", "layer"),
        ("BatchNorm1d", "batch_norm", "batch_norm", True),
        ("BatchNorm2d", "batch_norm", "batch_norm", True),
        ("ReLU", "relu", "relu", True),
        ("ReLU6", "relu6", "relu6", True),
        ("Hardtanh", "clamp", "hardtanh", True),
        ("Identity", None, "pass", True),
        ("Dropout", None, "pass", True),
        ("Dropout1d", None, "pass", True),
        ("Dropout2d", None, "pass", True),
        ("AlphaDropout", None),
        ("Flatten", "reshape", "reshape", True),
        ("Unflatten", "reshape"),
        ("MaxPool1d", "max_pool1d", "pool", True),
        ("MaxPool2d", "max_pool2d", "pool", True),
        ("AvgPool1d", "avg_pool1d", "pool"),
        ("AvgPool2d", "avg_pool2d", "pool"),
        ("AdaptiveAvgPool1d", "global_avg_pool", "pool"),
        ("AdaptiveAvgPool2d", "global_avg_pool", "pool"),
        ("LeakyReLU", "leaky_relu", "lut"),
        ("Sigmoid", "sigmoid", "lut"),
        ("Tanh", "tanh", "lut"),
        ("Softmax", "softmax", "softmax"),
        ("LayerNorm", "layer_norm", "layer_norm"),
        ("Hardswish", "hardswish", "lut"),
        ("Hardsigmoid", "hardsigmoid", "lut"),
        ("GELU", "gelu", "lut"),
        ("SiLU", "silu", "lut"),
        ("PReLU", "prelu", "lut"),  # its slope is read at export: one table (per channel: LUT_CHANNEL)
        ("Embedding", "embedding", "embedding"),
        ("LSTM", "lstm", "recurrent"),
        ("GRU", "gru", "recurrent"),
        ("LSTMCell", "lstm", "recurrent"),
        ("GRUCell", "gru", "recurrent"),
        ("RNN", "rnn", "recurrent"),
        ("RNNCell", "rnn", "recurrent"),
        ("Upsample", "upsample", "resize"),
        ("UpsamplingNearest2d", "upsample", "resize"),
        ("UpsamplingBilinear2d", "upsample", "resize"),
    ])
    + _rows("function", "", [
        # (path, op, lowering, passes, product, like)
        ("operator.add", "add", "add"),
        ("operator.iadd", "add", "add"),
        ("torch.add", "add", "add"),
        ("operator.mul", "mul", "mul"),
        ("operator.imul", "mul", "mul"),
        ("torch.mul", "mul", "mul"),
        ("torch.cat", "concat", "concat"),
        ("torch.concat", "concat", "concat"),
        ("torch.concatenate", "concat", "concat"),
        (_F + "relu", "relu", "relu", True),
        ("torch.relu", "relu", "relu", True),
        (_F + "relu_", "relu"),
        (_F + "relu6", "relu6", "relu6", True),
        (_F + "hardtanh", "clamp", "hardtanh", True),
        ("torch.clamp", "clamp"),
        ("torch.clip", "clamp"),
        (_F + "leaky_relu", "leaky_relu", "lut"),
        ("torch.sigmoid", "sigmoid", "lut"),
        ("torch.tanh", "tanh", "lut"),
        (_F + "softmax", "softmax", "softmax"),
        ("torch.softmax", "softmax", "softmax"),
        ("operator.matmul", "matmul", "matmul", False, True),
        ("torch.transpose", "reshape", "transpose"),
        ("operator.truediv", None, "div"),
        (_F + "hardswish", "hardswish", "lut"),
        (_F + "hardsigmoid", "hardsigmoid", "lut"),
        (_F + "gelu", "gelu", "lut"),
        (_F + "silu", "silu", "lut"),
        (_F + "interpolate", "upsample", "resize"),
        (_F + "max_pool1d", "max_pool1d", "pool", True, False, (_NN + "MaxPool1d", 4)),
        (_F + "max_pool2d", "max_pool2d", "pool", True, False, (_NN + "MaxPool2d", 4)),
        (_F + "avg_pool1d", "avg_pool1d", "pool", False, False, (_NN + "AvgPool1d", 5)),
        (_F + "avg_pool2d", "avg_pool2d", "pool", False, False, (_NN + "AvgPool2d", 6)),
        (_F + "adaptive_avg_pool1d", "global_avg_pool", "pool", False, False, (_NN + "AdaptiveAvgPool1d", 1)),
        (_F + "adaptive_avg_pool2d", "global_avg_pool", "pool", False, False, (_NN + "AdaptiveAvgPool2d", 1)),
        ("torch.mean", "mean"),
        ("torch.flatten", "reshape", "reshape", True),
        ("torch.reshape", "reshape", "reshape", True),
        ("torch.squeeze", "reshape"),
        ("torch.unsqueeze", "reshape"),
        (_F + "linear", "linear", None, False, True),
        (_F + "conv1d", "conv1d", None, False, True),
        (_F + "conv2d", "conv2d", None, False, True),
        ("builtins.getattr", None, "shape"),
        ("operator.getitem", None, "item"),
        (_F + "dropout", None, None, True),
        ("torch.detach", None),
        # products qdsl lowers none of as functions (apply's coverage check reports them)
        (_F + "bilinear", "bilinear", None, False, True),
        (_F + "conv3d", "conv3d", None, False, True),
        (_F + "conv_transpose1d", "conv_transpose1d", None, False, True),
        (_F + "conv_transpose2d", "conv_transpose2d", None, False, True),
        (_F + "conv_transpose3d", "conv_transpose3d", None, False, True),
        (_F + "embedding", "embedding", None, False, True),
        (_F + "embedding_bag", "embedding_bag", None, False, True),
        (_F + "scaled_dot_product_attention", "scaled_dot_product_attention", None, False, True),
        ("torch.matmul", "matmul", "matmul", False, True),
        ("torch.bmm", "matmul", "matmul", False, True),
        ("torch.mm", "mm", None, False, True),
        ("torch.mv", "mv", None, False, True),
        ("torch.einsum", "einsum", None, False, True),
        ("torch.addmm", "addmm", None, False, True),
        ("torch.baddbmm", "baddbmm", None, False, True),
        ("torch.addbmm", "addbmm", None, False, True),
        ("torch.addmv", "addmv", None, False, True),
        ("torch.tensordot", "tensordot", None, False, True),
    ])
    + _rows("method", "", [
        # (name, op, lowering, passes)
        ("size", None, "shape"),
        ("dim", None, "shape"),
        ("contiguous", None, "pass", True),
        ("transpose", "reshape", "transpose"),
        ("permute", "reshape", "transpose"),
        ("matmul", "matmul", "matmul"),
        ("bmm", "matmul", "matmul"),
        ("softmax", "softmax", "softmax"),
        ("relu", "relu", "relu", True),
        ("relu_", "relu", "relu"),
        ("flatten", "reshape", "reshape", True),
        ("view", "reshape", "reshape", True),
        ("reshape", "reshape", "reshape", True),
        ("add", "add", "add"),
        ("add_", "add", "add"),
        ("mul", "mul", "mul"),
        ("mul_", "mul", "mul"),
    ])
)
"""Every construct qdsl knows (see the module doc)."""

LINT_ONLY_OPS = tuple(op for op in OPS if not any(c.op == op and c.lowering for c in CONSTRUCTS))
"""Profile ops lint checks but export cannot lower (``mean``, ...): a model using
one lints against a profile that lists it, and still fails to export."""


def constructs(kind: str, *, lowering: str | None = None) -> tuple[Construct, ...]:
    """The rows of one ``kind``, optionally only those with the given ``lowering``."""
    return tuple(c for c in CONSTRUCTS if c.kind == kind and (lowering is None or c.lowering == lowering))


def short_name(name: str) -> str:
    """The name lint and the coverage check key functions by: fx's ``__name__`` without
    surrounding underscores (``operator.__iadd__`` -> ``iadd``, ``F.relu_`` -> ``relu``)."""
    return name.strip("_") or name

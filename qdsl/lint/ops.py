"""The op vocabulary profiles speak, and how torch modules and functions map onto it.

Profiles name op types (``conv2d``, ``add``, ``relu``...), not torch classes, so one
profile serves any model.  :data:`KNOWN_OPS` is the closed vocabulary the profile loader
accepts; :func:`module_op` and :func:`function_op` map a module class name or a traced
function/method to an op, or to ``None`` for things that compute nothing on the target
(``Identity``, ``Dropout`` in eval, shape queries).  Torch-free: names only.
"""

from __future__ import annotations

__all__ = [
    "KNOWN_OPS",
    "WEIGHTED_OPS",
    "NO_OP",
    "module_op",
    "function_op",
    "method_op",
]

WEIGHTED_OPS = ("conv1d", "conv2d", "linear")
"""Ops with a weight (and optional bias): the ones with an integer accumulator."""

KNOWN_OPS = WEIGHTED_OPS + (
    "add",
    "mul",
    "concat",
    "relu",
    "relu6",
    "clamp",
    "leaky_relu",
    "sigmoid",
    "tanh",
    "softmax",
    "hardswish",
    "gelu",
    "silu",
    "max_pool1d",
    "max_pool2d",
    "avg_pool1d",
    "avg_pool2d",
    "global_avg_pool",
    "mean",
    "reshape",
    "batch_norm",
)
"""Every op name a profile may list (in ``ops``, ``op.<name>``, ``fusions``, ``fixed_output``)."""

NO_OP = None
"""What :func:`module_op` returns for modules that vanish on the target."""

_MODULES = {
    "Conv1d": "conv1d",
    "Conv2d": "conv2d",
    "Linear": "linear",
    "ReLU": "relu",
    "ReLU6": "relu6",
    "Hardtanh": "clamp",
    "LeakyReLU": "leaky_relu",
    "Sigmoid": "sigmoid",
    "Tanh": "tanh",
    "Softmax": "softmax",
    "Hardswish": "hardswish",
    "GELU": "gelu",
    "SiLU": "silu",
    "MaxPool1d": "max_pool1d",
    "MaxPool2d": "max_pool2d",
    "AvgPool1d": "avg_pool1d",
    "AvgPool2d": "avg_pool2d",
    "AdaptiveAvgPool1d": "global_avg_pool",
    "AdaptiveAvgPool2d": "global_avg_pool",
    "Flatten": "reshape",
    "Unflatten": "reshape",
    "BatchNorm1d": "batch_norm",
    "BatchNorm2d": "batch_norm",
}
_NOOP_MODULES = {"Identity", "Dropout", "Dropout1d", "Dropout2d", "AlphaDropout"}

# fx call_function targets, by ``__name__`` (operator.add, torch.add and F.relu all carry one)
_FUNCTIONS = {
    "add": "add",
    "iadd": "add",
    "mul": "mul",
    "imul": "mul",
    "cat": "concat",
    "concat": "concat",
    "relu": "relu",
    "relu_": "relu",
    "relu6": "relu6",
    "clamp": "clamp",
    "clip": "clamp",
    "hardtanh": "clamp",
    "leaky_relu": "leaky_relu",
    "sigmoid": "sigmoid",
    "tanh": "tanh",
    "softmax": "softmax",
    "hardswish": "hardswish",
    "gelu": "gelu",
    "silu": "silu",
    "max_pool1d": "max_pool1d",
    "max_pool2d": "max_pool2d",
    "avg_pool1d": "avg_pool1d",
    "avg_pool2d": "avg_pool2d",
    "adaptive_avg_pool1d": "global_avg_pool",
    "adaptive_avg_pool2d": "global_avg_pool",
    "mean": "mean",
    "flatten": "reshape",
    "reshape": "reshape",
    "view": "reshape",
    "squeeze": "reshape",
    "unsqueeze": "reshape",
    "linear": "linear",
    "conv1d": "conv1d",
    "conv2d": "conv2d",
}
_NOOP_FUNCTIONS = {"getattr", "getitem", "size", "dim", "contiguous", "dropout", "identity", "detach"}


def module_op(type_name: str) -> str | None:
    """The op a leaf module of class ``type_name`` runs as; unknown classes map to their
    lower-cased name (so a profile that restricts ops reports them)."""
    if type_name in _NOOP_MODULES:
        return NO_OP
    return _MODULES.get(type_name, type_name.lower())


def function_op(name: str) -> str | None:
    """The op of a traced function call (``operator.add`` -> ``add``), by function name."""
    if name in _NOOP_FUNCTIONS:
        return NO_OP
    return _FUNCTIONS.get(name, name)


def method_op(name: str) -> str | None:
    """The op of a traced tensor method call (``x.view(...)`` -> ``reshape``)."""
    return function_op(name)

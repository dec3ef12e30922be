"""The inputs and outputs of an exported graph: how ``qdsl.export``'s example input maps
to the model's ``forward`` parameters, and the model's result to graph outputs.

Example input (``qdsl.export(model, example)``):

* a tensor (or array) is the one positional input, as always;
* a tuple, or a list of tensors/arrays, is the positional inputs: ``export(m, (x, mask))``;
* a dict is keyword inputs: ``export(m, {"input_ids": ids, "attention_mask": mask})``.

Parameters given a tensor become graph inputs, in ``forward``'s parameter order; a float
tensor an F32 input, an integer one (token ids) or a bool one (a mask) an I32 input.
Parameters not given (they have defaults) and parameters given a non-tensor (``None``, a Python number) are
specialized: the trace uses that value (fx ``concrete_args``), so ``if mask is None``
takes the branch the example takes.  A graph with one input calls it ``input``; with
several, each is named after its ``forward`` parameter (the names ``run_graph`` accepts
as dict keys).

Result: a tensor is the one output ``output``; a tuple/list gives ``output``,
``output1``, ... (nested ones flattened in order: an LSTM's ``(output, (h_n, c_n))``, whose
``h_n``/``c_n`` are one value per layer and direction); a dict gives one output per key,
named by the key, in the dict's order.
"""

from __future__ import annotations

import inspect
from typing import Any

import attrs
import numpy as np
import torch
from torch import nn

from qdsl.export.values import ExportError

__all__ = ["ExampleCall", "bind_example", "output_names"]


@attrs.frozen
class ExampleCall:
    """``forward``'s parameters (self excluded) in order, with the example's values."""

    params: tuple[str, ...]
    values: tuple[Any, ...]
    """Per parameter: a tensor (a graph input) or the specialized non-tensor value."""

    @property
    def concrete(self) -> dict[str, Any]:
        return {p: v for p, v in zip(self.params, self.values) if not isinstance(v, torch.Tensor)}

    @property
    def tensor_params(self) -> list[str]:
        return [p for p, v in zip(self.params, self.values) if isinstance(v, torch.Tensor)]


def _as_tensor(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.as_tensor(value)
    return value  # None, numbers: specialized by the trace


def _is_arrays(value: Any) -> bool:
    return isinstance(value, tuple) or (
        isinstance(value, list) and bool(value) and all(isinstance(v, (torch.Tensor, np.ndarray)) for v in value))


def bind_example(model: nn.Module, example: Any, single_leaf: bool = False) -> ExampleCall:
    """Map ``example`` (module docstring) to ``model.forward``'s parameters."""
    if isinstance(example, dict):
        args, kwargs = (), {k: _as_tensor(v) for k, v in example.items()}
    elif _is_arrays(example):
        args, kwargs = tuple(_as_tensor(v) for v in example), {}
    elif isinstance(example, torch.Tensor):
        args, kwargs = (example,), {}
    else:
        args, kwargs = (torch.as_tensor(np.asarray(example)),), {}
    if single_leaf:  # a bare layer is traced as one call on one input (lower.trace_quantized)
        if kwargs or len(args) != 1:
            raise ExportError("", "a model that is one quantized layer takes one input",
                              "pass one tensor as the example input")
        return ExampleCall(("x",), args)
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return ExampleCall(tuple(f"input{i}" for i in range(len(args))), args)
    var = [p.name for p in sig.parameters.values()
           if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise ExportError("", f"the example input does not fit {type(model).__name__}.forward{sig}: {exc}",
                          "pass a tensor, a tuple of positional inputs or a dict of keyword inputs") from None
    if any(name in bound.arguments for name in var):
        raise ExportError("", f"{type(model).__name__}.forward takes *args/**kwargs ({', '.join(var)}), "
                              "which export cannot name as graph inputs",
                          "export a wrapper module whose forward names its inputs")
    params, values = [], []
    for p in sig.parameters.values():
        if p.name in var:
            continue
        params.append(p.name)
        values.append(bound.arguments[p.name] if p.name in bound.arguments else p.default)
    for p, v in zip(params, values):
        if isinstance(v, torch.Tensor) and not (v.is_floating_point() or _is_int(v)):
            raise ExportError("", f"input '{p}' has dtype {v.dtype}",
                              "graph inputs are float tensors, integer token ids or bool masks")
    if not any(isinstance(v, torch.Tensor) for v in values):
        raise ExportError("", "the example input holds no tensor", "pass the model's input tensor(s)")
    return ExampleCall(tuple(params), tuple(values))


def _is_int(t: torch.Tensor) -> bool:
    # bool: a mask (an I32 input of 0/1 that only SOFTMAX_MASKED reads)
    return t.dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)


def output_names(result: Any, where: str = "") -> list[tuple[str, Any]]:
    """``[(graph output name, value)]`` for the model's result (module docstring)."""
    if isinstance(result, dict):
        items = list(result.items())
        bad = [k for k, _ in items if not isinstance(k, str) or not k]
        if bad:
            raise ExportError(where, f"the model returns a dict with non-string key(s) {bad!r}",
                              "graph outputs are named by the keys: use strings")
        return items
    if isinstance(result, (tuple, list)):
        # nested tuples (a recurrent layer's ``(output, (h_n, c_n))``) flatten in order
        return [("output" if i == 0 else f"output{i}", v) for i, v in enumerate(_leaves(result))]
    return [("output", result)]


def _leaves(result: Any) -> list[Any]:
    out: list[Any] = []
    for v in result:
        out.extend(_leaves(v) if isinstance(v, (tuple, list)) else [v])
    return out

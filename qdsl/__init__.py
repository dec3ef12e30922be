"""qdsl: declarative quantization for PyTorch.

Write a spec (``*.qspec.toml`` or ``*.qspec``), then::

    handle = qdsl.apply(model, "model.qspec")   # hooks + parametrizations, no class replaced
    qdsl.calibrate(model, batches)               # post-training calibration
    qdsl.freeze(model)
    graph = qdsl.export(model, example_input)    # integer graph
    y = qdsl.run_graph(graph, x)                 # C++ runtime, or the Python reference
    handle.remove()                              # the original model, bit for bit

The public names are imported lazily so ``import qdsl`` stays cheap and the torch-free
layers (``qdsl.spec``, ``qdsl.parse``) can be used without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> "module:attribute"
_LAZY = {
    # spec + parse (torch-free)
    "QuantSpec": "qdsl.spec.model:QuantSpec",
    "Diagnostic": "qdsl.spec.diagnostics:Diagnostic",
    "SpecError": "qdsl.spec.diagnostics:SpecError",
    "QdslError": "qdsl.spec.diagnostics:QdslError",
    "QdslWarning": "qdsl.spec.diagnostics:QdslWarning",
    "Registries": "qdsl.spec.registry:Registries",
    "load_spec": "qdsl.parse:load_spec",
    "parse_spec": "qdsl.parse:parse_text",
    "format_spec": "qdsl.parse:format_spec",
    # resolve
    "resolve": "qdsl.resolve:resolve",
    "Plan": "qdsl.resolve.plan:Plan",
    "explain": "qdsl.resolve:explain",
    # quantizers + patch + calibration (apply/calibrate: the façade, qdsl/api.py)
    "default_registries": "qdsl.quantizers:default_registries",
    "apply": "qdsl.api:apply",
    "remove": "qdsl.patch:remove",
    "calibrate": "qdsl.api:calibrate",
    "calibrating": "qdsl.calibration:calibrating",
    "freeze": "qdsl.calibration:freeze",
    "int_tensors": "qdsl.patch:int_tensors",
    "save": "qdsl.patch:save",
    "load": "qdsl.patch:load",
    "LeftFloatWarning": "qdsl.patch.coverage:LeftFloatWarning",
    "LeftFloatError": "qdsl.patch.coverage:LeftFloatError",
    "SharedModuleWarning": "qdsl.patch.coverage:SharedModuleWarning",
    # export + graph + runtime
    "export": "qdsl.export:export",
    "IntegerGraph": "qdsl.graph:IntegerGraph",
    "save_graph": "qdsl.graph:save_graph",
    "load_graph": "qdsl.graph:load_graph",
    "run_graph": "qdsl.runtime.run:run_graph",
    # workflows
    "sensitivity": "qdsl.workflows.sensitivity:sensitivity",
    # lint
    "lint": "qdsl.lint:lint",
    "load_profile": "qdsl.lint:load_profile",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'qdsl' has no attribute {name!r}")
    module, attr = target.split(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

"""One tracer module: every torch.fx tracer subclass in qdsl lives in qdsl/patch/trace.py
(lint, BN folding and apply's checks use ``trace_model``; export uses its
``MarkingTracer`` variant)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch import nn

import qdsl
from qdsl.patch.trace import MarkingTracer, quantizer_mark

PKG = Path(qdsl.__file__).resolve().parent


def _tracer_classes() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if any(b.split(".")[-1] == "Tracer" or b.endswith("Tracer") for b in bases):
                    found.setdefault(path.relative_to(PKG).as_posix(), []).append(node.name)
    return found


def test_every_fx_tracer_is_in_patch_trace():
    found = _tracer_classes()
    assert set(found) == {"patch/trace.py"}, found
    assert "MarkingTracer" in found["patch/trace.py"]


def test_marking_tracer_marks_patched_quantizers_and_keeps_weighted_layers_as_leaves():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
    handle = qdsl.apply(model, qdsl.load_spec(PKG.parent / "specs" / "int8-default.qspec"))
    try:
        graph = MarkingTracer(handle).trace(model)
    finally:
        handle.remove()
    marks = [n.args[1:] for n in graph.nodes if n.op == "call_function" and n.target is quantizer_mark]
    assert ("0", "input") in marks
    assert [n.target for n in graph.nodes if n.op == "call_module"] == ["0", "1"]
    assert all("qdsl_scope" in n.meta for n in graph.nodes)
    assert torch.equal(quantizer_mark(torch.ones(2), "x", "input"), torch.ones(2))

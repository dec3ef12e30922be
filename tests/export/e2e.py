"""One small model through the whole flow, for the op tests (upsample, PReLU, concat axes,
pools on narrow activations): apply a spec -> a training forward/backward -> calibrate ->
freeze -> export -> the C++ runtime equals the reference executor bit for bit (every kernel
path), and the graph's codes at the input of the model's last layer agree with the
fake-quant model's (the model outputs of the bundled specs are int32 accumulators, far finer
than an int8 step, so the codes compared are the last int8 tensor's, as in
test_torchvision_shapes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import qdsl
import qdsl.runtime as rt
from qdsl.graph import execute
from qdsl.graph.ir import IntegerGraph, OpType
from qdsl.parse import parse_file, parse_text
from qdsl.patch.handle import proxy_key
from qdsl.spec.model import Role

ROOT = Path(__file__).resolve().parents[2]
_WEIGHTED = (OpType.LINEAR, OpType.CONV1D, OpType.CONV2D, OpType.BLINEAR, OpType.BCONV1D, OpType.BCONV2D)


def load_spec(spec: str):
    """A bundled spec by name (``int8-default``: the file unedited) or a spec's text."""
    if "\n" in spec:
        return parse_text(spec, "test.qspec")
    return parse_file(ROOT / "specs" / f"{spec}.qspec")


def flow(model: torch.nn.Module, spec: str, shape: tuple[int, ...], last: str, seed: int = 0):
    """``(graph, codes diff array)``: the flow of the module doc on ``model``; ``last`` is the
    layer whose integer input codes are compared."""
    torch.manual_seed(seed)
    handle = qdsl.apply(model, load_spec(spec))
    model.train()
    x = torch.randn(*shape)
    model(x).square().mean().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.eval()
    qdsl.calibrate(model, [torch.randn(*shape) for _ in range(4)])
    qdsl.freeze(model)
    graph = qdsl.export(model, x)
    xt = torch.randn(*shape)
    ref = execute(graph, xt.numpy(), keep_values=True)
    if rt.available():
        from qdsl.runtime import kernels as K

        cg = rt.CompiledGraph(graph)
        for path in [p for p in ("ref", "portable", "avx2", "avxvnni", "avx512", "amx") if p in K.paths()["cpu"]]:
            np.testing.assert_array_equal(cg.run(xt.numpy(), path=path), ref.outputs[0], err_msg=f"path {path}")
    q = handle.container.quantizers[proxy_key(last, Role.INPUT)]
    seen = []
    hook = model.get_submodule(last).register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(xt)
    hook.remove()
    fq_codes = q.int_repr(seen[0]).numpy().astype(np.int64)
    op = next(op for op in graph.ops if op.name == last and op.type in _WEIGHTED)
    got = ref.values[op.inputs[0]].astype(np.int64)
    return graph, np.abs(got.reshape(fq_codes.shape) - fq_codes)


def op_types(graph: IntegerGraph) -> list[OpType]:
    return [op.type for op in graph.ops]


def assert_close(diff: np.ndarray, exact: bool = False) -> None:
    """Within 1 LSB on >= 99.5% of the codes (float scales), or bit-exact."""
    if exact:
        assert diff.max() == 0, f"{np.count_nonzero(diff)} of {diff.size} codes differ"
        return
    within = np.count_nonzero(diff <= 1) / diff.size
    assert within >= 0.995, f"only {within:.4%} of codes within 1 LSB (max diff {diff.max()})"

"""Layer-by-layer agreement of an exported graph with its fake-quant model (issue 17).

End to end, the graph and the fake-quant model can part on a random-init network although
every layer is lowered right: fake-quant computes a conv in float32, the graph exactly in
integers, so a value within a few ulps of a rounding tie (MobileNetV3-small w4a8: exactly
49.4999998 LSB, float32 49.500002) gets different codes, and the network's gains (> 1) spread
that one code.  So each quantized layer is also checked on its own: the layer's graph output
against the fake-quant layer (the patched module: its input and weight quantizers, BN folded,
its output quantizer) fed the graph's OWN input values (dequantized: ``(q - zp) · s``), its
float result quantized to the graph output's grid the way a fake quantizer does (float32
multiply by ``1/s``, the op's rounding, the op's clamp: fused ReLU/ReLU6).  A layer whose
graph output is an int32 accumulator handed to an ADD or an average pool (its fused ReLU/ReLU6
applied as a clamp in real values) is compared at that op's output, the op evaluated in float32 from the fake-quant layer result and the graph's
other operands (dequantized), as fake-quant evaluates it; a layer the model output
dequantizes (the classifier) is compared in units of that output's scale.

:func:`layer_agreement` returns one :class:`LayerAgreement` per layer (graph order).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from qdsl.graph import execute
from qdsl.graph.ir import DType, IntegerGraph, OpType, Rounding
from qdsl.patch.handle import get_handle, proxy_key
from qdsl.spec.model import Role

__all__ = ["LayerAgreement", "layer_agreement", "worst"]

WEIGHTED = (OpType.CONV1D, OpType.CONV2D, OpType.LINEAR, OpType.BCONV1D, OpType.BCONV2D, OpType.BLINEAR,
            OpType.CONV_TRANSPOSE1D, OpType.CONV_TRANSPOSE2D)


@attrs.frozen
class LayerAgreement:
    """How one layer's graph output compares with the fake-quant layer on the same input."""

    layer: str
    """The module path, with the op its accumulator goes through (``layer1.0.conv2 -> ADD``)."""
    layers: tuple[str, ...]
    """The layers (module paths) this row compares: two when an ADD reads two accumulators."""
    within: float
    """Fraction of output codes within 1 LSB (binary outputs: equal signs, or a sign tie: SIGN_TIE)."""
    exact: float
    """Fraction of output codes equal."""
    max_diff: float
    size: int

    def __str__(self) -> str:
        return f"{self.layer}: {self.within:.4%} within 1 LSB, {self.exact:.4%} exact, max {self.max_diff:g} " \
               f"({self.size} codes)"


def _real(q: np.ndarray, grid) -> np.ndarray:
    """The fake-quant value of graph codes: ``(q - zp) · s`` in float32."""
    s, zp = grid
    return ((q.astype(np.float32) - np.float32(zp)) * np.float32(s)).astype(np.float32)


def _round(r: np.ndarray, mode: Rounding) -> np.ndarray:
    if mode is Rounding.HALF_EVEN:
        return np.rint(r)
    if mode is Rounding.FLOOR:
        return np.floor(r)
    if mode is Rounding.HALF_AWAY:
        return np.sign(r) * np.floor(np.abs(r) + 0.5)
    return np.floor(r + 0.5)  # HALF_UP


def _input_threshold(model: torch.nn.Module, layer: str, ndim: int) -> np.ndarray | None:
    """Layer ``layer``'s learned binarisation threshold (its input quantizer's
    ``sign_threshold``, ``threshold = learned``) viewed ``[1, C, 1, ...]``, or None."""
    quantizers = get_handle(model).container.quantizers
    key = proxy_key(layer, Role.INPUT)
    t = getattr(quantizers[key], "sign_threshold", None) if key in quantizers else None
    if t is None or t.numel() == 0:
        return None
    return t.detach().float().numpy().reshape([1, -1] + [1] * (ndim - 2))


def _consumer_threshold(model, graph: IntegerGraph, tensor: str, ndim: int) -> np.ndarray | None:
    """The threshold a BIN tensor was binarised at: export folds the reading layer's learned
    threshold into the producer (its bias becomes ``-k[c]``), through max pools."""
    for op in graph.ops:
        if tensor in op.inputs:
            if op.type in WEIGHTED:
                return _input_threshold(model, op.name, ndim)
            if op.type in (OpType.MAXPOOL1D, OpType.MAXPOOL2D):
                return _consumer_threshold(model, graph, op.outputs[0], ndim)
    return None


def _activation_clamps(model: torch.nn.Module, x) -> dict[str, tuple[float, float]]:
    """For each module, the clamp of the activation modules (ReLU, ReLU6, Hardtanh) the
    model runs right after it, before the next weighted layer: a BIN output that carries a
    learned threshold has that clamp folded into its threshold bias, so the comparison applies
    it.  One forward records the modules' call order (functional activations are not seen)."""
    order: list[torch.nn.Module] = []
    hooks = [m.register_forward_hook(lambda m, a, o: order.append(m)) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model(torch.as_tensor(np.asarray(x, dtype=np.float32)))
    finally:
        for h in hooks:
            h.remove()
    names = {m: n for n, m in model.named_modules()}
    clamps: dict[str, tuple[float, float]] = {}
    for i, m in enumerate(order):
        if not isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)):
            continue
        lo, hi = -np.inf, np.inf
        for nxt in order[i + 1:]:
            if isinstance(nxt, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)):
                break
            if isinstance(nxt, torch.nn.ReLU6):
                lo, hi = max(lo, 0.0), min(hi, 6.0)
            elif isinstance(nxt, torch.nn.ReLU):
                lo = max(lo, 0.0)
            elif isinstance(nxt, torch.nn.Hardtanh):
                lo, hi = max(lo, nxt.min_val), min(hi, nxt.max_val)
        clamps[names[m]] = (lo, hi)
    return clamps


def _codes(y: np.ndarray, grid, attrs_, dtype: DType, t: np.ndarray | None = None) -> np.ndarray:
    """The codes a fake quantizer on the graph tensor's grid gives ``y``, then the op's clamp
    (binary: the sign at the learned threshold ``t`` where there is one)."""
    if dtype is DType.BIN:
        return np.where(y < (0 if t is None else t), -1, 1).astype(np.int64)
    s, zp = grid
    r = y.astype(np.float32) * (np.float32(1.0) / np.float32(s))
    q = _round(r.astype(np.float64), Rounding(attrs_["rq_rounding"])) + zp
    return np.clip(q, attrs_["out_min"], attrs_["out_max"]).astype(np.int64)


def _clamped(y: np.ndarray, s, attrs_) -> np.ndarray:
    """A layer result the graph keeps in int32 with a fused ReLU/ReLU6 (the clamp codes on its
    int32 grid ``s``), clamped in real values as the fake-quant model's activation clamps it."""
    lo = attrs_["out_min"] * float(s) if attrs_["out_min"] > np.iinfo(np.int32).min else -np.inf
    hi = attrs_["out_max"] * float(s) if attrs_["out_max"] < np.iinfo(np.int32).max else np.inf
    return np.clip(y, lo, hi).astype(np.float32)


def _float_op(op, xs: list[np.ndarray]) -> np.ndarray:
    """The graph op ``op`` on real values in float32, as the fake-quant model computes it."""
    ts = [torch.from_numpy(np.ascontiguousarray(x)) for x in xs]
    if op.type is OpType.ADD:
        return (ts[0] + ts[1]).numpy()
    if op.type is OpType.GLOBAL_AVGPOOL:
        pool = F.adaptive_avg_pool1d if ts[0].dim() == 3 else F.adaptive_avg_pool2d
        return pool(ts[0], 1).numpy()
    if op.type in (OpType.AVGPOOL1D, OpType.AVGPOOL2D):
        pool = F.avg_pool1d if op.type is OpType.AVGPOOL1D else F.avg_pool2d
        return pool(ts[0], tuple(op.attrs["kernel"]), tuple(op.attrs["stride"]), tuple(op.attrs["padding"])).numpy()
    raise NotImplementedError(f"a layer's int32 accumulator read by {op.type.name}")


# a binary output's sign tie: the fake-quant float within float32 rounding of 0 (relative to the
# layer's largest output), where the graph's exact sum is 0 or as close (+1); the binary analogue
# of a code one LSB off at a rounding tie.  Seen on xnor-binary MobileNets: BN-folded channels
# whose float result is -1e-8 (exactly 0 in integers), a whole channel at a time.
SIGN_TIE = 1e-6


def _row(label: str, layers, got: np.ndarray, want: np.ndarray, y: np.ndarray | None = None) -> LayerAgreement:
    diff = np.abs(got.astype(np.float64).reshape(want.shape) - want)
    if y is not None:  # binary: equal signs, or a sign tie
        tie = np.abs(y) <= SIGN_TIE * np.abs(y).max(initial=0)
        within = np.count_nonzero((diff == 0) | tie) / diff.size
    else:
        within = np.count_nonzero(diff <= 1) / diff.size
    return LayerAgreement(label, tuple(layers), within, np.count_nonzero(diff == 0) / diff.size,
                          float(diff.max(initial=0)), int(diff.size))


def layer_agreement(model: torch.nn.Module, graph: IntegerGraph, info: dict, x) -> list[LayerAgreement]:
    """Every quantized layer of ``graph`` (exported from the frozen ``model`` with
    ``with_info=True``: ``info``) on the input batch ``x``, as the module doc describes."""
    values = execute(graph, np.asarray(x, dtype=np.float32), keep_values=True).values
    pending: dict[str, tuple[str, np.ndarray]] = {}  # int32 tensor -> (layer, fake-quant float result)
    rows = []
    clamps = None
    model.eval()
    for op in graph.ops:
        out = op.outputs[0]
        dtype = graph.tensor(out).dtype
        if op.type in WEIGHTED:
            module = model if op.name == "<model>" else model.get_submodule(op.name)
            x_in = _real(values[op.inputs[0]], info[op.inputs[0]])
            t_in = _input_threshold(model, op.name, x_in.ndim) if op.name != "<model>" else None
            if t_in is not None and graph.tensor(op.inputs[0]).dtype is DType.BIN:
                # the layer's own quantizer binarises at t[c]: fed t ± 1 it gives the graph's codes
                x_in = (t_in + np.sign(x_in)).astype(np.float32)
            with torch.no_grad():
                y = module(torch.from_numpy(x_in)).numpy()
            if dtype is DType.I32:  # compared after the op that reads the accumulator
                pending[out] = (op.name, _clamped(y, info[out][0], op.attrs))
                continue
            t_out = _consumer_threshold(model, graph, out, y.ndim) if dtype is DType.BIN else None
            if t_out is not None:  # the fused activation, folded into the threshold bias
                if clamps is None:
                    clamps = _activation_clamps(model, x)
                y = np.clip(y, *clamps.get(op.name, (-np.inf, np.inf))).astype(np.float32)
            rows.append(_row(op.name, [op.name], values[out], _codes(y, info[out], op.attrs, dtype, t_out),
                             (y if t_out is None else y - t_out) if dtype is DType.BIN else None))
            continue
        reads = [pending[i] for i in op.inputs if i in pending]
        if not reads:
            continue
        label = "+".join(name for name, _ in reads) + f" -> {op.type.name}"
        if op.type is OpType.DEQUANTIZE:  # the model output: float, in units of its scale
            (_, y), s = reads[0], float(info[op.inputs[0]][0])
            diff = np.abs(values[out].astype(np.float64).reshape(y.shape) - y) / s
            rows.append(LayerAgreement(label, (reads[0][0],), np.count_nonzero(diff <= 1) / diff.size,
                                       np.count_nonzero(diff < 0.5) / diff.size, float(diff.max()), int(diff.size)))
            continue
        xs = [pending[i][1] if i in pending else _real(values[i], info[i]) for i in op.inputs]
        y = _float_op(op, xs)
        rows.append(_row(label, [name for name, _ in reads], values[out], _codes(y, info[out], op.attrs, dtype)))
    return rows


def worst(rows: list[LayerAgreement]) -> LayerAgreement:
    """The layer with the fewest codes within 1 LSB (then the fewest exact)."""
    return min(rows, key=lambda r: (r.within, r.exact))

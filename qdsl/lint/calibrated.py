"""Integer weights of a calibrated qdsl model, in the form the tight accumulator bound needs.

:func:`layer_ints` reads each layer's frozen record (``qdsl.patch.frozen``: the very codes
the fake quantizers use and export writes) and returns ``{fqn: qdsl.lint.LayerInts}`` with numpy integers, or ``None`` when
the model is not a frozen qdsl model (then lint falls back to worst-case bounds).

Conversions, so that ``Σ (w_q - z_w)(x_q - z_x)`` is in one integer unit per layer:

* power-of-two weight codes ``c ∈ [-n, n]`` stand for ``sign(c)·2^(|c|-1)`` smallest
  steps (``FrozenLayer.weight_grid``, as export lowers them);
* weight zero points per tensor, per output channel, or per group (repeated along the
  flattened row, the resolver's group definition) are subtracted by the caller;
* a dynamic input has no fixed zero point: ``input_zero_point`` stays ``None`` and both
  extremes are tried.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qdsl.lint.plan_checks import LayerInts
from qdsl.spec.formats import format_of

__all__ = ["layer_ints"]


def _np(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.int64)


def _weight_zero_point(zp: Any, rows: int, cols: int) -> np.ndarray | int | None:
    if zp is None:
        return 0
    z = np.asarray(zp.detach().cpu().numpy()).astype(np.int64).reshape(-1)
    if not z.any():
        return 0
    if z.size == 1:
        return int(z[0])
    if z.size == rows:
        return z.reshape(rows, 1)
    if z.size % rows == 0 and cols % (z.size // rows) == 0:
        groups = z.size // rows
        return np.repeat(z.reshape(rows, groups), cols // groups, axis=1)
    return None  # a layout this bound does not model: let lint use the worst case


def _transposed_rows(w: np.ndarray, zp: Any, groups: int) -> tuple[np.ndarray, Any]:
    """A transposed conv's ``in × out/g × k..`` codes as conv rows ``out × in/g·k..`` (output
    channel ``g·og + o`` reads column ``o`` of its group's input rows), its per-column zero
    points repeated per group."""
    cin, og = w.shape[:2]
    rows = w.reshape((groups, cin // groups, og, -1)).transpose(0, 2, 1, 3).reshape(groups * og, -1)
    if zp is not None and zp.numel() > 1:
        zp = zp.reshape(-1).repeat(groups)
    return rows, zp


def layer_ints(model: Any) -> dict[str, LayerInts] | None:
    try:
        from qdsl.patch.frozen import frozen_layer
        from qdsl.patch.handle import State, get_handle, state_of
    except ImportError:  # pragma: no cover - patch layer absent
        return None
    if state_of(model) not in (State.FROZEN, State.EXPORTED):
        return None
    out: dict[str, LayerInts] = {}
    for fqn, patch in get_handle(model).layers.items():
        rec = frozen_layer(patch)  # the record freeze produced: the codes export writes
        if rec.weight_codes is None:
            continue
        w, _ = rec.weight_grid()  # power-of-two codes already on the grid of the smallest step
        wzp = rec.weight_zero_point
        if patch.wq.axis == 1 and w.ndim > 2:  # a transposed conv: one row per output channel
            w, wzp = _transposed_rows(w, wzp, int(getattr(patch.module, "groups", 1)))
        rows = w.shape[0]
        zp = _weight_zero_point(wzp, rows, int(np.prod(w.shape[1:])) if w.ndim > 1 else 1)
        if zp is None:
            continue
        x_zp = None
        if rec.input_zero_point is not None and rec.input_zero_point.numel() == 1:
            x_zp = int(rec.input_zero_point.reshape(-1)[0])
        bias = _np(rec.bias_codes) if rec.bias_codes is not None else None
        out[fqn] = LayerInts(weight=w, weight_zero_point=zp, input_zero_point=x_zp, bias=bias)
    return out

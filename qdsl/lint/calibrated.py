"""Integer weights of a calibrated qdsl model, in the form the tight accumulator bound needs.

:func:`layer_ints` reads ``qdsl.patch.int_tensors`` (the very codes the fake quantizers
use) and returns ``{fqn: qdsl.lint.LayerInts}`` with numpy integers, or ``None`` when
the model is not a frozen qdsl model (then lint falls back to worst-case bounds).

Conversions, so that ``Σ (w_q - z_w)(x_q - z_x)`` is in one integer unit per layer:

* power-of-two weight codes ``c ∈ [-n, n]`` stand for ``sign(c)·2^(|c|-1)`` smallest
  steps (``qdsl.quantizers.functional.pot_weight_codes``);
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


def layer_ints(model: Any) -> dict[str, LayerInts] | None:
    try:
        from qdsl.patch import int_tensors
        from qdsl.patch.handle import State, state_of
    except ImportError:  # pragma: no cover - patch layer absent
        return None
    if state_of(model) not in (State.FROZEN, State.EXPORTED):
        return None
    out: dict[str, LayerInts] = {}
    for fqn, li in int_tensors(model).items():
        if li.weight is None:
            continue
        w = _np(li.weight)
        fmt = li.weight_format if li.weight_format is not None else format_of(li.weight_kind)
        w = fmt.operand_codes(w)
        rows = w.shape[0]
        zp = _weight_zero_point(li.weight_zero_point, rows, int(np.prod(w.shape[1:])) if w.ndim > 1 else 1)
        if zp is None:
            continue
        x_zp = None
        if li.input_zero_point is not None and li.input_zero_point.numel() == 1:
            x_zp = int(li.input_zero_point.reshape(-1)[0])
        bias = _np(li.bias) if li.bias is not None else None
        out[fqn] = LayerInts(weight=w, weight_zero_point=zp, input_zero_point=x_zp, bias=bias)
    return out

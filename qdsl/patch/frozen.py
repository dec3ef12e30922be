"""The frozen per-layer record: the integers a frozen layer computes with, derived once.

:func:`frozen_layer` reads a patched layer's proxies and its (BN-folded) float weight and
bias and returns a :class:`FrozenLayer`: weight codes, scales and zero points, the
weight's number format (kind, bits, signedness), the bias codes and scale, the float
bias, the activation scales and zero points.  ``qdsl.freeze`` produces one per layer;
export (``qdsl/export/lower_layers.py``), ``qdsl.int_tensors`` and lint's calibrated
checks (``qdsl/lint/calibrated.py``) read it instead of each calling ``int_repr``.

Guarantees: the codes are exactly the ones the fake quantizers use (same proxies, same
``int_repr``).  A record is reused until something it was derived from changes: the key
is the layer's frozen fast-path key (master weight/bias and BN tensor versions, the
handle's generation, bumped by freeze and load) plus the version of every proxy's scale
and zero point, so an in-place edit after freeze yields a fresh record, never a stale one.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

__all__ = ["FrozenLayer", "frozen_layer"]


@attrs.frozen(eq=False)
class FrozenLayer:
    """Integer view of one frozen layer (``None`` where that tensor is not quantized)."""

    fqn: str
    has_weight: bool
    """The layer has a weight (quantized or not)."""
    weight_codes: torch.Tensor | None
    """``int_repr`` of the weight (int8/uint8/int16/int32 by range; binary/ternary in {-1, 0, 1})."""
    weight_scale: torch.Tensor | None
    weight_zero_point: torch.Tensor | None
    weight_format: Any
    """The weight's number format (:mod:`qdsl.spec.formats`), ``None`` without a weight quantizer."""
    weight_bits: int | None
    weight_signed: bool | None
    """The weight's code range includes negative values (``qmin < 0``)."""
    bias_codes: torch.Tensor | None
    """The bias quantizer's codes (set when it is frozen): ``bias ≈ bias_codes · bias_scale``."""
    bias_scale: torch.Tensor | None
    bias_float: torch.Tensor | None
    """The float bias the bias proxy sees (BN folded), ``None`` for a bias-less layer."""
    input_scale: torch.Tensor | None
    """``None`` too when the input quantizer is dynamic (no fixed scale)."""
    input_zero_point: torch.Tensor | None
    output_scale: torch.Tensor | None
    output_zero_point: torch.Tensor | None
    folded_bn: str | None

    def weight_grid(self) -> tuple[np.ndarray, np.ndarray]:
        """``(codes, scale)``: int64 codes on an integer grid and the float64 scale (per
        tensor or per row) of one grid step, as the number format maps them
        (``operand_codes``, ``grid_step``; pot codes become steps of the smallest power)."""
        fmt = self.weight_format
        codes = np.asarray(fmt.operand_codes(self.weight_codes.numpy().astype(np.int64)), dtype=np.int64)
        scale = self.weight_scale.detach().double().reshape(-1).numpy()
        return codes, scale * fmt.grid_step(self.weight_bits)

    def bias_at(self, s_acc: np.ndarray) -> np.ndarray | None:
        """The quantized bias in units of ``s_acc`` (float64 integers; per channel), the
        int32 bias the graph adds to the accumulator: the codes times ``s_b / s_acc``, exact
        when that ratio is a power of two >= 1, else rounded to nearest.  Export
        (qdsl/export/lower_layers.py) and the fake-quant residual sums (qdsl.patch.residual_sim) read it.
        A float bias (no bias quantizer) is rounded to ``s_acc``; no bias: None."""
        if self.bias_codes is None:
            return None if self.bias_float is None else np.rint(self.bias_float.double().numpy() / s_acc)
        codes = self.bias_codes.numpy().astype(np.float64)
        s_b = np.broadcast_to(self.bias_scale.detach().double().reshape(-1).numpy(), codes.shape)
        exact = codes * (s_b / s_acc)
        return np.where(exact == np.round(exact), exact, np.rint(exact))


def _qp(q) -> tuple[Any, Any]:
    if q is None or q.dynamic:
        return None, None
    return q.scale.clone(), q.zero_point.clone()


def _versions(patch) -> tuple:
    out = []
    for q in (patch.wq, patch.bq, patch.iq, patch.oq):
        # codes and offsets too: learned-rounding codes or a bias correction set after
        # freeze change the record's integers without touching a scale
        for t in (getattr(q, n, None) for n in ("scale", "zero_point", "codes", "offset")):
            out += [id(t), t._version] if isinstance(t, torch.Tensor) else [None, None]
    return tuple(out)


def _build(patch) -> FrozenLayer:
    w, b = patch.float_params()
    wq, bq = patch.wq, patch.bq
    w_int = wq.int_repr(w) if wq is not None and w is not None else None
    b_int = b_scale = None
    if bq is not None and b is not None and bq.frozen:
        b_int, b_scale = bq.int_repr(b), bq.scale.clone()
    in_s, in_z = _qp(patch.iq)
    out_s, out_z = _qp(patch.oq)
    has_w = wq is not None and w is not None
    return FrozenLayer(
        fqn=patch.fqn,
        has_weight=w is not None,
        weight_codes=w_int,
        weight_scale=wq.scale.clone() if has_w else None,
        weight_zero_point=wq.zero_point.clone() if has_w else None,
        weight_format=wq.format if has_w else None,
        weight_bits=int(wq.recipe.bits) if has_w else None,
        weight_signed=bool(int(wq.qmin) < 0) if has_w else None,
        bias_codes=b_int,
        bias_scale=b_scale,
        bias_float=b.detach().clone() if b is not None else None,
        input_scale=in_s,
        input_zero_point=in_z,
        output_scale=out_s,
        output_zero_point=out_z,
        folded_bn=patch.bn_fqn,
    )


def frozen_layer(patch) -> FrozenLayer:
    """The record of one patched layer (see the module doc); the model must be frozen."""
    with torch.no_grad():
        key = patch._cacheable(patch.master("weight"), patch.master("bias"))
        if key is not None:
            key = key + _versions(patch)
            cached = patch.__dict__.get("_frozen_record")
            if cached is not None and cached[0] == key:
                return cached[1]
        record = _build(patch)
    if key is not None:
        patch._frozen_record = (key, record)
    return record

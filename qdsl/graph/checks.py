"""The checks an op's validation rule is written with (:class:`Check`) and the ones
several ops share: an output stage, a rescale, spatial windows, an accumulator.

Every failure is a :class:`~qdsl.graph.schema.GraphFormatError` naming the op (index
and name).  Used by :func:`qdsl.graph.validate.validate_graph` and by each op's
``infer`` rule in :mod:`qdsl.graph.ops`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qdsl.graph.schema import RQ_ATTRS, DType, GraphFormatError, OverflowMode, RescaleKind, Rounding

if TYPE_CHECKING:  # records only; importing qdsl.graph.ir here would be a cycle (ir reads the ops)
    from qdsl.graph.ir import Op, Tensor

__all__ = ["Check", "I32_RANGE", "conv_out_len", "check_rescale", "check_out", "spatial", "check_acc"]

I32_RANGE = (-(2**31), 2**31 - 1)
# the per-input rescale lists (``in_kind``, ...) carry the same fields as one ``rq_`` rescale
_RESCALE_KEYS = tuple(name[len("rq_"):] for name in RQ_ATTRS)


def conv_out_len(n: int, k: int, stride: int, pad: int, dilation: int = 1) -> int:
    """PyTorch's output length (floor mode): ``(n + 2p - d(k-1) - 1) // s + 1``."""
    return (n + 2 * pad - dilation * (k - 1) - 1) // stride + 1


class Check:
    """Error helper bound to one op."""

    def __init__(self, index: int, op: "Op"):
        self.where = f"op {index} ({op.type.name} {op.name!r})"
        self.op = op

    def fail(self, msg: str, hint: str | None = None) -> None:
        raise GraphFormatError(msg, self.where, hint)

    def need(self, cond: bool, msg: str) -> None:
        if not cond:
            self.fail(msg)

    def ints(self, name: str, n: int | tuple[int, ...] | None = None, lo: int | None = None, hi: int | None = None):
        v = self.op.attrs[name]
        if n is not None:
            ns = (n,) if isinstance(n, int) else n
            self.need(len(v) in ns, f"attribute {name!r} must have length {' or '.join(map(str, ns))}, got {len(v)}")
        for x in v:
            self.need((lo is None or x >= lo) and (hi is None or x <= hi), f"attribute {name!r} value {x} out of range [{lo}, {hi}]")
        return v

    def int(self, name: str, lo: int | None = None, hi: int | None = None) -> int:
        x = self.op.attrs[name]
        self.need((lo is None or x >= lo) and (hi is None or x <= hi), f"attribute {name!r} = {x} out of range [{lo}, {hi}]")
        return x

    def dt(self, tensor: "Tensor", allowed, what: str) -> None:
        self.need(tensor.dtype in allowed, f"{what} {tensor.name!r} has dtype {tensor.dtype.name}, expected {'/'.join(d.name for d in allowed)}")

    def const(self, tensor: "Tensor", what: str) -> None:
        self.need(tensor.is_constant, f"{what} {tensor.name!r} must be a constant")

    def act(self, tensor: "Tensor", what: str) -> None:
        self.need(not tensor.is_constant, f"{what} {tensor.name!r} must be an activation, not a constant")


def check_rescale(c: Check, prefix: str, channels: int, per_input: bool = False) -> None:
    """One rescale (``rq_*``) or, with ``per_input``, one per input (``in_*`` lists)."""
    a = c.op.attrs
    if per_input:
        kinds, rounds = a[f"{prefix}kind"], a[f"{prefix}rounding"]
        n = channels
        for key in _RESCALE_KEYS:
            c.ints(f"{prefix}{key}", n)
        triples = zip(kinds, a[f"{prefix}multiplier"], a[f"{prefix}shift"], rounds)
    else:
        kind = c.int(f"{prefix}kind", min(RescaleKind), max(RescaleKind))
        mult = c.ints(f"{prefix}multiplier", (1, channels) if channels > 1 else 1)
        c.ints(f"{prefix}shift", len(mult))
        triples = ((kind, m, s, a[f"{prefix}rounding"]) for m, s in zip(mult, a[f"{prefix}shift"]))
    for kind, m, s, r in triples:
        c.need(kind in tuple(RescaleKind), f"{prefix}kind must be 0 (FIXED), 1 (POT) or 2 (FIXED_SINGLE), got {kind}")
        if kind in (RescaleKind.FIXED, RescaleKind.FIXED_SINGLE):
            c.need(0 <= m <= I32_RANGE[1], f"{prefix}multiplier {m} outside [0, 2^31-1]")
            c.need(-31 <= s <= 31, f"{prefix}shift {s} outside [-31, 31] for FIXED")
            if kind == RescaleKind.FIXED:
                c.need(r == Rounding.HALF_AWAY, f"{prefix}rounding must be 0 (HALF_AWAY) for FIXED, got {r}")
            else:
                c.need(r in tuple(Rounding), f"{prefix}rounding {r} is not a known rounding (0..3)")
        else:
            c.need(m == 1, f"{prefix}multiplier must be 1 for POT, got {m}")
            c.need(-31 <= s <= 62, f"{prefix}shift {s} outside [-31, 62] for POT")
            c.need(r in tuple(Rounding), f"{prefix}rounding {r} is not a known rounding (0..3)")


def check_out(c: Check, dtype: DType, channels: int) -> None:
    """An output stage (``rq_*``, ``out_zp``, ``out_min``, ``out_max``) for ``dtype``."""
    lo, hi = dtype.range
    check_rescale(c, "rq_", channels)
    c.int("out_zp", lo, hi)
    mn, mx = c.int("out_min", lo, hi), c.int("out_max", lo, hi)
    c.need(mn <= mx, f"out_min {mn} > out_max {mx}")


def spatial(c: Check, x: "Tensor", rank: int, kernel: tuple[int, ...], pads_limit: bool) -> tuple[int, ...]:
    """The output spatial dims of a window op (``stride``, ``padding``[, ``dilation``])."""
    a = c.op.attrs
    stride = c.ints("stride", rank, 1, 1 << 20)
    pad = c.ints("padding", rank, 0, 1 << 20)
    dil = c.ints("dilation", rank, 1, 1 << 20) if "dilation" in a else (1,) * rank
    out = []
    for i in range(rank):
        if pads_limit:
            c.need(pad[i] <= kernel[i] // 2, f"padding {pad[i]} exceeds half the kernel {kernel[i]}")
        n = conv_out_len(x.shape[2 + i], kernel[i], stride[i], pad[i], dil[i])
        c.need(n >= 1, f"spatial dim {i} of input {x.shape} is too small for kernel {kernel[i]} (output length {n})")
        out.append(n)
    return tuple(out)


def check_acc(c: Check) -> None:
    c.int("acc_bits", 2, 64)
    c.int("overflow", 0, len(OverflowMode) - 1)

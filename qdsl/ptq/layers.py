"""How the PTQ algorithms see a patched model: its weighted layers in execution order,
float-vs-quantized runs, and per-layer captures that can stop the forward early.

Guarantees: :func:`float_mode` restores every proxy's ``enabled`` flag on exit (also on
error); :func:`capture` removes its hooks on exit; nothing here changes a model's
parameters.  Everything goes through the patch layer's handle
(:func:`qdsl.patch.get_handle`): ``handle.layers`` (``LayerPatch`` per fqn, with
``module``, ``wq``/``bq``/``iq``/``oq`` proxies and ``float_params()``) and
``handle.container.quantizers`` (every proxy).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from qdsl.calibration.batches import batch_call
from qdsl.patch.handle import get_handle
from qdsl.spec.diagnostics import QdslError

__all__ = [
    "WEIGHTED",
    "weighted_layers",
    "float_mode",
    "scales_fixed",
    "run_batches",
    "Calls",
    "float_calls",
    "capture",
    "StopForward",
    "channel_dim",
    "require_batches",
    "rounding_layers",
]

WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d)
"""Layer types the PTQ algorithms correct and round."""


class StopForward(Exception):
    """Raised by a capture hook to end a forward pass once the wanted layer has run."""


def channel_dim(module: nn.Module) -> int:
    """Output channel dimension: last for Linear, 1 (N, C, ...) for convolutions."""
    return -1 if isinstance(module, nn.Linear) else 1


def run_batches(model: nn.Module, batches: Iterable[Any]) -> None:
    """Forward every batch (a tensor, a tuple/list or a kwargs dict, by the rule of
    :mod:`qdsl.calibration.batches`) without gradients; a :class:`StopForward` from a hook
    ends that batch's pass quietly."""
    with torch.no_grad():
        for i, batch in enumerate(batches):
            call = batch_call(model, batch, index=i, what="PTQ")
            try:
                model(*call.args, **call.kwargs)
            except StopForward:
                pass


@dataclasses.dataclass
class Calls:
    """How often a module ran in one forward, and its first positional input on the
    first call (None if called without one)."""

    count: int = 0
    first: Any = None


def float_calls(model: nn.Module, modules: Iterable[tuple[str, nn.Module]], batch: Any) -> dict[str, Calls]:
    """One float forward (:func:`float_mode`) of ``batch``: for each ``(name, module)`` that
    ran, its :class:`Calls`, in the order of their first call.  The hooks are prepended, so
    they see what the caller passed (before the module's own input hook), and are removed
    on exit.  The one float pass the PTQ steps make to learn the execution order, which
    layers read the same tensor, and which blocks run more than once."""
    calls: dict[str, Calls] = {}

    def seen(name: str, args: tuple) -> None:
        c = calls.setdefault(name, Calls(first=args[0] if args else None))
        c.count += 1

    hooks = [m.register_forward_pre_hook(lambda _m, args, name=name: seen(name, args), prepend=True)
             for name, m in modules]
    try:
        with float_mode(model):
            run_batches(model, [batch])
    finally:
        for h in hooks:
            h.remove()
    return calls


def weighted_layers(model: nn.Module, batches: list[Any] | None = None) -> list[tuple[str, Any]]:
    """``[(fqn, LayerPatch)]`` of the patched Linear/Conv layers whose weight is quantized,
    in execution order when ``batches`` is given (one forward of the first batch),
    otherwise in module order."""
    handle = get_handle(model)
    layers = [(f, p) for f, p in handle.layers.items() if isinstance(p.module, WEIGHTED) and p.wq is not None]
    if not batches or len(layers) < 2:
        return layers
    order = float_calls(model, [(f, p.module) for f, p in layers], batches[0])
    rank = {f: i for i, f in enumerate(order)}
    return sorted(layers, key=lambda fp: rank.get(fp[0], len(rank)))


@contextlib.contextmanager
def float_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Run the patched model as its float original (BN folding, if on, still in effect:
    the same function in folded form) by disabling every proxy for the block."""
    proxies = list(get_handle(model).container.quantizers.values())
    saved = [q.enabled for q in proxies]
    for q in proxies:
        q.enabled = False
    try:
        yield model
    finally:
        for q, e in zip(proxies, saved):
            q.enabled = e


@contextlib.contextmanager
def scales_fixed(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, every weight and static activation proxy runs with its scale
    computed once (frozen), then they are unfrozen exactly as they were.

    Why: until ``qdsl.freeze``, a weight proxy re-runs its range search on every forward
    and an activation proxy re-searches its histogram; PTQ steps make one forward per
    layer over the calibration set, and neither the float weights nor the statistics
    change during them, so recomputing would give the same scales ~100× slower.  Derived
    (``input*weight``) biases, dynamic and learned-scale proxies are left alone.
    """
    handle = get_handle(model)
    temp = []
    with torch.no_grad():
        for patch in handle.layers.values():
            w, _b = patch.float_params()
            for role, q in patch.proxies().items():
                if q.frozen or q.derived or q.dynamic or q.learned or role.value == "bias":
                    continue
                if role.value == "weight":
                    if w is None:
                        continue
                    q.freeze(w)
                elif q.calibrated:
                    q.freeze()
                else:
                    continue
                temp.append(q)
    try:
        yield model
    finally:
        for q in temp:
            q.frozen_flag.fill_(False)
            q.scale = torch.empty(0, device=q.scale.device)
            q.zero_point = torch.empty(0, dtype=torch.int32, device=q.zero_point.device)
            q.threshold = torch.empty(0, device=q.threshold.device)
            q._refresh()


@contextlib.contextmanager
def capture(module: nn.Module, fn: Callable[[Any, Any], None], *, stop: bool = False, inputs: bool = False):
    """Call ``fn(input, output)`` after each forward of ``module`` (``output`` is None with
    ``inputs=True``, which hooks before the module runs); ``stop`` ends the pass there."""

    def pre(m, args):
        fn(args[0], None)
        if stop:
            raise StopForward

    def post(m, args, out):
        fn(args[0], out)
        if stop:
            raise StopForward

    h = module.register_forward_pre_hook(pre) if inputs else module.register_forward_hook(post)
    try:
        yield
    finally:
        h.remove()


def require_batches(batches: Iterable[Any], what: str) -> list[Any]:
    out = list(batches)
    if not out:
        raise QdslError(f"{what} needs calibration batches, but the iterable was empty")
    return out


def rounding_layers(model: nn.Module, batches: list[Any], only: Iterable[str] | None,
                    check: Callable[[str, Any], None]) -> list[tuple[str, Any]]:
    """The layers a learned-rounding method rounds: ``weighted_layers`` in execution order,
    just ``only``'s fqns when given, each passed through ``check(fqn, weight_proxy)`` (which
    raises a located QdslError for a weight the method cannot round).  Refuses a frozen model."""
    from qdsl.patch.handle import State

    if get_handle(model).state in (State.FROZEN, State.EXPORTED):
        raise QdslError("learned rounding runs before qdsl.freeze(model): the model is already frozen")
    layers = weighted_layers(model, batches)
    if only is not None:
        wanted = set(only)
        layers = [(f, p) for f, p in layers if f in wanted]
    for fqn, patch in layers:
        check(fqn, patch.wq)
    return layers

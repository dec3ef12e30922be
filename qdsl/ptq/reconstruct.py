"""Block reconstruction with learned rounding (``learned_rounding = adaround``): AdaRound's
soft rounding optimised per block against the float block's output, in the style of
BRECQ (Li et al., 2021) with QDrop's random activation-quantization drop (Wei et al., 2022).

For each block, in execution order (a block is a residual block or a layer with the
BN/activation after it; :func:`find_blocks`):

1. its inputs on the *quantized path* (every block before it already rounded) and the
   float model's output of the same block are collected on the calibration batches;
2. each weight of the block gets a :class:`qdsl.ptq.adaround.SoftRounding` on the grid its
   proxy already uses (the observer's scale and zero point: only the rounding direction
   is learned), swapped in through the proxy's ``grad_path`` hook, so the block runs its
   own modules, hooks and activation quantizers unchanged;
3. Adam minimises ``MSE(block(x), float output) / error before + λ·reg(V)`` over random
   minibatches of the fit batches, ``reg`` annealed so every weight ends on its floor or
   ceiling; during it each activation quantizer of the block (its inputs, outputs, the
   residual sum's) quantizes a random half of the elements and passes the rest (QDrop),
   so the rounding does not over-fit one activation rounding pattern;
4. the hard codes go into the weight proxies (``TensorQuantizer.set_codes``: forward,
   ``int_tensors``, export and the C++ runtime use them), and the block's output error on
   *held-back* batches (:func:`qdsl.ptq.report.split_heldback`) is compared with the
   error before: the new codes stay only if it went down, otherwise the block's previous
   codes come back.  One :class:`qdsl.ptq.report.LayerDecision` per block (named by its
   first weighted layer, step ``"adaround"``) says which.

Cost: one partial float and one partial quantized pass per block (up to the block: as
bias correction and GPTQ here, quadratic in the number of blocks but cheap, inference
only), a held-back check per block, and ``iters``
forward+backward steps of the block alone - over all blocks, ``iters`` forward+backward
steps of the whole model, linear in its size.  Defaults
(``iters=20`` Adam steps of ``lr=0.2`` per block on 64 samples each) are sized for
the repo's small test models under the issue's budget (a few seconds for a whole quantize
call at one thread; measured in ``benchmarks/ptq_reconstruct.py``): each step costs about
what one forward+backward of the block costs, and on these models Python overhead, not
arithmetic, dominates a step, so few big steps beat many small ones.  Raise ``iters`` for
bigger models and more data.
Memory: the block's inputs and float outputs on all calibration batches, one block at a
time.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import attrs
import torch
from torch import nn

from qdsl.patch.handle import get_handle
from qdsl.ptq.adaround import SoftRounding, beta_schedule
from qdsl.ptq.guard import decide
from qdsl.ptq.layers import (
    StopForward, capture, float_calls, float_mode, require_batches, rounding_layers, run_batches, scales_fixed,
)
from qdsl.ptq.report import LayerDecision, PtqReport, split_heldback
from qdsl.spec.diagnostics import QdslError

__all__ = ["STEP", "Block", "find_blocks", "reconstruct"]

STEP = "adaround"
"""The method's name: ``learned_rounding = adaround`` and the report's step."""


@attrs.frozen
class Block:
    """What is reconstructed as one unit: ``modules`` run in order (one module, or a run
    of a Sequential's children), holding the weighted ``layers`` (fqns, execution order)."""

    name: str
    modules: tuple[nn.Module, ...]
    layers: tuple[str, ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.modules:
            x = m(x)
        return x


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def find_blocks(model: nn.Module, layers: list[str], max_layers: int = 3) -> list[Block]:
    """Split ``model`` into blocks that together hold every fqn of ``layers`` once.

    A module holding at most ``max_layers`` of them is one block (a ResNet basic block,
    a Linear); a bigger one is split into its children.  A ``Sequential`` is a chain: its
    children are grouped so each group starts at a child holding weights and takes the
    weightless ones after it (conv, BN, ReLU), so a layer's reconstruction target is its
    activation's output, as in BRECQ; a Sequential that is one group is its own block (its
    own hooks run).  Blocks come in the order of ``layers``."""
    rank = {f: i for i, f in enumerate(layers)}
    modules = dict(model.named_modules())

    def inside(fqn: str) -> list[str]:
        return [f for f in layers if f == fqn or not fqn or f.startswith(fqn + ".")]

    out: list[Block] = []

    def block(names: list[str]) -> None:
        held = sorted({f for n in names for f in inside(n)}, key=rank.__getitem__)
        name = (names[0] or "<model>") if len(names) == 1 else f"{names[0]}..{names[-1].rsplit('.', 1)[-1]}"
        out.append(Block(name, tuple(modules[n] for n in names), tuple(held)))

    def visit(fqn: str) -> None:
        module = modules[fqn]
        n = len(inside(fqn))
        if n == 0:
            return
        children = [_join(fqn, c) for c, _ in module.named_children()]
        if not children or (n <= max_layers and not isinstance(module, nn.Sequential)):
            block([fqn])
            return
        if not isinstance(module, nn.Sequential):
            for c in children:
                visit(c)
            return
        groups: list[list[str]] = [[]]
        for c in children:
            if inside(c) and any(inside(g) for g in groups[-1]):
                groups.append([])
            groups[-1].append(c)
        if len(groups) == 1 and n <= max_layers:
            block([fqn])
            return
        for g in groups:
            k = sum(len(inside(c)) for c in g)
            if k == 0:
                continue
            if k <= max_layers:
                block(g)
            else:
                for c in g:
                    visit(c)

    visit("")
    out.sort(key=lambda b: rank[b.layers[0]])
    return out


def _check(fqn: str, wq: Any) -> None:
    if not wq.format.fixed_codes or not hasattr(wq, "set_codes"):
        raise QdslError(f"learned rounding (adaround): '{fqn}' has a {wq.format.name} weight; it needs an int weight")
    if wq.group_size is not None or wq.axis not in (None, 0):
        raise QdslError(
            f"learned rounding (adaround): '{fqn}' has {'group' if wq.group_size else f'axis-{wq.axis}'} weight "
            "scales; it supports per-tensor and per-output-channel (axis 0) scales"
        )


# --------------------------------------------------------------- collecting data
def _shared_blocks(model: nn.Module, blocks: list[Block], batch: Any) -> set[str]:
    """Blocks whose first module runs more than once in a forward (one float pass)."""
    calls = float_calls(model, [(b.name, b.modules[0]) for b in blocks], batch)
    return {n for n, c in calls.items() if c.count > 1}


def _float_outputs(model: nn.Module, block: Block, batches: list[Any]) -> list[torch.Tensor | None]:
    """The float model's output of ``block`` per batch (None where it did not run); each
    pass stops there, so only one block's targets are held at a time."""
    outs: list[torch.Tensor | None] = []

    def keep(_x, out):
        if isinstance(out, torch.Tensor):
            outs[-1] = out.detach()

    with capture(block.modules[-1], keep, stop=True), float_mode(model):
        for batch in batches:
            outs.append(None)
            run_batches(model, [batch])
    return outs


def _block_inputs(model: nn.Module, block: Block, batches: list[Any]) -> list[torch.Tensor | None] | None:
    """The block's first input per batch on the quantized path (before its own input
    quantizer), or None when it is not called with one tensor."""
    xs: list[torch.Tensor | None] = []
    ok = [True]

    def pre(m, args):
        if len(args) != 1 or not isinstance(args[0], torch.Tensor):
            ok[0] = False
        else:
            xs[-1] = args[0].detach()
        raise StopForward

    h = block.modules[0].register_forward_pre_hook(pre, prepend=True)
    try:
        for batch in batches:
            xs.append(None)
            run_batches(model, [batch])
    finally:
        h.remove()
    return xs if ok[0] else None


# ------------------------------------------------------------- running a block
@contextlib.contextmanager
def _soft_weights(model: nn.Module, patches: list[Any], softs: list[SoftRounding]) -> Iterator[None]:
    """Each weight proxy returns its soft-rounded weight when autograd is on.

    The proxy calls ``grad_path`` only for an input that needs a gradient, so only the
    block's float master weights need one here; every other parameter's flag is off for
    the duration (no ``.grad`` lands on the model), and the soft weight does not depend
    on the master, so no gradient reaches it either.  The layers' accumulator simulation
    is off meanwhile: soft weights are off the integer grid it reads (the held-back check
    after the fit runs with it)."""
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    saved = [p.wq.grad_path for p in patches]
    sims = [p.acc_sim for p in patches if p.acc_sim is not None]
    sim_flags = [sim.enabled for sim in sims]
    try:
        for p in params:
            p.requires_grad_(False)
        for patch, soft in zip(patches, softs):
            patch.master("weight").requires_grad_(True)
            patch.wq.grad_path = lambda q, x, s, z, t, soft=soft: soft()
        for sim in sims:
            sim.enabled = False
        yield
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
        for patch, g in zip(patches, saved):
            patch.wq.grad_path = g
        for sim, f in zip(sims, sim_flags):
            sim.enabled = f


@contextlib.contextmanager
def _qdrop(proxies: list[Any], keep: float, gen: torch.Generator) -> Iterator[None]:
    """Each activation proxy quantizes a random ``keep`` fraction of its elements (a new
    draw per call) and passes the others through; straight-through gradient."""

    def path(q, x, s, z, t):
        fq = q._fake(x.detach(), s.detach(), z, t)
        mask = torch.rand(x.shape, generator=gen) < keep
        return x + (torch.where(mask, fq, x.detach()) - x.detach())

    saved = [q.grad_path for q in proxies]
    try:
        if keep < 1.0:
            for q in proxies:
                q.grad_path = path
        yield
    finally:
        for q, g in zip(proxies, saved):
            q.grad_path = g


def _error(block: Block, xs: torch.Tensor, ys: torch.Tensor, chunk: int = 256) -> float:
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(xs), chunk):
            total += float((block(xs[i : i + chunk]) - ys[i : i + chunk]).pow(2).sum())
    return total / max(ys.numel(), 1)


def _stack(ts: list[torch.Tensor]) -> torch.Tensor | None:
    if not ts or any(t.shape[1:] != ts[0].shape[1:] for t in ts):
        return None
    return torch.cat(ts)


def _activation_proxies(model: nn.Module, block: Block) -> list[Any]:
    handle = get_handle(model)
    mods = {id(m) for b in block.modules for m in b.modules()}
    out = []
    for patch in handle.layers.values():
        if id(patch.module) in mods:
            out += [q for r, q in patch.proxies().items() if not r.is_param and not q.dynamic]
    return out


# ------------------------------------------------------------------------ API
def reconstruct(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    iters: int = 20,
    batch_size: int = 64,
    lr: float = 0.2,
    reg: float = 0.01,
    keep: float = 0.5,
    max_layers: int = 3,
    seed: int = 0,
    report: PtqReport | None = None,
    only: Iterable[str] | None = None,
) -> PtqReport:
    """Learn the weight rounding of a calibrated patched model block by block (module
    docstring); returns the :class:`PtqReport` (``report`` if given, extended) with one
    decision per block.

    ``iters``/``batch_size``/``lr``: Adam steps per block, samples per step, step size on
    the rounding logits; ``reg``: the rounding regulariser's weight λ; ``keep``: the
    fraction of activation elements quantized during the fit (1.0: all, no QDrop);
    ``max_layers``: the most weighted layers one block may hold; ``seed``: minibatches and
    drop masks (the result is deterministic for a given seed and thread count); ``only``:
    reconstruct just the blocks made of these layers (fqns), the others keep their codes."""
    batches = require_batches(batches, "learned rounding (adaround)")
    layers = rounding_layers(model, batches, only, _check)
    report = report if report is not None else PtqReport()
    fit, held = split_heldback(batches)
    data = fit + held
    gen = torch.Generator().manual_seed(seed)
    with scales_fixed(model):
        blocks = find_blocks(model, [f for f, _ in layers], max_layers)
        shared = _shared_blocks(model, blocks, data[0])
        for block in blocks:
            if block.name in shared:
                _skip(report, block, "runs more than once per forward; left as it was")
                continue
            _one_block(model, block, data, len(fit), report, gen,
                       iters=iters, batch_size=batch_size, lr=lr, reg=reg, keep=keep)
    return report


def _skip(report: PtqReport, block: Block, note: str) -> None:
    report.add(LayerDecision(block.layers[0], STEP, False, float("nan"), float("nan"), f"block {block.name}: {note}"))


def _one_block(model, block, data, n_fit, report, gen, *, iters, batch_size, lr, reg, keep) -> None:
    ys = _float_outputs(model, block, data)
    xs = _block_inputs(model, block, data)
    if xs is None:
        return _skip(report, block, "not called with one tensor; left as it was")
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    fit_pairs = [(x, y) for i, (x, y) in enumerate(zip(xs, ys)) if i < n_fit and x is not None and y is not None]
    held_pairs = pairs[len(fit_pairs):] if len(pairs) > len(fit_pairs) else []
    x_fit, y_fit = _stack([x for x, _ in fit_pairs]), _stack([y for _, y in fit_pairs])
    if x_fit is None or y_fit is None:
        return _skip(report, block, "no calibration inputs of one shape reached it; left as it was")
    x_held, y_held = _stack([x for x, _ in held_pairs]), _stack([y for _, y in held_pairs])
    patches = [get_handle(model).layers[f] for f in block.layers]
    previous = [p.wq.codes.clone() for p in patches]
    checked = x_held is not None and y_held is not None
    before = _error(block, x_held, y_held) if checked else float("nan")
    softs = []
    with torch.no_grad():
        for p in patches:
            w, _ = p.float_params()
            if p.wq.offset.numel():
                w = w + p.wq.offset
            scale, zp, _thr = p.wq.qparams(w)
            softs.append(SoftRounding(w, scale, zp, p.wq.qmin, p.wq.qmax, p.wq.axis))
            p.wq.codes = torch.empty(0, dtype=torch.int64)
    # the loss is relative to the error of rounding to nearest on the fit data, so λ
    # weighs the regulariser against "how much is there to gain"
    base = _error(block, x_fit[:256], y_fit[:256]) or 1.0
    opt = torch.optim.Adam([s.v for s in softs], lr=lr)
    n = len(x_fit)
    with _soft_weights(model, patches, softs), _qdrop(_activation_proxies(model, block), keep, gen):
        for step in range(iters):
            idx = torch.randint(n, (min(batch_size, n),), generator=gen)
            x = x_fit[idx]
            if keep < 1.0:
                x.requires_grad_(True)  # so the block's own input quantizer drops too
            with torch.enable_grad():
                loss = (block(x) - y_fit[idx]).pow(2).mean() / base
                beta = beta_schedule(step, iters)
                if beta is not None:
                    loss = loss + reg * sum(s.regulariser(beta) for s in softs) / len(softs)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    moved = 0
    total = 0
    for p, s, old in zip(patches, softs, previous):
        codes = s.hard_codes()
        nearest = p.wq.int_repr(_weight(p)).to(torch.int64)
        moved += int((codes != nearest).sum())
        total += codes.numel()
        p.wq.set_codes(codes)
    after = _error(block, x_held, y_held) if checked else float("nan")

    def undo() -> None:
        for p, old in zip(patches, previous):
            if old.numel():
                p.wq.set_codes(old)
            else:
                p.wq.codes = torch.empty(0, dtype=torch.int64)
                p.refresh_now()

    note = f"block {block.name}: {len(patches)} layer(s), {100.0 * moved / max(total, 1):.1f}% codes off nearest"
    decide(report, block.layers[0], STEP, before, after, undo=undo, note=note)


def _weight(patch: Any) -> torch.Tensor:
    w, _ = patch.float_params()
    return w + patch.wq.offset if patch.wq.offset.numel() else w

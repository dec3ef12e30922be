"""Binary (XNOR-Net style) QAT on real data, exported and run bit-exactly in C++.

What it shows:

1. ``specs/xnor-binary.qspec`` applied to a small CNN trained in float on scikit-learn's
   bundled digits: weights ``α·sign(w)`` (α = mean |w| per output channel), activations
   ``β·sign(x)``; the first and last layers stay 8-bit, BatchNorm is folded.
2. The accuracy right after calibration (binarising a float model wrecks it) and after
   each epoch of a plain Adam QAT loop written against the public API
   (``qdsl.qat.prepare_qat`` trains the folded BatchNorms with batch statistics;
   ``qdsl.qat.freeze_bn_stats`` switches to the inference fold for the last epoch).
3. ``qdsl.freeze`` + ``qdsl.export`` to an integer graph whose binary convolutions are
   XNOR-popcount ops (BCONV2D), saved to and loaded from a ``.qgraph`` file (its size
   beside the float ``state_dict``'s), run with the C++ runtime and compared with the
   Python reference executor (bit for bit) and with the fake-quant model.

The model is :class:`qdsl.zoo.models.ConvBnReluNet` with its ReLUs replaced by
Hardtanh.  The spec's binary activations binarise at a learned per-channel threshold
(``threshold = learned``: +1 where ``x >= t[c]``), so the unmodified ReLU network trains too
(``--activation relu``); with ``sign(x)`` alone (``sign(0) = +1``) every code after a ReLU
would be +1 and the ReLU models stay at chance, ~10%
(benchmarks/binary_threshold_digits.py shows both).

Run: ``python examples/xnor_binary_qat.py [--quick] [--epochs N] [--lr LR] [--activation relu]``.
"""

from __future__ import annotations

import argparse
import copy
import io
import sys
import tempfile
import time
from pathlib import Path

SPEC = Path(__file__).resolve().parent.parent / "specs" / "xnor-binary.qspec"


ACTIVATIONS = ("hardtanh", "relu")


def binary_digits_cnn(width: int = 32, activation: str = "hardtanh"):
    """ConvBnReluNet for 1×8×8 digits with the given activation (``hardtanh`` or ``relu``)."""
    from qdsl.zoo.models import ConvBnReluNet

    return ConvBnReluNet(in_ch=1, width=width, num_classes=10, activation=activation)


def _state_dict_bytes(model) -> int:
    import torch

    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.tell()


def qat(model, data, epochs: int, lr: float, log) -> list[float]:
    """Adam + one-cycle over all epochs; BN statistics frozen for the last epoch.
    Returns the test accuracy after each epoch."""
    import torch
    import torch.nn.functional as F

    import qdsl.qat
    from qdsl.zoo.train import evaluate

    x_train, y_train, x_test, y_test = data
    qdsl.qat.prepare_qat(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    batch = 64
    steps = epochs * ((len(x_train) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    accs = []
    for epoch in range(epochs):
        if epoch == epochs - 1 and epochs > 1:
            # Late in QAT, train exactly the inference forward (Krishnamoorthi 2018 §3.2).
            qdsl.qat.freeze_bn_stats(model)
        model.train()
        perm = torch.randperm(len(x_train), generator=g)
        for i in range(0, len(x_train), batch):
            idx = perm[i : i + batch]
            if len(idx) < 2:  # BatchNorm needs 2+ samples
                continue
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            opt.step()
            sched.step()
        accs.append(evaluate(model, x_test, y_test))
        log(f"  QAT epoch {epoch + 1}/{epochs}: test accuracy {accs[-1] * 100:.2f}%")
    return accs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 QAT epochs (smoke test)")
    parser.add_argument("--epochs", type=int, default=None, help="QAT epochs (default 8, 3 with --quick)")
    parser.add_argument("--lr", type=float, default=5e-3, help="peak QAT learning rate")
    parser.add_argument("--activation", choices=ACTIVATIONS, default="hardtanh",
                        help="relu: the unmodified ReLU network (the learned thresholds make it trainable)")
    parser.add_argument("--spec", default=str(SPEC))
    args = parser.parse_args(argv)
    epochs = args.epochs if args.epochs is not None else (3 if args.quick else 8)

    import numpy as np
    import torch

    import qdsl
    from qdsl import runtime
    from qdsl.zoo.data import digits
    from qdsl.zoo.train import evaluate, predict, train_float

    def log(msg: str) -> None:
        print(msg, flush=True)

    rows: list[tuple[str, str, str]] = []
    data = digits()
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(0)
    t0 = time.perf_counter()
    float_model = train_float(binary_digits_cnn(activation=args.activation), x_train, y_train, epochs=4, lr=0.01, seed=0)
    float_acc = evaluate(float_model, x_test, y_test)
    rows.append(("float", f"{float_acc * 100:.2f}%", f"ConvBnReluNet ({args.activation}), {len(x_test)} test digits, "
                 f"{time.perf_counter() - t0:.1f} s to train (or load from the on-disk cache)"))

    model = copy.deepcopy(float_model)
    handle = qdsl.apply(model, args.spec)
    kinds = {}
    for (fqn, role), q in handle.quantizers().items():
        if role.value == "weight":
            kinds[fqn] = f"{q.kind.value}" if q.kind.value == "binary" else f"int{q.recipe.bits}"
    log("weights: " + ", ".join(f"{k} {v}" for k, v in kinds.items()))
    qdsl.calibrate(model, [x_train[i : i + 128] for i in range(0, 512, 128)], progress=False)
    calib_acc = evaluate(model, x_test, y_test)
    rows.append(("binary, after calibration", f"{calib_acc * 100:.2f}%", "no training yet"))

    t0 = time.perf_counter()
    accs = qat(model, data, epochs, args.lr, log)
    t_qat = time.perf_counter() - t0
    for i, acc in enumerate(accs):
        rows.append((f"QAT epoch {i + 1}", f"{acc * 100:.2f}%",
                     "BN statistics frozen" if i == len(accs) - 1 and len(accs) > 1 else "BN batch statistics"))
    qdsl.freeze(model)
    final_acc = evaluate(model, x_test, y_test)
    rows.append(("binary QAT, frozen", f"{final_acc * 100:.2f}%",
                 f"{epochs} epochs at peak lr {args.lr:g} in {t_qat:.1f} s; {final_acc - float_acc:+.2%} vs float"))

    fq_logits = predict(model, x_test).numpy()
    graph = qdsl.export(model, x_test[:1])
    ops: dict[str, int] = {}
    for op in graph.ops:
        ops[op.type.name] = ops.get(op.type.name, 0) + 1
    log("integer graph ops: " + ", ".join(f"{n}×{k}" for k, n in ops.items()))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "xnor_digits.qgraph"
        qdsl.save_graph(graph, path)
        qgraph_size = path.stat().st_size
        graph = qdsl.load_graph(path)
    float_size = _state_dict_bytes(float_model)
    rows.append((".qgraph size", f"{qgraph_size / 1024:.1f} KiB",
                 f"float state_dict {float_size / 1024:.1f} KiB: {float_size / qgraph_size:.1f}x smaller"))

    xs = x_test.numpy()
    t0 = time.perf_counter()
    ref = np.asarray(qdsl.run_graph(graph, xs, backend="reference"))
    t_ref = time.perf_counter() - t0
    out = ref
    if not runtime.available():
        rows.append(("C++ == reference", "not run", f"runtime not built ({runtime.load_error()}); used the reference"))
    else:
        try:
            t0 = time.perf_counter()
            out = np.asarray(qdsl.run_graph(graph, xs, backend="cpp"))
            t_cpp = time.perf_counter() - t0
            same = bool(np.array_equal(out, ref))
            rows.append(("C++ == reference", "yes (bit-identical)" if same else "NO",
                         f"{len(xs)} images: C++ {t_cpp * 1e3:.1f} ms, Python reference {t_ref * 1e3:.0f} ms"))
        except qdsl.QdslError as err:  # a graph feature this runtime build does not support
            rows.append(("C++ == reference", "NO", f"the runtime rejected the graph: {str(err).splitlines()[0]}"))
    graph_acc = float((out.argmax(1) == y_test.numpy()).mean())
    agree = float((out.argmax(1) == fq_logits.argmax(1)).mean())
    rows.append(("integer graph", f"{graph_acc * 100:.2f}%", f"{len(graph.ops)} ops"))
    rows.append(("integer vs fake-quant", f"{agree * 100:.2f}% same top-1",
                 f"max |Δ logit| {float(np.abs(out - fq_logits).max()):.2e}"))

    print("\n| stage | result | detail |")
    print("|---|---:|---|")
    for stage, result, detail in rows:
        print(f"| {stage} | {result} | {detail} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

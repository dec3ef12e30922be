"""EMBEDDING (opcode 30) and I32 token-id graph inputs (issue 19): the op's semantics
(per-row and per-tensor rescale), out-of-range ids as a clear error in the reference and
in C++ (never a read outside the table), the I32-input rule on load, the lowering of
``nn.Embedding`` with a quantized table, C++ == reference bit for bit, and lint/catalog
agreement."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qdsl
from qdsl.export.values import ExportError
from qdsl.graph import graph_from_bytes, graph_to_bytes
from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, Tensor
from qdsl.graph.ops.embedding import EmbeddingIdError
from qdsl.graph.reference import GraphInputError, execute
from qdsl.graph.requant import make_rescale
from qdsl.spec.diagnostics import QdslError

from .graphs import single_op, stage

rt = pytest.importorskip("qdsl.runtime")
needs_cpp = pytest.mark.skipif(not rt.available(), reason="C++ runtime not built")
BACKENDS = ("reference",) + (("cpp",) if rt.available() else ())

SPEC = """version 1
quantizer w8 = int(bits=8, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer wt = int(bits=8, signed, narrow, symmetric, per_tensor, observer=minmax)
quantizer w4 = int(bits=4, signed, narrow, symmetric, per_channel, observer=minmax)
quantizer a8 = int(bits=8, unsigned, asymmetric, per_tensor, observer=minmax)
defaults {
  weight = w8
  input = a8
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
"""


def _table_graph(rows=7, dim=5, per_row=True, seed=0, w_dtype=DType.I8, w_zp=0):
    rng = np.random.default_rng(seed)
    lo, hi = w_dtype.range
    table = Tensor("table", w_dtype, (rows, dim), rng.integers(lo, hi + 1, size=(rows, dim)))
    factors = rng.uniform(0.01, 0.9, size=rows) if per_row else [0.37]
    a = {"w_zp": w_zp, **stage(rescale=make_rescale(np.asarray(factors)), zp=3)}
    return single_op(OpType.EMBEDDING, [("ids", DType.I32, (-1, 4))], a, DType.I8, consts=[table], name="emb"), factors


@pytest.mark.parametrize("per_row", [True, False])
def test_reference_semantics_is_the_rescaled_row(per_row):
    g, factors = _table_graph(per_row=per_row, w_dtype=DType.U8, w_zp=120)
    table = g.tensor("table").data.astype(np.int64)
    ids = np.array([[0, 6, 3, 3], [1, 2, 5, 0]])
    y = execute(g, ids).outputs[0]
    assert y.shape == (2, 4, 5) and y.dtype == np.int8
    f = np.asarray(factors if per_row else factors * 7)
    want = np.clip(np.round((table[ids] - 120) * f[ids][..., None]) + 3, -128, 127)
    assert np.abs(y.astype(np.int64) - want).max() <= 1  # the int32 multiplier vs the real factor


@needs_cpp
@pytest.mark.parametrize("per_row", [True, False])
def test_cpp_equals_reference(per_row):
    g, _ = _table_graph(rows=300, dim=33, per_row=per_row)
    g = graph_from_bytes(graph_to_bytes(g))
    rng = np.random.default_rng(1)
    for batch in (1, 5):
        ids = rng.integers(0, 300, size=(batch, 4))
        np.testing.assert_array_equal(qdsl.run_graph(g, ids, backend="cpp"), execute(g, ids).outputs[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [7, -1, 2**31 - 1])
def test_out_of_range_ids_are_a_clear_error(backend, bad):
    g, _ = _table_graph()
    ids = np.zeros((2, 4), dtype=np.int64)
    ids[1, 2] = bad
    with pytest.raises(QdslError, match=rf"EMBEDDING 'emb': token id {bad} at .*outside \[0, 7\)") as err:
        qdsl.run_graph(g, ids, backend=backend)
    if backend == "reference":
        assert isinstance(err.value, EmbeddingIdError) and "index [1, 2]" in str(err.value)
    else:
        assert "flat index 6" in str(err.value)
    ok = qdsl.run_graph(g, np.zeros((2, 4), dtype=np.int32), backend=backend)  # the graph still runs
    assert ok.shape == (2, 4, 5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_must_be_int32_integers(backend):
    g, _ = _table_graph()
    with pytest.raises(GraphInputError, match="values must be in"):
        qdsl.run_graph(g, np.full((1, 4), 2**31, dtype=np.int64), backend=backend)
    with pytest.raises(GraphInputError, match="integers"):
        qdsl.run_graph(g, np.zeros((1, 4), dtype=np.float32), backend=backend)


def test_only_embedding_reads_an_i32_input(monkeypatch):
    # an I32 graph input read by another op would be taken for an accumulator
    g = IntegerGraph(
        [Tensor("ids", DType.I32, (-1, 4)), Tensor("y", DType.I8, (-1, 4))], ["ids"], ["y"],
        [Op(OpType.REQUANTIZE, "rq", ["ids"], ["y"], {"in_zp": 0, **stage()})])
    with pytest.raises(GraphFormatError, match="I32 graph input \\(token ids\\), which only EMBEDDING reads"):
        g.validate()
    if rt.available():  # the C++ loader refuses it too (bytes written without the Python check)
        import qdsl.graph.qgraph as qgraph

        monkeypatch.setattr(qgraph, "validate_graph", lambda graph: None)
        data = qgraph.graph_to_bytes(g)
        monkeypatch.undo()
        with pytest.raises(GraphFormatError, match="only EMBEDDING reads"):
            rt.CompiledGraph(data)


def test_table_must_be_a_constant_matrix():
    with pytest.raises(GraphFormatError, match="must be \\[V, D\\]"):
        single_op(OpType.EMBEDDING, [("ids", DType.I32, (-1, 4))], {"w_zp": 0, **stage()}, DType.I8,
                  consts=[Tensor("table", DType.I8, (7,), np.zeros(7, dtype=np.int8))])
    with pytest.raises(GraphFormatError, match="rq_multiplier.*length"):
        single_op(OpType.EMBEDDING, [("ids", DType.I32, (-1, 4))],
                  {"w_zp": 0, **stage(rescale=make_rescale(np.full(3, 0.5)))}, DType.I8,
                  consts=[Tensor("table", DType.I8, (7, 2), np.zeros((7, 2), dtype=np.int8))])


# ---------------------------------------------------------------- lowering nn.Embedding
class Bag(nn.Module):
    """Token ids -> embedding -> flatten -> linear."""

    def __init__(self, vocab=50, dim=8, length=5, **kw):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, **kw)
        self.fc = nn.Linear(length * dim, 3)

    def forward(self, ids):
        return self.fc(self.emb(ids).flatten(1))


class IdsAndFeatures(nn.Module):
    """Two inputs: token ids and float features; the two branches are added."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 4)
        self.fc = nn.Linear(5 * 4, 3)
        self.side = nn.Linear(6, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, ids, x):
        return self.head(torch.relu(self.fc(self.emb(ids).flatten(1)) + self.side(x)))


def _spec(tmp_path, rule="rule type:Embedding { weight = w8 }"):
    p = tmp_path / "emb.qspec"
    p.write_text(SPEC + rule + "\n")
    return str(p)


def _frozen(model, spec, example):
    torch.manual_seed(0)
    qdsl.apply(model, spec)
    qdsl.calibrate(model, [example])
    qdsl.freeze(model)
    with torch.no_grad():
        ref = model(*example) if isinstance(example, tuple) else model(example)
    return ref


def _ids(n=32, vocab=50, length=5, seed=0):
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("weight", ["w8", "wt", "w4"])
def test_embedding_exports_and_agrees_with_fake_quant(tmp_path, weight):
    torch.manual_seed(0)
    model = Bag().eval()
    ids = _ids()
    ref = _frozen(model, _spec(tmp_path, f"rule type:Embedding {{ weight = {weight} }}"), ids)
    g = qdsl.export(model, ids)
    assert g.tensor(g.inputs[0]).dtype is DType.I32
    assert [op.type for op in g.ops][0] is OpType.EMBEDDING
    emb = g.ops[0]
    assert len(emb.attrs["rq_multiplier"]) == (1 if weight == "wt" else 50)  # per-row factors
    y = qdsl.run_graph(g, ids, backend="reference")
    cos = float(F.cosine_similarity(torch.as_tensor(y).flatten(), ref.flatten(), 0))
    assert cos >= 0.999
    if rt.available():
        for batch in (1, 7, 32):
            np.testing.assert_array_equal(qdsl.run_graph(g, ids[:batch], backend="cpp"),
                                          qdsl.run_graph(g, ids[:batch], backend="reference"))


def test_fake_quant_and_graph_codes_agree(tmp_path):
    # the codes the linear reads: the embedding's rows requantized once to fc's input grid
    torch.manual_seed(0)
    model = Bag().eval()
    ids = _ids()
    _frozen(model, _spec(tmp_path), ids)
    from qdsl.graph.reference import execute as run
    from qdsl.patch.handle import get_handle

    q = get_handle(model).quantizer("fc", "input")
    with torch.no_grad():
        x = model.emb(ids).flatten(1)  # the fake-quantized table's rows (the patched weight)
        want = torch.clamp(torch.round(x / q.scale) + q.zero_point, q.qmin, q.qmax).to(torch.int64)
    g = qdsl.export(model, ids)
    got = run(g, ids, keep_values=True).values[g.ops[1].outputs[0]]  # after the RESHAPE
    diff = np.abs(got - want.numpy())
    assert diff.max() <= 1 and (diff > 0).mean() <= 0.01


def test_ids_and_float_inputs_together(tmp_path):
    torch.manual_seed(0)
    model = IdsAndFeatures().eval()
    ids, x = _ids(vocab=30), torch.randn(32, 6)
    ref = _frozen(model, _spec(tmp_path), (ids, x))
    g = qdsl.export(model, (ids, x))
    assert [g.tensor(n).dtype for n in g.inputs] == [DType.I32, DType.F32]
    y = qdsl.run_graph(g, {"ids": ids, "x": x}, backend="reference")["output"]
    assert float(F.cosine_similarity(torch.as_tensor(y).flatten(), ref.flatten(), 0)) >= 0.99
    if rt.available():
        np.testing.assert_array_equal(qdsl.run_graph(g, (ids, x), backend="cpp"), y)


def test_an_unquantized_table_is_an_export_error(tmp_path):
    model = Bag().eval()
    ids = _ids()
    _frozen(model, _spec(tmp_path, ""), ids)  # no rule for type:Embedding: defaults skip it
    with pytest.raises(ExportError, match=r"'emb'.*left in float.*\n.*rule type:Embedding"):
        qdsl.export(model, ids)


def test_max_norm_is_an_export_error(tmp_path):
    model = Bag(max_norm=1.0).eval()
    ids = _ids()
    _frozen(model, _spec(tmp_path), ids)
    with pytest.raises(ExportError, match="'emb'.*max_norm"):
        qdsl.export(model, ids)


def test_functional_embedding_on_a_module_weight_is_an_export_error(tmp_path):
    class Functional(Bag):
        def forward(self, ids):
            return self.fc(F.embedding(ids, self.emb.weight).flatten(1))

    model = Functional().eval()
    ids = _ids()
    with pytest.warns(qdsl.QdslWarning if hasattr(qdsl, "QdslWarning") else UserWarning):
        _frozen(model, _spec(tmp_path), ids)
    with pytest.raises(ExportError, match=r"emb.weight(.|\n)*call the nn.Embedding module"):
        qdsl.export(model, ids)


def test_lint_and_export_agree_on_embeddings(tmp_path):
    spec = _spec(tmp_path)
    lowered = [d for d in qdsl.lint(spec, "specs/hw/tflite-int8.toml", Bag()) if d.code == "W321"]
    assert lowered == []  # nn.Embedding lowers: lint names nothing export refuses

    class Functional(Bag):
        def forward(self, ids):
            return self.fc(F.embedding(ids, self.emb.weight).flatten(1))

    found = [d for d in qdsl.lint(spec, "specs/hw/tflite-int8.toml", Functional()) if d.code == "W321"]
    assert len(found) == 1 and "'embedding' has no integer lowering" in found[0].message


def test_onnx_gathers_the_dequantized_table(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from qdsl.export.onnx import export_onnx

    ids = _ids()
    graphs = []
    for _ in range(2):  # export marks a model EXPORTED: the same weights, applied twice
        torch.manual_seed(0)
        model = Bag().eval()
        _frozen(model, _spec(tmp_path), ids)
        graphs.append(model)
    g = qdsl.export(graphs[0], ids)
    proto = export_onnx(graphs[1], ids)
    assert "Gather" in {n.op_type for n in proto.graph.node}
    basic = ort.SessionOptions()
    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(proto.SerializeToString(), basic)
    (y,) = sess.run(None, {"input": ids.numpy().astype(np.int32)})
    want = execute(g, ids).outputs[0]
    assert np.abs(y - want).max() <= 0.02 * np.abs(want).max()


class TokenAndPosition(nn.Module):
    """BERT-style: token and position embeddings added (two id inputs)."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(50, 8), nn.Embedding(5, 8)
        self.fc = nn.Linear(5 * 8, 3)

    def forward(self, ids, pos):
        return self.fc((self.tok(ids) + self.pos(pos)).flatten(1))


def test_token_plus_position_embeddings(tmp_path):
    torch.manual_seed(0)
    model = TokenAndPosition().eval()
    ids, pos = _ids(), torch.arange(5).repeat(32, 1)
    ref = _frozen(model, _spec(tmp_path), (ids, pos))
    g = qdsl.export(model, (ids, pos))
    assert [op.type.name for op in g.ops][:3] == ["EMBEDDING", "EMBEDDING", "ADD"]
    y = qdsl.run_graph(g, (ids, pos), backend="reference")
    assert float(F.cosine_similarity(torch.as_tensor(y).flatten(), ref.flatten(), 0)) >= 0.99
    if rt.available():
        np.testing.assert_array_equal(qdsl.run_graph(g, (ids, pos), backend="cpp"), y)


def test_a_profile_can_list_embedding(tmp_path):
    spec = _spec(tmp_path)
    text = open("specs/hw/tflite-int8.toml").read()
    assert 'ops = ["conv1d",' in text
    prof = tmp_path / "with-embedding.toml"
    prof.write_text(text.replace('ops = ["conv1d",', 'ops = ["embedding", "conv1d",'))
    codes = lambda p: {(d.code, "embedding" in d.message) for d in qdsl.lint(spec, str(p), Bag())}  # noqa: E731
    assert ("E310", True) in codes("specs/hw/tflite-int8.toml")
    assert ("E310", True) not in codes(prof)

"""Graphs with several inputs and outputs (issue 19): ``export(model, (x, mask))`` or a dict
of keyword inputs, models returning tuples or dicts, ``run_graph`` taking a tuple or a dict
(and giving a dict back for a dict), in the reference executor, the C++ runtime (bit for
bit), a saved ``.qgraph``, ONNX and ``qdsl run``; bad inputs are located errors."""

import numpy as np
import pytest
import torch
from torch import nn

import qdsl
from qdsl.cli.main import main
from qdsl.export.values import ExportError
from qdsl.graph import graph_from_bytes, graph_to_bytes, save_graph
from qdsl.graph.reference import GraphInputError, execute

SPEC = "specs/int8-default.qspec"
rt = pytest.importorskip("qdsl.runtime")
needs_cpp = pytest.mark.skipif(not rt.available(), reason="C++ runtime not built")


class AddMask(nn.Module):
    """Two inputs (x, a float mask projected and added), two outputs (a tuple)."""

    def __init__(self):
        super().__init__()
        self.a, self.m, self.b, self.c = nn.Linear(6, 5), nn.Linear(5, 5), nn.Linear(5, 4), nn.Linear(6, 3)

    def forward(self, x, mask):
        h = self.a(x) + self.m(mask)
        return self.b(torch.relu(h)), self.c(x)


class MulMask(nn.Module):
    """Keyword inputs, a product of two activations, an optional input left out, a dict result."""

    def __init__(self):
        super().__init__()
        self.a, self.g, self.b = nn.Linear(6, 5), nn.Linear(5, 5), nn.Linear(5, 4)

    def forward(self, x, mask, bias=None):
        g = self.g(mask)
        y = self.b(self.a(x) * g)
        if bias is not None:  # specialized away: the example gives no bias
            y = y + bias
        return {"y": y, "g": g}


def _data(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), (torch.rand(n, 5, generator=g) > 0.3).float()


def _exported(cls, example):
    torch.manual_seed(0)
    model = cls().eval()
    qdsl.apply(model, SPEC)
    qdsl.calibrate(model, [example])
    qdsl.freeze(model)
    with torch.no_grad():
        ref = model(*example) if isinstance(example, tuple) else model(**example)
    return model, qdsl.export(model, example), ref


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a).flatten(), b.flatten(), 0))


def test_tuple_inputs_and_outputs():
    # before: export raised "models with more than one input are not supported"
    x, mask = _data()
    _, g, ref = _exported(AddMask, (x, mask))
    assert g.inputs == ("x", "mask") and g.outputs == ("output", "output1")
    out = qdsl.run_graph(g, (x, mask), backend="reference")
    assert isinstance(out, tuple) and len(out) == 2
    assert min(_cos(o, r) for o, r in zip(out, ref)) >= 0.99
    keyed = qdsl.run_graph(g, {"mask": mask, "x": x}, backend="reference")
    assert list(keyed) == ["output", "output1"]
    assert all(np.array_equal(keyed[k], o) for k, o in zip(keyed, out))


def test_dict_inputs_and_outputs_and_a_specialized_default():
    x, mask = _data()
    _, g, ref = _exported(MulMask, {"mask": mask, "x": x})
    assert g.inputs == ("x", "mask")  # forward's order, whatever the dict's; no 'bias' input
    assert g.outputs == ("y", "g")  # the dict's keys (a layer output named 'g' yields the name)
    assert "MUL" in {op.type.name for op in g.ops}
    out = qdsl.run_graph(g, {"x": x, "mask": mask}, backend="reference")
    assert list(out) == ["y", "g"]
    assert _cos(out["y"], ref["y"]) >= 0.99 and _cos(out["g"], ref["g"]) >= 0.99


@needs_cpp
@pytest.mark.parametrize("cls, kwargs", [(AddMask, False), (MulMask, True)])
def test_cpp_equals_reference_bit_for_bit(cls, kwargs):
    x, mask = _data()
    _, g, _ = _exported(cls, {"x": x, "mask": mask} if kwargs else (x, mask))
    g = graph_from_bytes(graph_to_bytes(g))  # through the file format's input/output tables
    for batch in (1, 7, 16):
        xs = _data(batch, seed=batch)
        ref = execute(g, xs).outputs
        cpp = qdsl.run_graph(g, xs, backend="cpp")
        assert len(cpp) == len(ref) == 2
        for a, b in zip(ref, cpp):
            np.testing.assert_array_equal(a, b)
        keyed = rt.CompiledGraph(g).run({"x": xs[0], "mask": xs[1]})
        assert list(keyed) == list(g.outputs)


def test_bad_graph_inputs_are_located():
    x, mask = _data()
    _, g, _ = _exported(AddMask, (x, mask))
    for backend in ("reference",) + (("cpp",) if rt.available() else ()):
        with pytest.raises(GraphInputError, match=r"takes 2 input\(s\) \('x', 'mask'\), got 1"):
            qdsl.run_graph(g, x, backend=backend)
        with pytest.raises(GraphInputError, match=r"unknown input\(s\) 'maks'.*did you mean 'mask'.*missing 'mask'"):
            qdsl.run_graph(g, {"x": x, "maks": mask}, backend=backend)
        with pytest.raises(GraphInputError, match="input 'mask' expects shape"):
            qdsl.run_graph(g, (x, mask[:, :4]), backend=backend)
        with pytest.raises(GraphInputError, match="same batch size"):
            qdsl.run_graph(g, (x, mask[:3]), backend=backend)


def test_export_errors_name_the_problem():
    x, mask = _data()
    model, _, _ = _exported(AddMask, (x, mask))
    with pytest.raises(ExportError, match=r"does not fit AddMask.forward\(x, mask\).*missing a required argument"):
        qdsl.export(model, (x,))
    with pytest.raises(ExportError, match="unexpected keyword"):
        qdsl.export(model, {"x": x, "mask": mask, "other": x})


def test_output_named_like_an_input_is_an_export_error():
    class Echo(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.m = nn.Linear(6, 3), nn.Linear(5, 5)

        def forward(self, x, mask):
            return {"x": self.c(x), "m": self.m(mask)}

    x, mask = _data()
    torch.manual_seed(0)
    model = Echo().eval()
    qdsl.apply(model, SPEC)
    qdsl.calibrate(model, [(x, mask)])
    qdsl.freeze(model)
    with pytest.raises(ExportError, match="output.*named 'x'.*input names"):
        qdsl.export(model, (x, mask))


def test_cli_run_takes_several_inputs(tmp_path, capsys):
    x, mask = _data()
    _, g, _ = _exported(AddMask, (x, mask))
    path = tmp_path / "g.qgraph"
    save_graph(g, path)
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "m.npy", mask.numpy())
    np.savez(tmp_path / "in.npz", x=x.numpy(), mask=mask.numpy())
    want = execute(g, (x, mask)).outputs
    for i, inputs in enumerate([["-i", str(tmp_path / "x.npy"), "-i", str(tmp_path / "m.npy")],
                                ["-i", f"mask={tmp_path / 'm.npy'}", "-i", f"x={tmp_path / 'x.npy'}"],
                                ["-i", str(tmp_path / "in.npz")]]):
        out = tmp_path / f"y{i}.npz"
        assert main(["run", str(path), *inputs, "-o", str(out), "--backend", "reference"]) == 0
        with np.load(out) as z:
            assert list(z.files) == ["output", "output1"]
            for k, w in zip(z.files, want):
                np.testing.assert_array_equal(z[k], w)
    assert main(["run", str(path), "-i", str(tmp_path / "x.npy")]) == 2
    assert "takes 2 input(s) (x, mask), got 1" in capsys.readouterr().err
    assert main(["run", str(path), "-i", f"x={tmp_path / 'x.npy'}", "-i", str(tmp_path / "m.npy")]) == 2
    assert "by name" in capsys.readouterr().err


def test_onnx_export_keeps_the_inputs_and_output_names(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from qdsl.export.onnx import export_onnx

    x, mask = _data()
    _, g, _ = _exported(MulMask, {"x": x, "mask": mask})
    torch.manual_seed(0)
    model = MulMask().eval()  # the same weights, applied and calibrated again (export marks a model EXPORTED)
    qdsl.apply(model, SPEC)
    qdsl.calibrate(model, [{"x": x, "mask": mask}])
    qdsl.freeze(model)
    proto = export_onnx(model, {"x": x, "mask": mask})
    basic = ort.SessionOptions()  # no fusions: onnxruntime's QDQ fusions round differently
    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(proto.SerializeToString(), basic)
    assert [i.name for i in sess.get_inputs()] == ["x", "mask"]
    assert [o.name for o in sess.get_outputs()] == ["y", "g"]
    got = sess.run(None, {"x": x.numpy(), "mask": mask.numpy()})
    want = execute(g, (x, mask)).outputs
    for a, b in zip(got, want):
        assert np.abs(a - b).max() <= 0.02 * np.abs(b).max()


def test_forward_with_unused_kwargs_and_varargs():
    class KwArgs(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x, **kwargs):  # before: an IndexError (fx's placeholder for **kwargs)
            return self.fc(x)

    class VarArgs(KwArgs):
        def forward(self, *args):
            return self.fc(args[0])

    x, _ = _data()
    for cls in (KwArgs, VarArgs):
        torch.manual_seed(0)
        model = cls().eval()
        qdsl.apply(model, SPEC)
        qdsl.calibrate(model, [x])
        qdsl.freeze(model)
        if cls is KwArgs:
            assert qdsl.export(model, x).inputs == ("input",)
        else:
            with pytest.raises(ExportError, match=r"takes \*args/\*\*kwargs \(args\)"):
                qdsl.export(model, x)

"""Non-finite inputs: one policy for fake quantization, the reference executor and the C++
runtime (docs/qgraph.md §4.4): NaN -> the zero point's code, +inf -> qmax, -inf -> qmin.
The same input with NaN, +inf and -inf gives identical codes and outputs in all three, and
each one's ``check_finite`` option raises a NonFiniteError (a QdslError) instead.

Also here: half-precision torch tensors and an empty batch through both backends."""

import numpy as np
import pytest
import torch

import qdsl
from qdsl.export import export
from qdsl.graph import execute
from qdsl.runtime.run import run_graph
from qdsl.graph.ir import OpType
from qdsl.parse import parse_text
from qdsl.patch import get_handle
from qdsl.spec.diagnostics import NonFiniteError, QdslError
from qdsl.zoo.data import digits
from qdsl.zoo.models import digits_resnet

try:
    import qdsl.runtime as rt

    CPP = rt.available()
except ImportError:  # the runtime package is optional
    CPP = False
PATHS = ["auto"] + ([p for p in ("ref", "portable", "avx2", "avxvnni", "avx512", "amx")
                     if p in rt.kernels.paths()["cpu"]] if CPP else [])

needs_cpp = pytest.mark.skipif(not CPP, reason="C++ runtime not built")

# power-of-two scales: the integer graph equals the fake-quant model bit for bit; the
# asymmetric input quantizer puts the zero point away from 0 so "NaN -> zero point" shows.
SPEC = """
version 1
fold_bn
quantizer w = int(bits=8, signed, narrow, symmetric, scale=pot, per_channel, observer=minmax)
quantizer a = int(bits=8, signed, symmetric, scale=pot, per_tensor, observer=minmax)
quantizer ain = int(bits=8, unsigned, asymmetric, scale=pot, per_tensor, observer=minmax)
defaults {
  weight = w
  input = a
  bias = int(bits=32, signed, symmetric, scale=input*weight)
}
rule stem.0 { input = ain }
rule type:BasicBlock optional { output = a }
rule fc { output = a }
"""


def _inputs(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, 0, 0, 0] = float("nan")
    x[1, 0, 3, 3] = float("inf")
    x[2, 0, 5, 1] = -float("inf")
    x[3] = float("nan")
    x[4] = float("inf")
    x[5] = -float("inf")
    x[6, 0, ::2] = float("nan")
    x[6, 0, 1::2] = float("inf")
    x[7, 0, :4] = 3e38  # finite, but x * (1/scale) overflows binary32: clamps like ±inf
    x[7, 0, 4:] = -3e38
    return x


@pytest.fixture(scope="module")
def setup():
    xtr, _, xte, _ = digits()
    model = digits_resnet(seed=0).eval()
    qdsl.apply(model, parse_text(SPEC, "nonfinite.qspec"))
    qdsl.calibrate(model, [xtr[:256] - 0.3])
    qdsl.freeze(model)
    graph = export(model, xte[:2])
    return model, graph, _inputs(xte[:16] - 0.3)


def test_input_codes_follow_the_policy(setup):
    model, graph, x = setup
    iq = get_handle(model).quantizer("stem.0", "input")
    zp, qmin, qmax = int(iq.zero_point), iq.qmin, iq.qmax
    assert zp != 0
    codes = iq.int_repr(x).to(torch.int64)
    assert int(codes[0, 0, 0, 0]) == zp and (codes[3] == zp).all()
    assert int(codes[1, 0, 3, 3]) == qmax and (codes[4] == qmax).all()
    assert int(codes[2, 0, 5, 1]) == qmin and (codes[5] == qmin).all()
    assert (codes[7, 0, :4] == qmax).all() and (codes[7, 0, 4:] == qmin).all()
    fq = iq(x)
    assert bool(torch.isfinite(fq).all()) and (fq[3] == 0).all()
    q_op = next(op for op in graph.ops if op.type is OpType.QUANTIZE)
    ref_codes = execute(graph, x.numpy(), keep_values=True).values[q_op.outputs[0]]
    np.testing.assert_array_equal(ref_codes, codes.numpy())


def _fake_quant(model, x):
    with torch.no_grad():
        return model(x).numpy()


def test_fake_quant_and_reference_agree_bit_for_bit(setup):
    model, graph, x = setup
    fq = _fake_quant(model, x)
    ref = execute(graph, x.numpy()).outputs[0]
    assert np.isfinite(fq).all()
    np.testing.assert_array_equal(ref, fq)


@needs_cpp
@pytest.mark.parametrize("path", PATHS)
def test_cpp_agrees_with_reference_and_fake_quant(setup, path):
    model, graph, x = setup
    ref = execute(graph, x.numpy()).outputs[0]
    got = rt.CompiledGraph(graph).run(x.numpy(), path=path)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(got, _fake_quant(model, x))


def test_check_finite_raises_in_fake_quant(setup):
    _, _, x = setup
    model = digits_resnet(seed=0).eval()
    qdsl.apply(model, parse_text(SPEC, "nonfinite.qspec"), check_finite=True)
    xtr = digits()[0][:64]
    with pytest.raises(NonFiniteError, match="stem.0:input"):
        qdsl.calibrate(model, [x])
    qdsl.calibrate(model, [xtr])
    qdsl.freeze(model)
    model(xtr)  # finite: fine
    with pytest.raises(NonFiniteError, match="stem.0:input"):
        model(x)
    assert issubclass(NonFiniteError, QdslError)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
def test_check_finite_raises_in_both_backends(setup, backend):
    _, graph, x = setup
    finite = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    run_graph(graph, finite, backend=backend, check_finite=True)
    with pytest.raises(NonFiniteError, match="non-finite"):
        run_graph(graph, x, backend=backend, check_finite=True)
    with pytest.raises(NonFiniteError):
        if backend == "cpp":
            rt.CompiledGraph(graph).run(x.numpy(), check_finite=True)
        else:
            execute(graph, x.numpy(), check_finite=True)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_tensor_input_runs_as_its_float32_value(setup, backend, dtype):
    _, graph, x = setup
    xh = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0).to(dtype)
    got = run_graph(graph, xh, backend=backend)
    np.testing.assert_array_equal(got, run_graph(graph, xh.float().numpy(), backend="reference"))


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpp", marks=needs_cpp)])
def test_empty_batch_gives_empty_output(setup, backend):
    _, graph, x = setup
    out = run_graph(graph, x[:0].numpy(), backend=backend)
    assert out.shape == (0, 10) and out.dtype == np.float32
    res = execute(graph, x[:0].numpy(), keep_values=True)
    assert all(v.shape[0] == 0 for v in res.values.values())
    assert set(res.overflow.values()) <= {0}


def test_binary_and_ternary_codes_of_non_finite_values():
    from qdsl.graph.reference import binarize
    from qdsl.quantizers import functional as F

    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.5])
    assert F.binary_codes(x).tolist() == [1, 1, -1, 1, -1]
    assert binarize(x.numpy(), {"zero_point": 0}).tolist() == [1, 1, -1, 1, -1]
    assert F.fake_quant_binary(x, torch.tensor(0.5)).tolist() == [0.5, 0.5, -0.5, 0.5, -0.5]
    assert F.ternary_codes(x, torch.tensor(0.25)).tolist() == [0, 1, -1, 0, -1]


def test_calibration_leaves_non_finite_values_out_of_the_statistics():
    from qdsl.quantizers.observers import MeanAbsObserver, _ctx

    xtr = digits()[0][:256] - 0.3
    bad, zero = xtr.clone(), xtr.clone()
    bad[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    zero[0, 0, 0, :3] = 0.0  # inside the finite range: minmax statistics ignore it too
    scales = []
    for x in (bad, zero):
        model = digits_resnet(seed=0).eval()
        qdsl.apply(model, parse_text(SPEC, "nonfinite.qspec"))
        qdsl.calibrate(model, [x])
        qdsl.freeze(model)
        scales.append({k: (q.scale.clone(), q.zero_point.clone())
                       for k, q in get_handle(model).container.quantizers.items()})
    assert scales[0].keys() == scales[1].keys()
    for k in scales[0]:
        assert bool(torch.isfinite(scales[0][k][0]).all()), k
        assert torch.equal(scales[0][k][0], scales[1][k][0]) and torch.equal(scales[0][k][1], scales[1][k][1]), k
    obs = MeanAbsObserver(None, _ctx())
    obs(torch.tensor([1.0, -3.0, float("nan"), float("inf")]))
    assert [t.item() for t in obs.range()] == [-2.0, 2.0]

"""MAXPOOL1D/2D on BIN (±1) tensors: the reference and every C++ path agree bit for bit with
torch's max pool of the ±1 values (+1 iff a tap inside the input is +1: padding never wins),
over random bit patterns, odd sizes, strides, dilations and padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as tF

from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, Tensor
from qdsl.graph.reference import execute
from qdsl.graph.validate import infer_output
from tests.runtime.test_graph import _check


def _bin_pool_graph(op_type, spatial, attrs, out_dtype=DType.BIN):
    """int8 ±1 input -> BINARIZE (graph inputs cannot be BIN) -> the pool."""
    shape = (-1, 3, *spatial)
    x, b = Tensor("x", DType.I8, shape), Tensor("b", DType.BIN, shape)
    op = Op(op_type, "pool", ["b"], ["y"], attrs)
    _, out_shape = infer_output(1, op, [b], Tensor("y", out_dtype, (1,)))
    ops = [Op(OpType.BINARIZE, "sign", ["x"], ["b"], {"zero_point": 0}), op]
    return IntegerGraph([x, b, Tensor("y", out_dtype, out_shape)], ["x"], ["y"], ops).validate()


def _torch_max(x: np.ndarray, a) -> np.ndarray:
    fn = tF.max_pool1d if x.ndim == 3 else tF.max_pool2d
    y = fn(torch.from_numpy(x.astype(np.float32)), a["kernel"], a["stride"], a["padding"], a["dilation"])
    return y.numpy().astype(np.int8)


CASES = [  # (rank, spatial, kernel, stride, padding, dilation)
    (2, (7, 9), (3, 3), (2, 2), (1, 1), (1, 1)),
    (2, (5, 5), (2, 2), (2, 2), (0, 0), (1, 1)),
    (2, (11, 6), (3, 2), (1, 2), (1, 1), (2, 1)),
    (2, (1, 3), (1, 3), (1, 1), (0, 1), (1, 1)),
    (1, (13,), (3,), (2,), (1,), (1,)),
    (1, (8,), (2,), (2,), (0,), (1,)),
    (1, (9,), (5,), (3,), (2,), (2,)),
]


@pytest.mark.parametrize("rank, spatial, k, s, p, d", CASES)
@pytest.mark.parametrize("density", [0.05, 0.5, 0.95])
def test_bin_maxpool_reference_equals_cpp_and_torch(rank, spatial, k, s, p, d, density):
    rng = np.random.default_rng(hash((spatial, k, density)) % 2**32)
    attrs = {"kernel": list(k), "stride": list(s), "padding": list(p), "dilation": list(d)}
    op = OpType.MAXPOOL1D if rank == 1 else OpType.MAXPOOL2D
    graph = _bin_pool_graph(op, spatial, attrs)
    # mostly -1 (density of +1 low) is where a padded tap wrongly winning would show
    x = np.where(rng.random((2, 3, *spatial)) < density, 1, -1).astype(np.int8)
    want = execute(graph, [x]).outputs[0]
    np.testing.assert_array_equal(want, _torch_max(x, attrs))
    _check(graph, x)  # every C++ path == reference


def test_all_minus_one_stays_minus_one_with_padding():
    attrs = {"kernel": [3, 3], "stride": [1, 1], "padding": [1, 1], "dilation": [1, 1]}
    graph = _bin_pool_graph(OpType.MAXPOOL2D, (4, 5), attrs)
    x = -np.ones((1, 3, 4, 5), np.int8)
    assert (execute(graph, [x]).outputs[0] == -1).all()
    _check(graph, x)


@pytest.mark.parametrize("op_type,spatial,attrs", [
    (OpType.AVGPOOL2D, (4, 6), {"kernel": [2, 2], "stride": [2, 2], "padding": [0, 0]}),
    (OpType.AVGPOOL2D, (5, 5), {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1]}),
    (OpType.AVGPOOL1D, (9,), {"kernel": [3], "stride": [2], "padding": [1]}),
    (OpType.GLOBAL_AVGPOOL, (5, 7), {}),
])
def test_bin_average_pools_sum_the_signs(op_type, spatial, attrs):
    # (was refused: "input has dtype BIN, expected I8/U8/I32") the ±1 values, zero point 0,
    # summed and rescaled to int8: here factor 1/area at zero point 0, so y = round(mean)·...
    from qdsl.graph.requant import make_rescale
    from qdsl.graph.ir import Rounding

    area = int(np.prod(attrs.get("kernel", spatial)))
    rq = make_rescale(64.0 / area, Rounding.HALF_EVEN, True, single=True)  # mean · 64 in int8
    a = dict(attrs, in_zp=0, **rq.attrs(), out_zp=0, out_min=-128, out_max=127)
    graph = _bin_pool_graph(op_type, spatial, a, DType.I8)
    rng = np.random.default_rng(len(spatial) * 10 + area)
    x = np.where(rng.random((2, 3, *spatial)) < 0.4, 1, -1).astype(np.int8)
    got = execute(graph, [x]).outputs[0]
    xt = torch.from_numpy(x.astype(np.float64))
    if op_type is OpType.GLOBAL_AVGPOOL:
        mean = xt.mean(dim=tuple(range(2, x.ndim)), keepdim=True)
    else:
        fn = tF.avg_pool1d if x.ndim == 3 else tF.avg_pool2d
        mean = fn(xt, attrs["kernel"], attrs["stride"], attrs["padding"], count_include_pad=True)
    want = np.clip(np.round(mean.numpy() * 64), -128, 127)  # half-even, as the stage
    np.testing.assert_array_equal(got, want)
    _check(graph, x)  # every C++ path == reference

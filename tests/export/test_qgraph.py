"""The .qgraph format: round trips, packing layout, validation messages, and fuzzing.

Fuzzing rule: any byte string given to ``graph_from_bytes`` either loads into a graph that
passed validation or raises ``GraphFormatError`` - never another exception.
"""

import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qdsl.graph import execute, graph_from_bytes, graph_to_bytes, load_graph, save_graph
from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, OutputStage, Tensor
from qdsl.graph.qgraph import ALIGN, MAGIC, pack, unpack
from qdsl.graph.requant import make_rescale
from qdsl.spec.diagnostics import QdslError

from .graphs import rand_int


def sample_graph() -> IntegerGraph:
    """quantize -> conv2d(int4, bias) -> maxpool -> reshape -> binarize -> blinear -> dequantize."""
    rng = np.random.default_rng(7)
    w = rand_int(rng, DType.I4, (4, 3, 3, 3))
    wl = rand_int(rng, DType.BIN, (5, 36))
    tensors = [
        Tensor("x", DType.F32, (-1, 3, 6, 6)), Tensor("q", DType.U8, (-1, 3, 6, 6)),
        Tensor("conv.weight", DType.I4, w.shape, w), Tensor("conv.bias", DType.I32, (4,), [1, 2, -3, 100]),
        Tensor("c", DType.I8, (-1, 4, 6, 6)), Tensor("p", DType.I8, (-1, 4, 3, 3)), Tensor("f", DType.I8, (-1, 36)),
        Tensor("fb", DType.BIN, (-1, 36)), Tensor("fc.weight", DType.BIN, wl.shape, wl),
        Tensor("o", DType.I8, (-1, 5)), Tensor("y", DType.F32, (-1, 5)),
    ]
    ops = [
        Op(OpType.QUANTIZE, "input", ["x"], ["q"], dict(scale=1 / 64, zero_point=0, qmin=0, qmax=255, rounding=1)),
        Op(OpType.CONV2D, "conv", ["q", "conv.weight", "conv.bias"], ["c"],
           dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1, in_zp=0, w_zp=(0,), acc_bits=32, overflow=0,
                **OutputStage(make_rescale([0.01, 0.02, 0.03, 0.04]), 0, 0, 127).attrs())),
        Op(OpType.MAXPOOL2D, "pool", ["c"], ["p"], dict(kernel=(2, 2), stride=(2, 2), padding=(0, 0), dilation=(1, 1))),
        Op(OpType.RESHAPE, "flatten", ["p"], ["f"], dict(shape=(36,))),
        Op(OpType.BINARIZE, "fc.input", ["f"], ["fb"], dict(zero_point=3)),
        Op(OpType.BLINEAR, "fc", ["fb", "fc.weight"], ["o"],
           dict(acc_bits=16, overflow=1, **OutputStage(make_rescale(0.5), 0, -128, 127).attrs())),
        Op(OpType.DEQUANTIZE, "output", ["o"], ["y"], dict(scale=0.5, zero_point=0)),
    ]
    return IntegerGraph(tensors, ["x"], ["y"], ops, name="sample").validate()


GRAPH = sample_graph()
BLOB = graph_to_bytes(GRAPH)


def with_crc(body: bytes) -> bytes:
    return body[:-4] + struct.pack("<I", zlib.crc32(body[:-4]) & 0xFFFFFFFF)


def test_round_trip_bytes_and_file(tmp_path):
    g2 = graph_from_bytes(BLOB)
    assert g2 == GRAPH
    assert graph_to_bytes(g2) == BLOB  # deterministic writer
    path = tmp_path / "g.qgraph"
    save_graph(GRAPH, path)
    g3 = load_graph(path)
    x = np.random.default_rng(0).random((3, 3, 6, 6)).astype(np.float32) * 4
    np.testing.assert_array_equal(execute(g3, x).outputs[0], execute(GRAPH, x).outputs[0])


def test_layout_header_alignment_and_crc():
    assert BLOB[:8] == MAGIC
    version, flags, t_off, t_size, d_off, d_size, f_size = struct.unpack_from("<IIQQQQQ", BLOB, 8)
    assert (version, flags, t_off, f_size) == (1, 0, 64, len(BLOB))
    assert d_off % ALIGN == 0 and d_off >= 64 + t_size and d_off + d_size + 4 == len(BLOB)
    assert struct.unpack_from("<I", BLOB, len(BLOB) - 4)[0] == zlib.crc32(BLOB[:-4])


@pytest.mark.parametrize(
    "dtype,values,expected",
    [
        (DType.I4, [1, -2, 7], bytes([0xE1, 0x07])),  # low nibble = even element
        (DType.U4, [15, 0, 3], bytes([0x0F, 0x03])),
        (DType.I2, [1, -1, -2, 0, 1], bytes([0b00101101, 0b01])),  # element 4k+j at bits 2j
        (DType.BIN, [1, -1, -1, 1, 1, 1, 1, 1, -1], bytes([0b110, 0b1])),  # bit 1 = -1, LSB first
        (DType.I32, [1, -1], bytes([1, 0, 0, 0, 255, 255, 255, 255])),
    ],
)
def test_packing_is_documented_layout(dtype, values, expected):
    v = np.array(values)
    assert pack(v, dtype) == expected
    np.testing.assert_array_equal(unpack(expected, dtype, v.shape), v)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([DType.I8, DType.U8, DType.I4, DType.U4, DType.I2, DType.U2, DType.BIN]),
       st.lists(st.integers(1, 5), min_size=1, max_size=4), st.integers(0, 2**32 - 1))
def test_pack_unpack_round_trip(dtype, shape, seed):
    v = rand_int(np.random.default_rng(seed), dtype, tuple(shape))
    np.testing.assert_array_equal(unpack(pack(v, dtype), dtype, tuple(shape)), v)


def _patched(offset: int, fmt: str, value) -> bytes:
    b = bytearray(BLOB)
    struct.pack_into(fmt, b, offset, value)
    return with_crc(bytes(b))


@pytest.mark.parametrize(
    "blob,match",
    [
        (b"", "shorter than"),
        (b"NOTAGRPH" + BLOB[8:], "bad magic"),
        (_patched(8, "<I", 2), "unsupported version 2"),
        (BLOB[:-10] + BLOB[-4:], "truncated or padded"),
        (BLOB[:-1] + bytes([BLOB[-1] ^ 1]), "checksum mismatch"),
        (_patched(12, "<I", 1), "flags"),
    ],
)
def test_specific_rejections(blob, match):
    with pytest.raises(GraphFormatError, match=match):
        graph_from_bytes(blob)


def test_errors_name_the_op_or_tensor():
    # an op reading a tensor produced later: topological order
    g = sample_graph()
    ops = list(g.ops)
    ops[2], ops[3] = ops[3], ops[2]
    with pytest.raises(GraphFormatError, match=r"op 2 \(RESHAPE 'flatten'\).*topological"):
        IntegerGraph(g.tensors, g.inputs, g.outputs, ops).validate()
    bad = Op(OpType.CLAMP, "relu", ["c"], ["p"], dict(out_min=0))
    with pytest.raises(GraphFormatError, match="missing attribute.*out_max"):
        IntegerGraph(g.tensors, g.inputs, g.outputs, [*g.ops[:2], bad]).validate()
    t = list(g.tensors)
    t[2] = Tensor("conv.weight", DType.I4, (4, 3, 3, 3), np.full((4, 3, 3, 3), 9))
    with pytest.raises(GraphFormatError, match="tensor 'conv.weight'.*does not fit dtype I4"):
        IntegerGraph(t, g.inputs, g.outputs, g.ops).validate()
    t[2] = Tensor("conv.weight", DType.I4, (4, 2, 3, 3), np.zeros((4, 2, 3, 3), dtype=np.int8))
    with pytest.raises(GraphFormatError, match="'conv'.*input channels per group"):
        IntegerGraph(t, g.inputs, g.outputs, g.ops).validate()
    with pytest.raises(GraphFormatError, match="dangling"):
        IntegerGraph(g.tensors, g.inputs, g.outputs, [*g.ops[:3], Op(OpType.RESHAPE, "f", ["nope"], ["f"], dict(shape=(36,)))]).validate()


def test_load_graph_missing_file_is_a_format_error(tmp_path):
    with pytest.raises(GraphFormatError, match="cannot read"):
        load_graph(tmp_path / "missing.qgraph")
    assert issubclass(GraphFormatError, QdslError)


def _only_format_errors(blob: bytes) -> None:
    try:
        graph_from_bytes(blob)
    except GraphFormatError:
        pass


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.integers(0, len(BLOB) - 1))
def test_truncated_files_always_raise(n):
    with pytest.raises(GraphFormatError):
        graph_from_bytes(BLOB[:n])


@FUZZ
@given(st.lists(st.integers(0, len(BLOB) * 8 - 1), min_size=1, max_size=4))
def test_bit_flips_are_caught_by_the_checksum(bits):
    b = bytearray(BLOB)
    for bit in bits:
        b[bit // 8] ^= 1 << (bit % 8)
    if bytes(b) != BLOB:
        with pytest.raises(GraphFormatError):
            graph_from_bytes(bytes(b))


@FUZZ
@given(st.lists(st.integers(0, len(BLOB) * 8 - 33), min_size=1, max_size=4))
def test_bit_flips_past_a_fixed_checksum_load_or_raise_format_errors(bits):
    # recompute the CRC so the parser and validator (not the checksum) see the damage
    b = bytearray(BLOB)
    for bit in bits:
        b[bit // 8] ^= 1 << (bit % 8)
    _only_format_errors(with_crc(bytes(b)))


@FUZZ
@given(st.binary(min_size=0, max_size=600))
def test_random_bytes_raise(data):
    with pytest.raises(GraphFormatError):
        graph_from_bytes(data)


@FUZZ
@given(st.binary(min_size=0, max_size=400), st.integers(64, len(BLOB) - 4))
def test_random_tables_behind_a_valid_header(junk, at):
    # keep the header, splice junk into the table/payload, fix the sizes and CRC
    body = bytearray(BLOB[:at] + junk + BLOB[at + len(junk):-4] + b"\0\0\0\0")
    struct.pack_into("<Q", body, 48, len(body))
    _only_format_errors(with_crc(bytes(body)))

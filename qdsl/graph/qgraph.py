"""The ``.qgraph`` file format (version 1): reader and writer. Specification: docs/qgraph.md.

Layout (all integers little-endian)::

    [0, 64)        header: magic "QDSLGRPH", u32 version, u32 flags, u64 table_offset (=64),
                   u64 table_size, u64 data_offset, u64 data_size, u64 file_size, 8 zero bytes
    [64, ...)      table: graph name, tensor table, input/output lists, op list (binary,
                   length-prefixed strings, typed attribute records; no JSON)
    [data_offset, data_offset + data_size)
                   constant payloads, each at a 64-byte-aligned absolute offset, zero padded
    last 4 bytes   u32 CRC-32 (zlib polynomial) of every preceding byte

Guarantees: :func:`graph_from_bytes` either returns a graph that passed
:func:`~qdsl.graph.validate.validate_graph` or raises :class:`GraphFormatError` (never
another exception) saying what is wrong and where (byte offset, op index, tensor name).
Writing then reading a valid graph gives an equal graph.
"""

from __future__ import annotations

import math
import os
import struct
import zlib

import numpy as np

from qdsl.graph.ir import (
    GRAPH_VERSION,
    OP_SCHEMAS,
    AttrType,
    DType,
    GraphFormatError,
    IntegerGraph,
    Op,
    OpType,
    Tensor,
)
from qdsl.graph.validate import validate_graph

__all__ = ["MAGIC", "ALIGN", "save_graph", "load_graph", "graph_to_bytes", "graph_from_bytes", "pack", "unpack"]

MAGIC = b"QDSLGRPH"
ALIGN = 64
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sIIQQQQQ8x")
MAX_RANK = 8
MAX_NAME = 4096


# ---------------------------------------------------------------- packing
def pack(values: np.ndarray, dtype: DType) -> bytes:
    """Little-endian payload of logical ``values`` (row-major); sub-byte types packed LSB first."""
    flat = np.asarray(values).reshape(-1)
    if dtype is DType.I32:
        return flat.astype("<i4").tobytes()
    if dtype in (DType.I8, DType.U8):
        return flat.astype(dtype.numpy).tobytes()
    bits = dtype.bits
    codes = (flat == -1).astype(np.uint8) if dtype is DType.BIN else (flat.astype(np.int64) & ((1 << bits) - 1)).astype(np.uint8)
    per = 8 // bits
    padded = np.zeros(math.ceil(flat.size / per) * per, dtype=np.uint8)
    padded[: flat.size] = codes
    lanes = padded.reshape(-1, per)
    # element i lands in byte i // per at bit (i % per) * bits: lower index -> lower bits
    out = np.zeros(lanes.shape[0], dtype=np.uint8)
    for j in range(per):
        out |= lanes[:, j] << np.uint8(j * bits)
    return out.tobytes()


def payload_size(dtype: DType, numel: int) -> int:
    return math.ceil(numel * dtype.bits / 8)


def unpack(buf: bytes, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`pack`; raises ``ValueError`` if padding bits are not zero."""
    numel = math.prod(shape)
    if dtype is DType.I32:
        return np.frombuffer(buf, dtype="<i4").astype(np.int32).reshape(shape)
    if dtype in (DType.I8, DType.U8):
        return np.frombuffer(buf, dtype=dtype.numpy).reshape(shape).copy()
    bits = dtype.bits
    per = 8 // bits
    raw = np.frombuffer(buf, dtype=np.uint8)
    codes = np.stack([(raw >> np.uint8(j * bits)) & np.uint8((1 << bits) - 1) for j in range(per)], axis=1).reshape(-1)
    if codes[numel:].any():
        raise ValueError("nonzero padding bits after the last element")
    codes = codes[:numel].astype(np.int64)
    if dtype is DType.BIN:
        vals = np.where(codes == 1, -1, 1)
    elif dtype in (DType.I4, DType.I2):
        vals = np.where(codes >= (1 << (bits - 1)), codes - (1 << bits), codes)
    else:
        vals = codes
    return vals.astype(np.int8 if dtype is not DType.U8 else np.uint8).reshape(shape)


# ---------------------------------------------------------------- writer
class _Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def raw(self, fmt: str, *v) -> None:
        self.parts.append(struct.pack("<" + fmt, *v))

    def str(self, s: str) -> None:
        b = s.encode("utf-8")
        if len(b) > MAX_NAME:
            raise GraphFormatError(f"name longer than {MAX_NAME} bytes: {s[:40]!r}...")
        self.raw("I", len(b))
        self.parts.append(b)

    def bytes(self) -> bytes:
        return b"".join(self.parts)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def graph_to_bytes(graph: IntegerGraph) -> bytes:
    """Serialize a graph (validated first, so only valid graphs are ever written)."""
    validate_graph(graph)
    index = {t.name: i for i, t in enumerate(graph.tensors)}
    payloads = [pack(t.data, t.dtype) if t.is_constant else b"" for t in graph.tensors]

    def table(offsets: list[int]) -> bytes:
        w = _Writer()
        w.str(graph.name)
        w.raw("I", len(graph.tensors))
        for t, off, p in zip(graph.tensors, offsets, payloads):
            w.str(t.name)
            w.raw("BBBB", int(t.dtype), int(t.is_constant), len(t.shape), 0)
            w.raw(f"{len(t.shape)}q", *t.shape)
            w.raw("QQ", off, len(p))
        for names in (graph.inputs, graph.outputs):
            w.raw("I", len(names))
            w.raw(f"{len(names)}I", *(index[n] for n in names))
        w.raw("I", len(graph.ops))
        for op in graph.ops:
            w.raw("HH", int(op.type), 0)
            w.str(op.name)
            for names in (op.inputs, op.outputs):
                w.raw("I", len(names))
                w.raw(f"{len(names)}I", *(index[n] for n in names))
            w.raw("I", len(op.attrs))
            for name in sorted(op.attrs):
                v = op.attrs[name]
                w.str(name)
                if isinstance(v, tuple):
                    w.raw("BI", AttrType.INTS, len(v))
                    w.raw(f"{len(v)}q", *v)
                elif isinstance(v, float):
                    w.raw("Bf", AttrType.FLOAT, v)
                else:
                    w.raw("Bq", AttrType.INT, v)
        return w.bytes()

    # the table size does not depend on the offset values (fixed-width fields)
    size = len(table([0] * len(payloads)))
    data_offset = _align(HEADER_SIZE + size)
    offsets, cur = [], data_offset
    for p in payloads:
        if p:
            offsets.append(cur)
            cur = _align(cur + len(p))
        else:
            offsets.append(0)
    data_end = max([o + len(p) for o, p in zip(offsets, payloads) if p], default=data_offset)
    body = bytearray(data_end)
    tbl = table(offsets)
    body[HEADER_SIZE:HEADER_SIZE + len(tbl)] = tbl
    for o, p in zip(offsets, payloads):
        body[o:o + len(p)] = p
    file_size = data_end + 4
    body[:HEADER_SIZE] = _HEADER.pack(MAGIC, GRAPH_VERSION, 0, HEADER_SIZE, len(tbl), data_offset,
                                      data_end - data_offset, file_size)
    return bytes(body) + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)


def save_graph(graph: IntegerGraph, path: str | os.PathLike) -> None:
    """Write ``graph`` to ``path`` (``.qgraph``)."""
    data = graph_to_bytes(graph)
    with open(path, "wb") as f:
        f.write(data)


# ---------------------------------------------------------------- reader
class _Reader:
    def __init__(self, buf: bytes, start: int, end: int):
        self.buf, self.pos, self.end = buf, start, end

    def raw(self, fmt: str, what: str):
        s = struct.Struct("<" + fmt)
        if self.pos + s.size > self.end:
            raise GraphFormatError(f"table truncated while reading {what} (needs {s.size} bytes)", f"byte {self.pos}")
        v = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return v

    def count(self, what: str, item_size: int) -> int:
        (n,) = self.raw("I", what)
        if n * item_size > self.end - self.pos:
            raise GraphFormatError(f"{what} = {n} exceeds the remaining table size", f"byte {self.pos - 4}")
        return n

    def str(self, what: str) -> str:
        at = self.pos
        n = self.count(f"length of {what}", 1)
        if n > MAX_NAME:
            raise GraphFormatError(f"{what} is {n} bytes long (limit {MAX_NAME})", f"byte {at}")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            raise GraphFormatError(f"{what} is not valid UTF-8", f"byte {at + 4}") from None


def _read_tensor(r: _Reader, buf: bytes, data_region: tuple[int, int], i: int) -> Tensor:
    at = r.pos
    name = r.str(f"name of tensor {i}")
    where = f"byte {at} (tensor {i} {name!r})"
    code, is_const, rank, reserved = r.raw("BBBB", "tensor header")
    if code not in DType._value2member_map_:
        raise GraphFormatError(f"unknown dtype code {code}", where)
    if is_const not in (0, 1) or reserved != 0:
        raise GraphFormatError(f"bad constant flag {is_const} or reserved byte {reserved}", where)
    if rank > MAX_RANK:
        raise GraphFormatError(f"rank {rank} exceeds {MAX_RANK}", where)
    shape = r.raw(f"{rank}q", "shape")
    offset, nbytes = r.raw("QQ", "payload offset/size")
    dtype = DType(code)
    if not is_const:
        if offset or nbytes:
            raise GraphFormatError("an activation must have no payload (offset and size 0)", where)
        return Tensor(name, dtype, shape)
    if any(d < 1 or d > 2**40 for d in shape):
        raise GraphFormatError(f"invalid constant shape {shape}", where)
    want = payload_size(dtype, math.prod(shape))
    if nbytes != want:
        raise GraphFormatError(f"payload size {nbytes} but {dtype.name}{list(shape)} needs {want} bytes", where)
    if offset % ALIGN or offset < data_region[0] or offset + nbytes > data_region[1]:
        raise GraphFormatError(f"payload [{offset}, {offset + nbytes}) is unaligned or outside the data region {list(data_region)}", where)
    if dtype is DType.F32:
        raise GraphFormatError("float constants are not part of the integer IR", where)
    try:
        data = unpack(buf[offset:offset + nbytes], dtype, tuple(shape))
    except ValueError as e:
        raise GraphFormatError(str(e), f"byte {offset} (payload of tensor {name!r})") from None
    return Tensor(name, dtype, shape, data)


def _read_names(r: _Reader, tensors: list[Tensor], what: str) -> tuple[str, ...]:
    at = r.pos
    n = r.count(f"number of {what}", 4)
    idx = r.raw(f"{n}I", what)
    for j in idx:
        if j >= len(tensors):
            raise GraphFormatError(f"{what} refers to tensor index {j}, only {len(tensors)} tensors", f"byte {at}")
    return tuple(tensors[j].name for j in idx)


def _read_op(r: _Reader, tensors: list[Tensor], i: int) -> Op:
    at = r.pos
    code, reserved = r.raw("HH", "op header")
    if code not in OpType._value2member_map_ or reserved:
        raise GraphFormatError(f"unknown op code {code} (or nonzero reserved field)", f"byte {at} (op {i})")
    name = r.str(f"name of op {i}")
    where = f"byte {at} (op {i} {OpType(code).name} {name!r})"
    inputs = _read_names(r, tensors, f"inputs of op {i}")
    outputs = _read_names(r, tensors, f"outputs of op {i}")
    n = r.count(f"attribute count of op {i}", 6)
    attrs: dict = {}
    for _ in range(n):
        key = r.str(f"attribute name of op {i}")
        (kind,) = r.raw("B", "attribute type")
        if kind == AttrType.INT:
            (v,) = r.raw("q", key)
        elif kind == AttrType.FLOAT:
            (v,) = r.raw("f", key)
        elif kind == AttrType.INTS:
            m = r.count(f"length of {key}", 8)
            v = tuple(r.raw(f"{m}q", key))
        else:
            raise GraphFormatError(f"attribute {key!r} has unknown type code {kind}", where)
        if key in attrs:
            raise GraphFormatError(f"attribute {key!r} appears twice", where)
        expected = OP_SCHEMAS[OpType(code)].attrs.get(key)
        if expected is not None and expected != kind:
            raise GraphFormatError(f"attribute {key!r} has type {AttrType(kind).name}, expected {expected.name}", where)
        attrs[key] = v
    return Op(OpType(code), name, inputs, outputs, attrs)


def graph_from_bytes(buf: bytes) -> IntegerGraph:
    """Parse and fully validate a ``.qgraph`` image (see module doc)."""
    buf = bytes(buf)
    if len(buf) < HEADER_SIZE + 4:
        raise GraphFormatError(f"file is {len(buf)} bytes, shorter than the {HEADER_SIZE}-byte header + checksum", "byte 0")
    magic, version, flags, t_off, t_size, d_off, d_size, f_size = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise GraphFormatError(f"bad magic {magic!r}, expected {MAGIC!r} (not a .qgraph file)", "byte 0")
    if version != GRAPH_VERSION:
        raise GraphFormatError(f"unsupported version {version} (this qdsl reads version {GRAPH_VERSION})", "byte 8",
                               "re-export the graph with this version of qdsl")
    if flags != 0 or any(buf[56:64]):
        raise GraphFormatError("nonzero flags or reserved header bytes", "byte 12")
    if f_size != len(buf):
        raise GraphFormatError(f"header says the file is {f_size} bytes, it is {len(buf)} (truncated or padded)", "byte 48")
    (crc,) = struct.unpack_from("<I", buf, len(buf) - 4)
    actual = zlib.crc32(buf[:-4]) & 0xFFFFFFFF
    if crc != actual:
        raise GraphFormatError(f"checksum mismatch: stored {crc:#010x}, computed {actual:#010x} (corrupt file)", f"byte {len(buf) - 4}")
    if t_off != HEADER_SIZE or t_off + t_size > d_off or d_off % ALIGN or d_off + d_size != len(buf) - 4:
        raise GraphFormatError(f"inconsistent section layout (table {t_off}+{t_size}, data {d_off}+{d_size})", "byte 16")
    r = _Reader(buf, t_off, t_off + t_size)
    name = r.str("graph name")
    n_t = r.count("tensor count", 24)
    tensors = [_read_tensor(r, buf, (d_off, d_off + d_size), i) for i in range(n_t)]
    inputs = _read_names(r, tensors, "graph inputs")
    outputs = _read_names(r, tensors, "graph outputs")
    n_ops = r.count("op count", 16)
    ops = [_read_op(r, tensors, i) for i in range(n_ops)]
    if r.pos != r.end:
        raise GraphFormatError(f"{r.end - r.pos} unexpected bytes after the op list", f"byte {r.pos}")
    graph = IntegerGraph(tensors, inputs, outputs, ops, name=name)
    validate_graph(graph)
    return graph


def load_graph(path: str | os.PathLike) -> IntegerGraph:
    """Read and validate a ``.qgraph`` file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise GraphFormatError(f"cannot read {os.fspath(path)!r}: {e.strerror}") from None
    return graph_from_bytes(data)

"""One op catalogue: the C++ runtime's op table (csrc/runtime/ops/op_schema.h) is generated
from the Python schema (qdsl.graph.ir.OP_SCHEMAS) by csrc/gen_op_schema.py, and the loader
takes its opcode bound from it."""

from __future__ import annotations

import importlib.util
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

import qdsl.runtime as rt
from qdsl.graph.ir import OP_SCHEMAS, OUT_ATTRS, RQ_ATTRS, DType, GraphFormatError, IntegerGraph, Op, OpType, Tensor
from qdsl.graph.qgraph import graph_to_bytes

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_op_schema", ROOT / "csrc" / "gen_op_schema.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_header_is_current():
    gen = _generator()
    assert gen.HEADER.read_text() == gen.render(), "run: python csrc/gen_op_schema.py"


def test_header_rows_equal_the_python_schema():
    # parse the committed header back (independently of render()) and compare field by field
    text = (ROOT / "csrc" / "runtime" / "ops" / "op_schema.h").read_text()
    codes = {m[0]: int(m[1]) for m in re.findall(r"^  k(\w+) = (\d+),$", text, re.M)}
    types = {"kAttrInt": 1, "kAttrFloat": 2, "kAttrInts": 3}
    tables = {}
    for name, body in re.findall(r"AttrSchema k(\w+)Attrs\[\] = \{(.*)\};", text):
        tables[name] = {k: types[t] for k, t in re.findall(r'\{"(\w+)", (kAttr\w+)\}', body)}
    rows = re.findall(r'^    \{"(\w+)", (\d+), (-?\d+), (true|false), (?:k(\w+)Attrs|nullptr), (\d+), (\d+)\},$', text, re.M)
    assert [r[0] for r in rows] == [t.name for t in sorted(OpType, key=int)]
    for name, lo, hi, stage, table, n, n_out in rows:
        t = OpType[name]
        s = OP_SCHEMAS[t]
        camel = "".join(p.capitalize() for p in name.split("_"))
        assert codes[camel] == int(t)
        assert (int(lo), int(hi)) == (s.min_inputs, -1 if s.max_inputs is None else s.max_inputs)
        assert (stage == "true") == s.needs_output_stage
        assert tables.get(table, {}) == {k: int(v) for k, v in s.attrs.items()} and int(n) == len(s.attrs)
        assert int(n_out) == s.n_outputs
    assert tables["Stage"] == {k: int(v) for k, v in {**RQ_ATTRS, **OUT_ATTRS}.items()}


def _clamp_bytes() -> bytes:
    x, y = Tensor("x", DType.I8, (-1, 4)), Tensor("y", DType.I8, (-1, 4))
    g = IntegerGraph([x, y], ["x"], ["y"], [Op(OpType.CLAMP, "layer", ["x"], ["y"], {"out_min": -3, "out_max": 5})])
    return graph_to_bytes(g.validate())


@pytest.mark.skipif(not rt.available(), reason="C++ runtime not built")
def test_loader_opcode_bound_comes_from_the_table():
    blob = bytearray(_clamp_bytes())
    marker = struct.pack("<HHI", int(OpType.CLAMP), 0, 5) + b"layer"
    at = blob.index(marker)
    rt.CompiledGraph(bytes(blob)).run(np.zeros((1, 4), np.int8))
    blob[at:at + 2] = struct.pack("<H", max(OpType) + 1)  # one past the last opcode
    blob[-4:] = struct.pack("<I", zlib.crc32(bytes(blob[:-4])) & 0xFFFFFFFF)
    with pytest.raises(GraphFormatError, match="unknown opcode"):
        rt.CompiledGraph(bytes(blob))


@pytest.mark.skipif(not rt.available(), reason="C++ runtime not built")
def test_an_unassigned_opcode_below_the_largest_is_refused():
    # opcodes reserved by ops on other branches leave gaps: null rows in the generated
    # tables, which the C++ loader must refuse (not call through a null OpDef)
    gaps = sorted(set(range(1, max(OpType))) - {int(t) for t in OpType})
    if not gaps:
        pytest.skip("every opcode below the largest is assigned")
    blob = bytearray(_clamp_bytes())
    at = blob.index(struct.pack("<HHI", int(OpType.CLAMP), 0, 5) + b"layer")
    blob[at:at + 2] = struct.pack("<H", gaps[0])
    blob[-4:] = struct.pack("<I", zlib.crc32(bytes(blob[:-4])) & 0xFFFFFFFF)
    with pytest.raises(GraphFormatError, match="unknown opcode"):
        rt.CompiledGraph(bytes(blob))

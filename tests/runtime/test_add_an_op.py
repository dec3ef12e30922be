""""Add a graph op" touches one op module plus its registration line: checked mechanically.

The test copies the ``qdsl`` package into a temporary directory, writes a toy op (NEG:
``clamp(-x)`` on I8) as ``qdsl/graph/ops/toy.py``, lists it in ``qdsl/graph/ops/__init__.py``
(the registration) and changes nothing else.  In a fresh interpreter on that copy,
``OpType``/``OP_SCHEMAS`` include the op, validation applies its rule, the reference
executor runs it, and the generated C++ schema names its table entry (``kNegDef``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_TOY = '''
"""NEG: ``clamp(-x, min, max)`` of the input's I8 dtype (a toy op for tests/runtime/test_add_an_op.py)."""

from __future__ import annotations

import numpy as np

from qdsl.graph.ops import OpDef
from qdsl.graph.schema import AttrType, DType, OpSchema

__all__ = ["OPS"]


def _infer(c, op, ins, out):
    x = ins[0]
    c.dt(x, (DType.I8,), "input")
    c.int("bias", -8, 8)
    return (DType.I8,), x.shape


def _run(op, args, graph, counts):
    return np.clip(op.attrs["bias"] - args[0], -128, 127)


OPS = (OpDef("NEG", {number}, OpSchema(1, 1, {{"bias": AttrType.INT}}), _infer, _run, "bias - x, clamped to I8."),)
'''

_CHECK = textwrap.dedent('''
    import sys
    import numpy as np
    sys.path.insert(0, "csrc")
    import qdsl.graph.ir as ir
    from qdsl.graph.ir import DType, GraphFormatError, IntegerGraph, Op, OpType, Tensor
    from qdsl.graph.reference import execute
    assert ir.__file__.startswith(sys.argv[1]), ir.__file__
    assert int(OpType.NEG) == NUMBER and ir.OP_SCHEMAS[OpType.NEG].attrs == {"bias": ir.AttrType.INT}

    def graph(bias, out_dtype=DType.I8):
        tensors = [Tensor("x", DType.F32, (-1, 4)), Tensor("q", DType.I8, (-1, 4)),
                   Tensor("n", out_dtype, (-1, 4)), Tensor("y", DType.F32, (-1, 4))]
        ops = [Op(OpType.QUANTIZE, "q", ["x"], ["q"], dict(scale=1.0, zero_point=0, qmin=-128, qmax=127, rounding=1)),
               Op(OpType.NEG, "neg", ["q"], ["n"], {"bias": bias}),
               Op(OpType.DEQUANTIZE, "dq", ["n"], ["y"], dict(scale=1.0, zero_point=0))]
        return IntegerGraph(tensors, ["x"], ["y"], ops).validate()

    y = execute(graph(2), np.array([[-128.0, -1.0, 0.0, 127.0]], dtype=np.float32)).outputs[0]
    assert y.tolist() == [[127.0, 3.0, 2.0, -125.0]], y
    for bad in (dict(bias=9), dict(bias=0, out_dtype=DType.U8)):
        try:
            graph(**bad)
        except GraphFormatError as e:
            assert "NEG" in str(e), e
        else:
            raise AssertionError(f"validation accepted {bad}")
    import gen_op_schema
    header = gen_op_schema.render()
    assert f"kNeg = {NUMBER}," in header and "&kNegDef," in header and '"bias", kAttrInt' in header
    print("ok")
''')


def test_a_toy_op_in_one_module_is_validated_and_executed(tmp_path):
    from qdsl.graph.ir import OpType

    number = max(OpType) + 1
    shutil.copytree(ROOT / "qdsl", tmp_path / "qdsl", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc", ignore=shutil.ignore_patterns("*.o", "*.cc", "*.h"))
    ops = tmp_path / "qdsl" / "graph" / "ops"
    (ops / "toy.py").write_text(_TOY.format(number=number))
    init = (ops / "__init__.py").read_text()
    # the registration is one line: the module's name in _REGISTERED
    registered = init.replace("_REGISTERED = (\n", '_REGISTERED = (\n    "toy",\n', 1)
    assert registered.count('"toy"') == 1, "the registration list in qdsl/graph/ops/__init__.py changed shape"
    (ops / "__init__.py").write_text(registered)
    proc = subprocess.run([sys.executable, "-c", _CHECK.replace("NUMBER", str(number)), str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]

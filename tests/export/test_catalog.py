"""The one construct table (qdsl/graph/catalog.py) covers every op export emits and every
op lint names, its paths resolve to distinct torch objects, and its readers agree with it."""

import ast
import inspect

import pytest
import torch
from torch import nn

from qdsl.export import lower, lower_dynamic, lower_layers, lower_lut, lower_threshold, rules
from qdsl.graph import catalog
from qdsl.graph.catalog import BOUNDARY_OPS, CONSTRUCTS, LINT_ONLY_OPS, LOWERINGS, OPS, WEIGHTED_OPS
from qdsl.graph.ir import OP_SCHEMAS, OpType
from qdsl.lint import ops as lint_ops
from qdsl.patch import constructs


def _emitted_op_types() -> set[OpType]:
    """Every ``OpType.X`` the exporter's source names (what it can emit)."""
    found = set()
    for module in (lower, lower_dynamic, lower_layers, lower_lut, lower_threshold, rules):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "OpType":
                found.add(OpType[node.attr])
    return found


def test_table_covers_every_op_the_exporter_emits():
    emitted = _emitted_op_types()
    assert emitted  # the scan found the exporter's ops
    covered = {OpType[t] for c in CONSTRUCTS if c.lowering for t in LOWERINGS[c.lowering]}
    covered |= {OpType[t] for t in BOUNDARY_OPS}  # a name that is no OpType raises here
    assert emitted <= covered, emitted - covered
    # and nothing in the IR is unreachable from the table
    assert covered == set(OP_SCHEMAS) == set(OpType)


def test_every_lowering_rule_is_used_and_known():
    used = {c.lowering for c in CONSTRUCTS if c.lowering}
    assert used == set(LOWERINGS)
    # each rule is in the exporter's dispatch tables (qdsl/export/rules.py), and only those
    registered = set(rules.MODULE_RULES) | set(rules.FUNCTION_RULES) | set(rules.METHOD_RULES)
    assert registered == set(LOWERINGS)


def test_table_covers_every_op_lint_names():
    assert lint_ops.KNOWN_OPS == OPS
    assert set(WEIGHTED_OPS) <= set(OPS)
    named = {c.op for c in CONSTRUCTS if c.op in OPS}
    assert named == set(OPS)  # every profile op is what some construct is


def test_lint_only_ops_are_the_ones_export_cannot_lower():
    lowered = {c.op for c in CONSTRUCTS if c.lowering}
    assert set(LINT_ONLY_OPS) == set(OPS) - lowered
    assert {"mean"} <= set(LINT_ONLY_OPS)
    # softmax, layer_norm and act x act matmul lower (SOFTMAX, LAYERNORM, MATMUL)
    assert not set(LINT_ONLY_OPS) & {"softmax", "layer_norm", "matmul"}
    # mul of two activations lowers to MUL (squeeze-excitation)
    assert not set(LINT_ONLY_OPS) & {"conv2d", "linear", "add", "mul", "relu", "concat", "reshape", "batch_norm"}
    # the elementwise activations lower to a lookup table (LUT), so lint lists none of them
    lut_ops = {"hardswish", "hardsigmoid", "silu", "sigmoid", "tanh", "gelu", "leaky_relu", "prelu", "relu6"}
    assert not set(LINT_ONLY_OPS) & lut_ops
    assert {c.op for c in CONSTRUCTS if c.lowering == "lut"} == lut_ops - {"relu6"}  # ReLU6 stays a clamp


def test_paths_resolve_to_distinct_objects():
    for kind in ("module", "function"):
        rows = [c for c in CONSTRUCTS if c.kind == kind]
        objs = [constructs.resolve(c) for c in rows]
        assert len({id(o) for o in objs}) == len(rows), kind
    methods = [c.path for c in CONSTRUCTS if c.kind == "method"]
    assert len(set(methods)) == len(methods)
    assert all(hasattr(torch.Tensor, m) for m in methods)


def test_one_name_one_op_for_lint():
    # lint keys functions and methods by name: rows sharing a name must agree on the op
    by_name: dict[str, set] = {}
    for c in CONSTRUCTS:
        if c.kind != "module":
            by_name.setdefault(catalog.short_name(c.name), set()).add(c.op)
    assert {n: ops for n, ops in by_name.items() if len(ops) > 1} == {}


def test_module_lookup_prefers_the_most_derived_class():
    assert constructs.module_construct(nn.ReLU6()).lowering == "relu6"  # ReLU6 is a Hardtanh
    assert constructs.module_construct(nn.Hardtanh()).lowering == "hardtanh"

    class MyConv(nn.Conv2d):
        pass

    assert constructs.module_construct(MyConv(1, 1, 1)).lowering == "layer"
    assert constructs.module_construct(nn.LSTM(2, 2)).lowering == "recurrent"
    assert constructs.module_construct(nn.RNN(2, 2)).lowering == "recurrent"  # since the RNN op (39)


def test_functional_pools_build_a_module_with_the_same_rule():
    pools = constructs.functions(lambda c: c.lowering == "pool")
    assert set(rules._FUNCTIONAL_POOLS) == set(pools)
    for fn, (cls, n_positional) in rules._FUNCTIONAL_POOLS.items():
        row = next(c for c in CONSTRUCTS if c.kind == "module" and constructs.resolve(c) is cls)
        assert row.lowering == "pool" and row.op == pools[fn].op and n_positional >= 1
    assert all(c.like is None for c in CONSTRUCTS if c.lowering != "pool")


@pytest.mark.parametrize("name, op", [("operator.add", "add"), ("torch.cat", "concat"), ("operator.mul", "mul")])
def test_lint_and_export_read_the_same_row(name, op):
    row = next(c for c in CONSTRUCTS if c.path == name)
    assert lint_ops.function_op(row.name) == op
    assert (constructs.resolve(row) in lower._FUNCTION_RULES) == (row.lowering is not None)


def test_binary_forms_are_ops_of_the_layer_rule():
    # lint's W321 for a binary layer reads this; export emits these ops for it
    from qdsl.graph.catalog import BINARY_FORMS

    assert set(BINARY_FORMS) == set(WEIGHTED_OPS)
    assert set(BINARY_FORMS.values()) <= set(LOWERINGS["layer"])

"""``explain`` tables and ``to_records`` JSON from resolved plans."""

import json
import re

from qdsl.resolve import explain, resolve, to_records
from qdsl.spec.model import Granularity, GranularityKind, Kind, ObserverSpec
from resolve_specs import body, rule, spec, tq

PRESETS = {
    "w4pot": tq(5, kind=Kind.INT, bits=4, scale="pot", granularity=Granularity(GranularityKind.CHANNEL),
                observer=ObserverSpec("mse")),
    "a8": tq(6, bits=8, signed=False),
}


def design_spec():
    """The DESIGN.md §8 example, on Conv1dNet."""
    return spec(
        presets=PRESETS,
        defaults=body(10, weight=tq(10, extends="w4pot"), input=tq(11, extends="a8"),
                      bias=tq(12, kind=Kind.INT, bits=32, scale="input*weight")),
        rules=[
            rule(15, "type:Conv1d", weight=tq(15, extends="w4pot", scale="learned_pot")),
            rule(16, "features.0", "classifier", weight=tq(16, extends="w4pot", bits=8)),
            rule(17, "re:.*downsample.*", optional=True, skip=True),
        ],
    )


def row(table: str, layer: str, role: str, field: str) -> tuple[str, str]:
    """(value, set by) of one row; columns are separated by two or more spaces."""
    for line in table.splitlines():
        cells = re.split(r"\s{2,}", line)
        if cells[:3] == [layer, role, field]:
            return cells[3], cells[4]
    raise AssertionError(f"no row {layer} {role} {field} in\n{table}")


def test_table_matches_the_design_example(conv1d):
    table = explain(resolve(conv1d, design_spec()))
    assert table.splitlines()[0].split() == ["layer", "role", "field", "value", "set", "by"]
    assert row(table, "features.3", "weight", "bits") == ("4", "rule type:Conv1d (m.qspec:15) via w4pot (m.qspec:5)")
    assert row(table, "features.3", "weight", "scale") == (
        "learned_pot", "rule type:Conv1d (m.qspec:15), overrides w4pot: pot")
    assert row(table, "classifier", "bias", "scale") == ("input*weight", "defaults (m.qspec:12)")
    assert row(table, "features.0", "weight", "bits") == (
        "8", "rule features.0, classifier (m.qspec:16), overrides w4pot: 4")
    assert row(table, "features.3", "weight", "rounding") == ("half_even", "built-in default")
    assert row(table, "features.3", "input", "bits") == ("8", "defaults (m.qspec:11) via a8 (m.qspec:6)")


def test_columns_are_aligned(conv1d):
    lines = explain(resolve(conv1d, design_spec())).splitlines()
    for header in ("role", "field", "value", "set by"):
        col = lines[0].index(header)
        # every row has a cell starting exactly under the header, after a gap
        assert all(line[col - 2 : col] == "  " and line[col] != " " for line in lines), header


def test_filters(conv1d):
    plan = resolve(conv1d, design_spec())
    table = explain(plan, layers="features.*", roles=["bias", "weight"])
    body_rows = table.splitlines()[1:]
    assert {r.split()[0] for r in body_rows} == {"features.0", "features.3", "features.6"}
    assert {r.split()[1] for r in body_rows} == {"weight"}  # bias=False convs
    assert explain(plan, layers="nothing*") == "no layers match"


def test_skipped_and_float_roles_say_why(resnet):
    s = spec(defaults=body(3, weight=tq(3, bits=8), input=tq(3, bits=8)),
             rules=[rule(5, "re:.*downsample.*", skip=True), rule(6, "fc", input=tq(6, kind=Kind.FLOAT))])
    table = explain(resolve(resnet, s), layers=["layer2.0.downsample.0", "fc"])
    assert row(table, "layer2.0.downsample.0", "layer", "skip") == ("true", "rule re:.*downsample.* (m.qspec:5)")
    assert row(table, "layer2.0.downsample.0", "weight", "kind") == ("float", "layer skipped")
    assert row(table, "fc", "input", "kind") == ("float", "rule fc (m.qspec:6)")
    assert row(table, "fc", "bias", "kind") == ("float", "not quantized: no default or rule sets it")


def test_records_are_json_with_full_provenance(conv1d):
    recs = to_records(resolve(conv1d, design_spec()), layers="features.3", roles=["weight"])
    json.dumps(recs)  # serializable as is
    by_field = {r["field"]: r for r in recs}
    assert set(by_field) == {"kind", "bits", "signed", "narrow_range", "symmetric", "scale", "granularity",
                             "observer", "rounding", "dynamic"}
    scale = by_field["scale"]
    assert scale["value"] == "learned_pot" and scale["type"] == "Conv1d"
    assert scale["set_by"] == {"label": "rule type:Conv1d", "file": "m.qspec", "line": 15, "col": 20}
    assert [o["label"] for o in scale["overridden"]] == ["w4pot", "defaults via w4pot"]
    assert by_field["granularity"]["value"] == {"kind": "channel", "axis": 0, "group_size": None}
    assert by_field["observer"]["value"] == {"name": "mse", "params": {}}
    assert by_field["bits"]["via"][0]["label"] == "w4pot"

"""Weights written wider than their format can ever export (W320), found from the spec alone.

A format may hold weights the integer graph cannot (power-of-two beyond 4 bits spans more
than int8: ``NumberFormat.max_export_weight_bits``).  Such a spec still trains and
fake-quantizes, which research uses, so this is a warning of ``qdsl lint`` and ``qdsl
check``, not a resolve error; export would refuse the layer later.  It is reported at the
``bits`` value (inside the preset when it came through one), once per place written.
"""

from __future__ import annotations

from qdsl.resolve.check import Body, Prepared
from qdsl.resolve.validate import builtin_value
from qdsl.spec.diagnostics import Diagnostic
from qdsl.spec.formats import format_of
from qdsl.spec.model import Kind, Role

__all__ = ["export_width_findings"]


def export_width_findings(prep: Prepared) -> list[Diagnostic]:
    out: dict[tuple, Diagnostic] = {}
    for body in (prep.defaults, *prep.rules, prep.overrides):
        d = _finding(body, prep)
        if d is not None:
            out.setdefault((d.span.path, d.span.location()), d)
    return list(out.values())


def _finding(body: Body, prep: Prepared) -> Diagnostic | None:
    own = body.roles.get(Role.WEIGHT)
    if not own or ("bits" not in own and "kind" not in own):
        return None  # this body writes neither: not its finding
    merged = dict(prep.defaults.roles.get(Role.WEIGHT, {})) if body is not prep.defaults else {}
    merged.update(own)
    kind = merged["kind"].value if "kind" in merged else Kind.INT
    try:
        fmt = format_of(kind, prep.registries)
    except KeyError:
        return None  # an unknown kind is check_spec's E204
    top = fmt.max_export_weight_bits
    scale = merged["scale"].value if "scale" in merged else None
    bits = merged["bits"].value if "bits" in merged else builtin_value("bits", Role.WEIGHT, kind, scale)
    if top is None or not isinstance(bits, int) or bits <= top:
        return None
    c = merged.get("bits") or merged["kind"]
    return Diagnostic.warning(
        "W320", f"{fmt.describe(bits, True, True)} weights span more than int8 ({body.label}): "
        "the integer graph cannot hold them, so this spec cannot export (fake quant still works)",
        c.span, f"use bits <= {top} for {fmt.name} weights if the model is meant for export")

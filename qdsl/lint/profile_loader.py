"""Read hardware profiles (TOML, ``docs/profiles.md``) into :class:`HardwareProfile` records.

Guarantees:

* ``load_profile`` raises nothing but :class:`SpecError` (a :class:`QdslError`), carrying
  *every* problem of a file at once: TOML syntax (E001), unknown keys with did-you-mean
  (E101), wrong types (E102), out-of-range numbers (E104), unknown enum values and op names
  (E105), an unsupported ``version`` (E190), an ``extends`` that cannot be found (E191)
  or that cycles (E192), and inconsistent settings (E193).  Each is located
  (file:line:col with the source line and a caret).
* ``extends`` is resolved relative to the extending file, then as a bundled name; the
  result is flattened: child settings win field by field (see ``qdsl/spec/profile.py``).
* Bundled profiles live in ``qdsl/data/hw/<name>.toml`` (the single source of truth;
  ``specs/hw/`` links to them) and are found by name: ``load_profile("tflite-int8")``.

Never imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from qdsl.parse.located_toml import KeySpec, LocatedToml, check_choice, check_keys, check_range, read_located_toml
from qdsl.spec.diagnostics import Diagnostic, Span, SpecError, did_you_mean
from qdsl.spec.formats import MINIFLOAT_PRESETS, looks_like_minifloat, minifloat_format, minifloat_problem
from qdsl.spec.model import GranularityKind, Kind, Overflow, Role
from qdsl.spec.profile import (
    PROFILE_VERSION,
    SCALE_CLASSES,
    AccumulatorCaps,
    FixedOutput,
    HardwareProfile,
    NarrowRange,
    Position,
    TensorCaps,
)
from qdsl.lint.ops import KNOWN_OPS

__all__ = ["load_profile", "parse_profile", "bundled_profiles", "BUNDLED_DIR"]

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "data" / "hw"
"""Where bundled profiles are installed (package data)."""

_S, _I, _B, _F, _L, _T = (str,), (int,), (bool,), (float,), (list,), (dict,)
_TOP = {
    "version": KeySpec(_I, required=True),
    "name": KeySpec(_S),
    "description": KeySpec(_S),
    "extends": KeySpec(_S, doc="a profile file or bundled name"),
    "integer_only": KeySpec(_B),
    "ops": KeySpec(_L, doc="an array of op names"),
    "fusions": KeySpec(_L, doc='an array of chains such as "conv2d+relu"'),
    "accumulator": KeySpec(_T),
    "roles": KeySpec(_T),
    "op": KeySpec(_T),
    "first_layer": KeySpec(_T),
    "last_layer": KeySpec(_T),
    "fixed_output": KeySpec(_T),
}
_CAPS = {
    "kinds": KeySpec(_L),
    "bits": KeySpec(_L, doc="an array of bit widths"),
    "signedness": KeySpec(_L, doc='an array of "signed"/"unsigned"'),
    "scales": KeySpec(_L),
    "granularities": KeySpec(_L),
    "channel_axes": KeySpec(_L),
    "group_sizes": KeySpec(_L),
    "zero_point": KeySpec(_B),
    "narrow_range": KeySpec(_S, doc='"required", "forbidden" or "allowed"'),
    "dynamic": KeySpec(_B),
    "thresholds": KeySpec(_B, doc="true/false: learned per-channel binarisation thresholds"),
}
_ACC = {"bits": KeySpec(_I), "overflow": KeySpec(_S, doc='"wrap" or "saturate"'), "pair_bits": KeySpec(_I)}
_FIXED = {
    "scale": KeySpec(_F, required=True),
    "zero_point": KeySpec(_I, required=True),
    "bits": KeySpec(_I),
    "signed": KeySpec(_B),
}
_ROLE_KEYS = {r.value: KeySpec(_T) for r in Role}
_OP_KEYS = dict(_ROLE_KEYS, accumulator=KeySpec(_T))


def bundled_profiles() -> list[str]:
    """Names of the bundled profiles (``tflite-int8``, ...)."""
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.toml"))


def _is_name(ref: str) -> bool:
    return os.sep not in ref and "/" not in ref and not ref.endswith(".toml")


def _locate(ref: str, base_dir: Path | None) -> Path | None:
    """A bare name (no ``/``, no ``.toml``) is bundled; anything else is a path, relative
    to the extending file's directory (or the current directory)."""
    if _is_name(ref):
        path = BUNDLED_DIR / f"{ref}.toml"
    else:
        path = base_dir / ref if base_dir is not None else Path(ref)
    return path if path.is_file() else None


def load_profile(profile: str | os.PathLike | HardwareProfile) -> HardwareProfile:
    """A profile by path (``specs/hw/x.toml``) or bundled name (``tflite-int8``)."""
    if isinstance(profile, HardwareProfile):
        return profile
    ref = os.fspath(profile)
    path = _locate(ref, None)
    if path is None:
        raise SpecError(Diagnostic.error(
            "E191", f"no hardware profile '{ref}'", Span(ref),
            did_you_mean(ref, bundled_profiles(), "bundled profiles")))
    return _load_file(path, ())


def parse_profile(text: str, filename: str = "<profile>") -> HardwareProfile:
    """A profile from text; a relative ``extends`` is resolved from the current directory."""
    return _from_text(text, filename, Path.cwd(), ())


def _load_file(path: Path, stack: tuple[Path, ...]) -> HardwareProfile:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(Diagnostic.error("E191", f"cannot read hardware profile '{path}': {exc}", Span(str(path))))
    return _from_text(text, _display(path), path.resolve().parent, stack + (path.resolve(),))


def _display(path: Path) -> str:
    """How messages name a profile file: bundled ones by their package path (stable
    across machines), others relative to the current directory when below it."""
    if path.resolve().parent == BUNDLED_DIR:
        return f"qdsl/data/hw/{path.name}"
    try:
        rel = os.path.relpath(path)
        return rel if not rel.startswith("..") else str(path)
    except ValueError:  # pragma: no cover - different drive on Windows
        return str(path)


@attrs.define
class _Layer:
    """One file's settings before ``extends`` is flattened (``None`` = not set)."""

    name: str | None = None
    description: str | None = None
    integer_only: bool | None = None
    ops: tuple[str, ...] | None = None
    fusions: tuple[tuple[str, ...], ...] | None = None
    accumulator: AccumulatorCaps = AccumulatorCaps()
    roles: dict = attrs.field(factory=dict)
    op_roles: dict = attrs.field(factory=dict)
    op_accumulators: dict = attrs.field(factory=dict)
    positions: dict = attrs.field(factory=dict)
    fixed_outputs: dict = attrs.field(factory=dict)
    spans: dict = attrs.field(factory=dict)


def _from_text(text: str, filename: str, base_dir: Path, stack: tuple[Path, ...]) -> HardwareProfile:
    lt = read_located_toml(text, filename)
    diags: list[Diagnostic] = []
    top = check_keys(lt, (), _TOP, diags)
    if "version" in top and top["version"] != PROFILE_VERSION:
        diags.append(Diagnostic.error(
            "E190", f"unsupported profile version {top['version']}", lt.span(("version",)),
            f"this qdsl reads profile version {PROFILE_VERSION}"))
    layer = _Layer(name=top.get("name"), description=top.get("description"), integer_only=top.get("integer_only"))
    for key in ("integer_only", "ops", "fusions", "name"):
        if key in top:
            layer.spans[key] = lt.span((key,))
    if "ops" in top:
        layer.ops = tuple(_strings(lt, ("ops",), KNOWN_OPS, diags, "op"))
    if "fusions" in top:
        layer.fusions = tuple(_fusions(lt, diags))
    if "accumulator" in top:
        layer.accumulator = _accumulator(lt, ("accumulator",), diags)
    if "roles" in top:
        layer.roles = _role_table(lt, ("roles",), diags)
    for pos in Position:
        if pos.value in top:
            layer.positions[pos] = _role_table(lt, (pos.value,), diags)
    for op, table in (top.get("op") or {}).items():
        path = ("op", op)
        if op not in KNOWN_OPS:
            diags.append(Diagnostic.error("E105", f"unknown op '{op}'", lt.key_span(path),
                                          did_you_mean(op, KNOWN_OPS, "ops")))
            continue
        body = check_keys(lt, path, _OP_KEYS, diags)
        roles = {Role(r): _caps(lt, path + (r,), diags) for r in body if r != "accumulator"}
        if roles:
            layer.op_roles[op] = roles
        if "accumulator" in body:
            layer.op_accumulators[op] = _accumulator(lt, path + ("accumulator",), diags)
    for op, table in (top.get("fixed_output") or {}).items():
        path = ("fixed_output", op)
        if op not in KNOWN_OPS:
            diags.append(Diagnostic.error("E105", f"unknown op '{op}'", lt.key_span(path),
                                          did_you_mean(op, KNOWN_OPS, "ops")))
            continue
        body = check_keys(lt, path, _FIXED, diags)
        if {"scale", "zero_point"} <= set(body):
            if body["scale"] <= 0:
                diags.append(Diagnostic.error("E104", "fixed output scale must be > 0", lt.span(path + ("scale",))))
            layer.fixed_outputs[op] = FixedOutput(float(body["scale"]), body["zero_point"], body.get("bits", 8),
                                                  body.get("signed", True), lt.key_span(path))
    parent = None
    if "extends" in top:
        parent = _extends(top["extends"], lt, base_dir, stack, diags)
    if diags:
        raise SpecError(sorted(diags, key=lambda d: (d.span.file != filename, d.span.line, d.span.col)))
    default_name = Path(filename).stem if filename not in ("<profile>", "<input>") else "profile"
    return _flatten(layer, parent, default_name, filename)


def _extends(ref: str, lt: LocatedToml, base_dir: Path, stack, diags) -> HardwareProfile | None:
    span = lt.span(("extends",))
    path = _locate(ref, base_dir)
    if path is None:
        diags.append(Diagnostic.error("E191", f"cannot find extended profile '{ref}'", span,
                                      "a path relative to this file, or a bundled name: "
                                      + ", ".join(bundled_profiles())))
        return None
    if path.resolve() in stack:
        chain = " -> ".join(_display(p) for p in stack + (path.resolve(),))
        diags.append(Diagnostic.error("E192", f"profile extends itself: {chain}", span,
                                      "remove one 'extends' from the cycle"))
        return None
    try:
        return _load_file(path, stack)
    except SpecError as err:
        diags.extend(err.diagnostics)
        diags.append(Diagnostic.error("E191", f"extended profile '{ref}' has errors (above)", span))
        return None


def _flatten(layer: _Layer, parent: HardwareProfile | None, default_name: str, source: str) -> HardwareProfile:
    p = parent or HardwareProfile(name=default_name)
    roles = dict(p.roles)
    for role, caps in layer.roles.items():
        roles[role] = caps.over(roles.get(role))
    op_roles = {op: dict(r) for op, r in p.op_roles.items()}
    for op, rmap in layer.op_roles.items():
        cur = op_roles.setdefault(op, {})
        for role, caps in rmap.items():
            cur[role] = caps.over(cur.get(role))
    positions = {pos: dict(r) for pos, r in p.positions.items()}
    for pos, rmap in layer.positions.items():
        cur = positions.setdefault(pos, {})
        for role, caps in rmap.items():
            cur[role] = caps.over(cur.get(role))
    op_acc = dict(p.op_accumulators)
    for op, acc in layer.op_accumulators.items():
        op_acc[op] = acc.over(op_acc.get(op))
    fixed = dict(p.fixed_outputs)
    fixed.update(layer.fixed_outputs)
    spans = dict(p.spans)
    spans.update(layer.spans)
    return HardwareProfile(
        name=layer.name or default_name,
        description=layer.description if layer.description is not None else p.description,
        integer_only=layer.integer_only if layer.integer_only is not None else p.integer_only,
        accumulator=layer.accumulator.over(p.accumulator),
        ops=layer.ops if layer.ops is not None else p.ops,
        fusions=layer.fusions if layer.fusions is not None else p.fusions,
        fixed_outputs=fixed,
        roles=roles,
        op_roles=op_roles,
        op_accumulators=op_acc,
        positions=positions,
        source=source,
        extends_chain=((p.name,) + p.extends_chain) if parent is not None else (),
        spans=spans,
    )


def _strings(lt: LocatedToml, path, choices, diags, what: str) -> list[str]:
    out = []
    for i, v in enumerate(lt.get(path)):
        got = check_choice(lt, path + (i,), choices, diags, what=what)
        if got is not None:
            out.append(got)
    return out


def _kinds(lt: LocatedToml, path, diags) -> list:
    """A role's allowed kinds: built-in kinds as :class:`Kind`, minifloat formats by name
    (``fp8_e4m3``, ``fp4_e2m1``, ``fp6_e3m2_b2``...; qdsl/spec/formats.py), each bad entry
    located: a malformed minifloat name says what is wrong with it."""
    builtin = [k.value for k in Kind]
    out = []
    for i, v in enumerate(lt.get(path)):
        if isinstance(v, str) and v in builtin:
            out.append(Kind(v))
        elif isinstance(v, str) and minifloat_format(v) is not None:
            out.append(v)
        elif isinstance(v, str) and looks_like_minifloat(v):
            message, hint = minifloat_problem(v)
            diags.append(Diagnostic.error("E105", f"unknown kind: {message}", lt.span(path + (i,)), hint))
        else:
            check_choice(lt, path + (i,), builtin + list(MINIFLOAT_PRESETS), diags, what="kind")
    return out


def _ints(lt: LocatedToml, path, lo: int, hi: int, diags, what: str) -> list[int]:
    out = []
    for i, v in enumerate(lt.get(path)):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            diags.append(Diagnostic.error("E102", f"{what} must be an integer, got {type(v).__name__}",
                                          lt.span(path + (i,))))
        elif check_range(lt, path + (i,), lo, hi, diags, what=what) is not None:
            out.append(v)
    return out


def _fusions(lt: LocatedToml, diags) -> list[tuple[str, ...]]:
    out = []
    for i, v in enumerate(lt.get(("fusions",))):
        span = lt.span(("fusions", i))
        if not isinstance(v, str) or "+" not in v:
            diags.append(Diagnostic.error("E102", 'a fusion is a string of ops joined by "+"', span,
                                          'e.g. "conv2d+relu"'))
            continue
        parts = tuple(p.strip() for p in v.split("+"))
        bad = [p for p in parts if p not in KNOWN_OPS]
        for p in bad:
            diags.append(Diagnostic.error("E105", f"unknown op '{p}' in fusion '{v}'", span,
                                          did_you_mean(p, KNOWN_OPS, "ops")))
        if not bad:
            out.append(parts)
    return out


def _accumulator(lt: LocatedToml, path, diags) -> AccumulatorCaps:
    body = check_keys(lt, path, _ACC, diags)
    bits = None
    if "bits" in body:
        bits = check_range(lt, path + ("bits",), 2, 64, diags, what="accumulator bits")
    overflow = None
    if "overflow" in body:
        got = check_choice(lt, path + ("overflow",), [o.value for o in Overflow], diags, what="overflow behaviour")
        overflow = Overflow(got) if got else None
    pair = None
    if "pair_bits" in body:
        pair = check_range(lt, path + ("pair_bits",), 2, 64, diags, what="pair_bits")
    return AccumulatorCaps(bits, overflow, lt.key_span(path), pair)


def _role_table(lt: LocatedToml, path, diags) -> dict[Role, TensorCaps]:
    body = check_keys(lt, path, _ROLE_KEYS, diags, what="role")
    return {Role(r): _caps(lt, path + (r,), diags) for r in body}


def _caps(lt: LocatedToml, path, diags) -> TensorCaps:
    body = check_keys(lt, path, _CAPS, diags)
    values: dict[str, Any] = {}
    spans = {k: lt.span(path + (k,)) for k in body}
    if "kinds" in body:
        values["kinds"] = tuple(_kinds(lt, path + ("kinds",), diags))
    if "bits" in body:
        values["bits"] = tuple(_ints(lt, path + ("bits",), 1, 32, diags, "bits"))
    if "signedness" in body:
        values["signedness"] = tuple(_strings(lt, path + ("signedness",), ["signed", "unsigned"], diags,
                                              "signedness"))
    if "scales" in body:
        allowed = SCALE_CLASSES if path[-1] == "bias" else SCALE_CLASSES[:2]
        # a scale coded in a minifloat (NVFP4's fp8_e4m3 block scales) is a class of its own
        values["scales"] = tuple(_strings(lt, path + ("scales",), list(allowed) + list(MINIFLOAT_PRESETS), diags,
                                          "scale"))
    if "granularities" in body:
        values["granularities"] = tuple(GranularityKind(g) for g in _strings(
            lt, path + ("granularities",), [g.value for g in GranularityKind], diags, "granularity"))
    if "channel_axes" in body:
        values["channel_axes"] = tuple(_ints(lt, path + ("channel_axes",), -8, 8, diags, "channel axis"))
    if "group_sizes" in body:
        values["group_sizes"] = tuple(_ints(lt, path + ("group_sizes",), 1, 1 << 20, diags, "group size"))
    for key in ("zero_point", "dynamic", "thresholds"):
        if key in body:
            values[key] = body[key]
    if "narrow_range" in body:
        got = check_choice(lt, path + ("narrow_range",), [n.value for n in NarrowRange], diags, what="narrow_range")
        if got:
            values["narrow_range"] = NarrowRange(got)
    for key in ("kinds", "bits", "signedness", "scales", "granularities"):
        if key in values and not values[key] and key in body and not _diags_for(diags, spans[key]):
            diags.append(Diagnostic.error("E193", f"'{key}' is empty: nothing would be allowed", spans[key],
                                          "list at least one value, or leave the key out (no constraint)"))
    return TensorCaps(**values, field_spans=spans)


def _diags_for(diags: list[Diagnostic], span: Span) -> bool:
    """Whether a diagnostic already points inside ``span``'s line (avoid piling on)."""
    return any(d.span.file == span.file and d.span.line == span.line for d in diags)

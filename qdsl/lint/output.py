"""Lint reports as text, JSON and SARIF 2.1.0.

* text: the house diagnostic format (``Diagnostic.render``) and a summary line.
* JSON: ``{"tool", "profile", "summary": {"errors", "warnings"}, "diagnostics": [...]}``,
  one object per finding with ``code``, ``severity``, ``message``, ``file``, ``line``,
  ``column``, ``end_line``, ``end_column``, ``path`` (layer or cattrs-style path for
  findings without a line), ``hints`` and ``notes``.
* SARIF 2.1.0 (OASIS): ``version`` and ``$schema``; one run whose ``tool.driver`` names
  qdsl and lists every code of ``codes.CODES`` as a rule; one result per finding with
  ``ruleId``, ``ruleIndex``, ``level`` (error/warning/note), ``message.text`` and a
  location: a ``physicalLocation`` (artifact URI plus a 1-based region) when the
  finding has a file position, a ``logicalLocation`` (the layer) when it names one, and
  otherwise a ``logicalLocation`` naming its origin (``<--set>``).
"""

from __future__ import annotations

import json
from typing import Iterable

from qdsl.lint.codes import CODES
from qdsl.spec.diagnostics import Diagnostic, Severity

__all__ = ["render_text", "to_json", "to_sarif", "SARIF_SCHEMA", "summary"]

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def summary(diags: Iterable[Diagnostic]) -> tuple[int, int]:
    diags = list(diags)
    errors = sum(d.severity is Severity.ERROR for d in diags)
    warnings = sum(d.severity is Severity.WARNING for d in diags)
    return errors, warnings


def render_text(diags: list[Diagnostic], profile_name: str = "") -> str:
    errors, warnings = summary(diags)
    target = f" against {profile_name}" if profile_name else ""
    if not diags:
        return f"lint{target}: no findings"
    body = "\n\n".join(d.render() for d in diags)
    return f"{body}\n\nlint{target}: {errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}"


def _record(d: Diagnostic) -> dict:
    s = d.span
    return {
        "code": d.code,
        "severity": d.severity.value,
        "message": d.message,
        "file": s.file,
        "line": s.line if s.known else None,
        "column": s.col if s.known else None,
        "end_line": s.end_line if s.known else None,
        "end_column": s.end_col if s.known else None,
        "path": s.path,
        "hints": list(d.hints),
        "notes": list(d.notes),
    }


def to_json(diags: list[Diagnostic], profile_name: str = "") -> str:
    errors, warnings = summary(diags)
    doc = {
        "tool": "qdsl lint",
        "profile": profile_name,
        "summary": {"errors": errors, "warnings": warnings},
        "diagnostics": [_record(d) for d in diags],
    }
    return json.dumps(doc, indent=2)


def _uri(file: str) -> str:
    return file.replace("\\", "/")


def to_sarif(diags: list[Diagnostic], profile_name: str = "", version: str = "") -> str:
    codes = list(CODES)
    for d in diags:  # codes from other layers (e.g. a resolver note) still get a rule
        if d.code not in codes:
            codes.append(d.code)
    rules = [{"id": c, "name": c, "shortDescription": {"text": CODES.get(c, c)}} for c in codes]
    results = []
    for d in diags:
        text = d.message
        if d.hints:
            text += "\n" + "\n".join(f"hint: {h}" for h in d.hints)
        if d.notes:
            text += "\n" + "\n".join(f"note: {n}" for n in d.notes)
        result = {
            "ruleId": d.code,
            "ruleIndex": codes.index(d.code),
            "level": {"error": "error", "warning": "warning"}.get(d.severity.value, "note"),
            "message": {"text": text},
        }
        loc: dict = {}
        s = d.span
        if s.file and not s.file.startswith("<"):
            phys: dict = {"artifactLocation": {"uri": _uri(s.file)}}
            if s.known:
                region = {"startLine": s.line, "startColumn": max(1, s.col)}
                if s.end_line is not None and s.end_col is not None:
                    region["endLine"] = s.end_line
                    region["endColumn"] = max(1, s.end_col)
                phys["region"] = region
            loc["physicalLocation"] = phys
        if s.path and not s.path.startswith("$"):
            loc["logicalLocations"] = [{"fullyQualifiedName": s.path, "kind": "module"}]
        if not loc:  # e.g. a --set override: name where it came from
            loc["logicalLocations"] = [{"fullyQualifiedName": s.path or s.file or "<input>"}]
        result["locations"] = [loc]
        results.append(result)
    driver = {"name": "qdsl", "rules": rules}
    if version:
        driver["version"] = version
    doc = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": driver},
            "properties": {"profile": profile_name},
            "results": results,
        }],
    }
    return json.dumps(doc, indent=2)

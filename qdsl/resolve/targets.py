"""Rule targets: compile once, match against a :class:`ModelIndex` fast.

Guarantees:

* Every target is compiled exactly once per resolve (identical patterns share one
  compiled matcher), and a malformed target (empty, bad regex, unterminated ``[``)
  becomes an ``E218`` diagnostic at the target's span, never an exception.
* Matching is against dotted module names (``ModuleEntry.fqn``) or, for ``type:``,
  the module's class name; it never imports torch.

Target forms (DESIGN.md §2, STYLE.md "Naming"):

``layer1.0.conv1``  exact
    The full dotted name.  Specificity: exact-name.
``layer1.*.conv1``  glob
    ``*`` matches any run of characters inside one dotted component, ``?`` one character
    other than ``.``, ``[abc]`` / ``[!abc]`` one character of (not of) the set - a negated
    set never matches ``.``.  ``**`` written as a whole component matches *zero or more*
    whole components: ``a.**.b`` matches ``a.b`` and ``a.x.y.b``, ``**.fc`` matches
    ``fc`` and ``head.fc``, ``a.**`` matches ``a`` itself and everything below it (so
    ``rule layer2.0.** { skip }`` leaves a whole block in float).  ``**`` inside a
    component (``layer**``) matches any characters, dots included.  The whole name must
    match.  Specificity: glob/regex.
``re:.*downsample.*``  regex
    Python ``re`` syntax, full match of the dotted name.  Specificity: glob/regex.
``type:Conv2d``  type
    The module's class name, compared exactly: subclasses do *not* match (the index only
    records ``type(module).__name__``; write one target per class).  Specificity: type.
``@first`` / ``@last``  position
    The first / last weighted layer in forward execution order (registration order when
    the model does not trace); defined in :mod:`qdsl.resolve.positions`.  Each names one
    module, so the specificity is exact-name.

Glob and regex targets also see the root module, whose name is ``""`` (so ``**`` and
``re:.*`` include it); exact targets cannot name it, ``type:`` can.
"""

from __future__ import annotations

import enum
import re
import difflib
from typing import Callable, Sequence

import attrs

from qdsl.resolve.plan import ModelIndex
from qdsl.resolve.positions import Positions, positions
from qdsl.spec.diagnostics import Diagnostic, did_you_mean
from qdsl.spec.model import TARGET_POSITIONS, Target, TargetKind

__all__ = [
    "Level",
    "CompiledTarget",
    "compile_target",
    "glob_to_regex",
    "compile_glob",
    "match_targets",
    "TargetMatcher",
    "unmatched_hint",
]


class Level(enum.IntEnum):
    """Cascade levels, lowest precedence first (DESIGN.md §2)."""

    BUILTIN = 0
    """Built-in defaults that fill fields nobody set."""
    DEFAULTS = 1
    """The spec's ``defaults`` block (weighted layers only)."""
    TYPE = 2
    """A rule whose most specific matching target is ``type:``."""
    GLOB = 3
    """A rule whose most specific matching target is a glob or ``re:``."""
    EXACT = 4
    """A rule whose most specific matching target is an exact name."""
    OVERRIDE = 5
    """API/CLI overrides (``--set``), above every rule."""

    @property
    def title(self) -> str:
        return _LEVEL_TITLES[self]


_LEVEL_TITLES = {
    Level.BUILTIN: "built-in default",
    Level.DEFAULTS: "defaults",
    Level.TYPE: "type",
    Level.GLOB: "glob/regex",
    Level.EXACT: "exact-name",
    Level.OVERRIDE: "override",
}

_KIND_LEVEL = {
    TargetKind.TYPE: Level.TYPE,
    TargetKind.GLOB: Level.GLOB,
    TargetKind.REGEX: Level.GLOB,
    TargetKind.EXACT: Level.EXACT,
    TargetKind.POSITION: Level.EXACT,  # names one module, as an exact name does
}


@attrs.frozen
class CompiledTarget:
    """A target ready to match: its cascade level and a name predicate (None for exact/type)."""

    target: Target
    level: Level
    fullmatch: Callable[[str], object] | None = attrs.field(default=None, eq=False)


def glob_to_regex(pattern: str) -> str:
    """Translate a dotted-name glob to an anchored-free regex body (use with ``fullmatch``).

    Raises ``ValueError`` for an unterminated ``[`` set.

    >>> glob_to_regex("layer1.*.conv?")
    'layer1\\\\.[^.]*\\\\.conv[^.]'
    """
    # Adjacent "**" components mean the same as one, and collapsing them keeps the
    # dot-folding below simple (each "**" component then has a literal neighbour).
    while "**.**" in pattern:
        pattern = pattern.replace("**.**", "**")
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**", i):
            start = i == 0 or pattern[i - 1] == "."
            end = i + 2 == n or pattern[i + 2] == "."
            if start and end:
                # A whole ``**`` component: zero or more whole components.  The dot that
                # separates it from its neighbours is folded into the optional group so
                # that "zero components" leaves no stray dot behind.
                if i == 0 and i + 2 == n:
                    out.append(".*")
                elif i == 0:  # "**.rest"
                    out.append(r"(?:.*\.)?")
                    i += 1  # swallow the following dot
                elif i + 2 == n:  # "head.**": the preceding dot is already emitted
                    out[-1] = r"(?:\..*)?"
                else:  # "a.**.b"
                    out[-1] = r"\.(?:.*\.)?"
                    i += 1
            else:
                out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^.]*")
        elif c == "?":
            out.append("[^.]")
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] in "!^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                raise ValueError(f"unterminated '[' at position {i + 1}")
            body = pattern[i + 1 : j]
            negate = body[:1] in ("!", "^")
            if negate:
                body = body[1:]
            body = body.replace("\\", "\\\\")
            out.append(f"[^.{body}]" if negate else f"[{body}]")
            i = j
        elif c == ".":
            out.append(r"\.")
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def compile_glob(pattern: str) -> Callable[[str], object]:
    """A ``fullmatch`` predicate for a glob (``ValueError`` if malformed)."""
    return re.compile(glob_to_regex(pattern), re.DOTALL).fullmatch


def compile_target(target: Target) -> CompiledTarget | Diagnostic:
    """Compile one target, or explain (E218) why it cannot match anything."""
    if not target.pattern:
        what = {TargetKind.TYPE: "class name after 'type:'", TargetKind.REGEX: "pattern after 're:'"}
        return Diagnostic.error(
            "E218", f"empty target: missing {what.get(target.kind, 'module name')}", target.span
        )
    level = _KIND_LEVEL[target.kind]
    if target.kind is TargetKind.POSITION and target.pattern not in TARGET_POSITIONS:
        return Diagnostic.error("E218", f"unknown positional target '{target.text}'", target.span,
                                "positional targets are @first and @last")
    try:
        if target.kind is TargetKind.REGEX:
            return CompiledTarget(target, level, re.compile(target.pattern).fullmatch)
        if target.kind is TargetKind.GLOB:
            return CompiledTarget(target, level, compile_glob(target.pattern))
    except (re.error, ValueError) as exc:
        return Diagnostic.error("E218", f"invalid target '{target.text}': {exc}", target.span)
    return CompiledTarget(target, level)


class TargetMatcher:
    """Matches compiled targets against one index; build once per resolve.

    Exact names are a dict lookup and types a precomputed grouping, so only glob/regex
    targets scan the names (one C-level ``filter`` per distinct pattern, memoized).
    """

    def __init__(self, index: ModelIndex):
        self.index = index
        self._names = [e.fqn for e in index.entries]
        self._by_type: dict[str, list[str]] = {}
        for e in index.entries:
            self._by_type.setdefault(e.type_name, []).append(e.fqn)
        self._memo: dict[tuple[TargetKind, str], tuple[str, ...]] = {}
        self._positions: Positions | None = None

    @property
    def positions(self) -> Positions:
        """What ``@first`` / ``@last`` name on this index (computed on first use)."""
        if self._positions is None:
            self._positions = positions(self.index)
        return self._positions

    def match(self, ct: CompiledTarget) -> tuple[str, ...]:
        """Names of the modules ``ct`` matches, in index order."""
        key = (ct.target.kind, ct.target.pattern)
        hit = self._memo.get(key)
        if hit is None:
            kind = ct.target.kind
            if kind is TargetKind.EXACT:
                hit = (ct.target.pattern,) if ct.target.pattern in self.index.by_name else ()
            elif kind is TargetKind.TYPE:
                hit = tuple(self._by_type.get(ct.target.pattern, ()))
            elif kind is TargetKind.POSITION:
                fqn = self.positions.of(ct.target.pattern)
                hit = (fqn,) if fqn is not None else ()
            else:
                hit = tuple(filter(ct.fullmatch, self._names))
            self._memo[key] = hit
        return hit


def match_targets(compiled: Sequence[CompiledTarget], index: ModelIndex) -> list[tuple[str, ...]]:
    """For each compiled target, the names of the modules it matches (one-off convenience)."""
    matcher = TargetMatcher(index)
    return [matcher.match(ct) for ct in compiled]


def unmatched_hint(target: Target, index: ModelIndex) -> str:
    """A "did you mean" for a target that matched nothing (names or class names)."""
    if target.kind is TargetKind.TYPE:
        return did_you_mean(target.pattern, {e.type_name for e in index.entries}, "module types")
    if target.kind is TargetKind.POSITION:
        return "the model has no weighted layer (Linear, Conv1d/2d, ConvTranspose1d/2d, LSTM/GRU/RNN)"
    names = [e.fqn for e in index.entries if e.fqn]
    if target.kind is TargetKind.EXACT:
        close = difflib.get_close_matches(target.pattern, names, n=3, cutoff=0.6)
        if close:
            return "did you mean " + ", ".join(f"'{c}'" for c in close) + "?"
    sample = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    return f"module names look like: {sample}" if names else "the model has no submodules"


"""Located diagnostics: the one error currency of qdsl.

Every problem a user can cause (a malformed spec, profile or graph file, a rule that
matches nothing, a lint finding) becomes a :class:`Diagnostic` with a :class:`Span`
pointing into the file that caused it.  Functions that can find several problems
collect them all and raise one :class:`SpecError` carrying the list (cattrs style),
so a user fixes a file in one pass instead of one error per run.

Rendering (``Diagnostic.render``) follows the house format::

    specs/resnet.qspec:14:39: error[E204]: unknown observer 'minmaxx'
      14 |   weight = int(bits=8, observer=minmaxx)
         |                                 ^^^^^^^
      hint: did you mean 'minmax'? known: minmax, mse, percentile

Code ranges are stable: E0xx syntax, E1xx schema, E2xx resolve, W3xx/E3xx lint,
E4xx graph files, E5xx runtime/apply.  This module never imports torch.
"""

from __future__ import annotations

import difflib
import enum
from typing import Iterable, Sequence

import attrs

__all__ = [
    "Severity",
    "Span",
    "Diagnostic",
    "QdslError",
    "QdslWarning",
    "SpecError",
    "NonFiniteError",
    "did_you_mean",
    "render_all",
]


class Severity(str, enum.Enum):
    """How bad a diagnostic is."""

    ERROR = "error"
    """The input cannot be used as it stands."""
    WARNING = "warning"
    """The input works, but probably not as the user meant."""
    NOTE = "note"
    """Extra context attached to another diagnostic."""


@attrs.frozen
class Span:
    """A location in a source file: 1-based line and column, end exclusive.

    ``source`` optionally carries the full text of the file so a diagnostic can be
    rendered without re-reading the file (and for in-memory specs that have no file).
    It is excluded from equality so spans compare by position only.
    """

    file: str = "<input>"
    line: int = 0
    col: int = 0
    end_line: int | None = None
    end_col: int | None = None
    path: str | None = attrs.field(default=None, eq=False)
    """Fallback cattrs-style path such as ``$.rules[2].weight.bits``."""
    source: str | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def known(self) -> bool:
        return self.line > 0

    def location(self) -> str:
        if self.known:
            return f"{self.file}:{self.line}:{self.col}"
        if self.path:
            return f"{self.file}:{self.path}"
        return self.file

    def source_line(self) -> str | None:
        if not self.known or self.source is None:
            return None
        lines = _source_lines(self.source)
        if 1 <= self.line <= len(lines):
            return lines[self.line - 1]
        return None

    def __str__(self) -> str:  # pragma: no cover - convenience
        return self.location()


UNKNOWN_SPAN = Span()


def _source_lines(text: str) -> list[str]:
    r"""Lines as spans count them: split at ``\n`` only (``str.splitlines`` also splits at
    U+0085, U+2028, form feeds..., which may sit inside a string and would shift lines)."""
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


@attrs.frozen
class Diagnostic:
    """One problem, with where it is and how to fix it."""

    severity: Severity
    code: str
    message: str
    span: Span = UNKNOWN_SPAN
    hints: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    notes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Context lines such as ``inside rule started at 9:3``."""

    @classmethod
    def error(cls, code: str, message: str, span: Span = UNKNOWN_SPAN, *hints: str, notes=()) -> Diagnostic:
        return cls(Severity.ERROR, code, message, span, hints, notes)

    @classmethod
    def warning(cls, code: str, message: str, span: Span = UNKNOWN_SPAN, *hints: str, notes=()) -> Diagnostic:
        return cls(Severity.WARNING, code, message, span, hints, notes)

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def render(self, source: str | None = None) -> str:
        """Render in the house format; ``source`` overrides ``span.source``."""
        span = self.span
        head = f"{span.location()}: {self.severity.value}[{self.code}]: {self.message}"
        out = [head]
        text = source if source is not None else span.source
        if span.known and text is not None:
            lines = _source_lines(text)
            if 1 <= span.line <= len(lines):
                src = lines[span.line - 1]
                num = str(span.line)
                pad = " " * len(num)
                out.append(f"  {num} | {src}")
                width = 1
                if span.end_col is not None and (span.end_line in (None, span.line)):
                    width = max(1, span.end_col - span.col)
                width = min(width, max(1, len(src) - span.col + 1))
                out.append(f"  {pad} | {' ' * max(0, span.col - 1)}{'^' * width}")
        for note in self.notes:
            out.append(f"  note: {note}")
        for hint in self.hints:
            out.append(f"  hint: {hint}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()


def render_all(diagnostics: Iterable[Diagnostic]) -> str:
    """Render several diagnostics separated by blank lines, errors first by position."""
    return "\n\n".join(d.render() for d in diagnostics)


class QdslError(Exception):
    """Base of every error qdsl raises for a user's mistake (not a bug in qdsl).

    The CLI prints ``str(err)`` and exits 2 without a traceback for any subclass.
    Examples: calibrating a model qdsl was never applied to, applying twice, a
    corrupt ``.qgraph`` file (``GraphFormatError``).
    """


class QdslWarning(UserWarning):
    """Base of every warning qdsl issues about a user's model or spec (something works,
    but probably not as meant): filter them all with
    ``warnings.filterwarnings("error", category=QdslWarning)``."""


class NonFiniteError(QdslError):
    """A NaN or infinite value reached a quantizer while the caller asked to be told
    (``check_finite=True`` on ``qdsl.apply``, ``run_graph``, ``CompiledGraph.run`` or the
    reference executor).  Without the option non-finite values follow the documented
    policy (docs/qgraph.md: NaN -> the zero point, +inf -> qmax, -inf -> qmin)."""


class SpecError(QdslError):
    """Raised with every diagnostic found in one pass (at least one of them an error).

    ``str(err)`` renders all of them, so an uncaught ``SpecError`` still reads well.
    The CLI prints ``err.render()`` and exits 2.
    """

    def __init__(self, diagnostics: Sequence[Diagnostic] | Diagnostic):
        if isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics: tuple[Diagnostic, ...] = tuple(diagnostics)
        if not self.diagnostics:
            raise ValueError("SpecError needs at least one diagnostic")
        super().__init__(self.render())

    def render(self) -> str:
        return render_all(self.diagnostics)

    @property
    def codes(self) -> list[str]:
        return [d.code for d in self.diagnostics]


def did_you_mean(word: str, known: Iterable[str], what: str = "") -> str:
    """A hint string: the closest known names and the full list.

    >>> did_you_mean("minmaxx", ["minmax", "mse", "percentile"])
    "did you mean 'minmax'? known: minmax, mse, percentile"
    """
    known = sorted(set(known))
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    listing = ", ".join(known)
    prefix = f"known{(' ' + what) if what else ''}: {listing}"
    if close:
        return f"did you mean '{close[0]}'? {prefix}"
    return prefix

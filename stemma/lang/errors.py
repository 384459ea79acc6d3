"""The errors of the frontend language; each message names what went wrong, and where."""
from __future__ import annotations

from stemma.lang.ir import Where


class ProgramError(Exception):
    """Base of the frontend's errors."""


class VariableNotGenerated(ProgramError, LookupError):
    """A program read a variable that no gen or select has written (or will write) in that state.
    `known`: the variables written so far; `pending`: those that calls still running will write
    (a read does not wait for calls that write other variables)."""

    def __init__(self, name: str, known: list[str], pending: list[str] = ()):
        have = ", ".join(sorted(known)) if known else "none"
        coming = f"; still being generated: {', '.join(sorted(pending))}" if pending else ""
        super().__init__(f"variable {name!r} was never generated in this program state "
                         f"(variables so far: {have}{coming})")
        self.name = name


class UnknownVariable(ProgramError, LookupError):
    """A text program refers to a variable that is neither an argument nor generated before it.
    `known`: the variables there are; `hint`: how to give one, where the caller knows."""

    def __init__(self, name: str, where: Where | None, known: list[str], hint: str = ""):
        at = f"{where}: " if where else ""
        have = ", ".join(sorted(known)) if known else "none"
        super().__init__(f"{at}unknown variable {{{name}}}: it is not an argument and not generated "
                         f"before this point (known: {have}){'; ' + hint if hint else ''}")
        self.name = name
        self.where = where


class StmSyntaxError(ProgramError, SyntaxError):
    """A text program does not parse, or a hole is malformed."""

    def __init__(self, message: str, where: Where, context: str = ""):
        text = f"{where}: {message}"
        if context:
            text += "\n" + context
        super().__init__(text)
        self.where = where
        self.lineno = where.line
        self.offset = where.column

    def __str__(self) -> str:  # SyntaxError's own __str__ would drop the context lines
        return self.args[0]


class RoleError(ProgramError):
    """Role blocks that do not nest: a turn opened inside another, or closed without being open."""


class GenerationFailed(ProgramError):
    """A model call of the program ended in error on the server (a constraint that did not
    compile in time, a step that failed): the program stops with it, as on SGLang, rather than
    reading an empty value. `name`: the gen's or select's variable; `output`: the call's output."""

    def __init__(self, what: str, name: str | None, error: str, output=None):
        super().__init__(f"{what} {name!r} failed: {error}" if name else f"{what} failed: {error}")
        self.name = name
        self.output = output


class BackendUnreachable(ProgramError, ConnectionError):
    """No stemma server answers at the address of a remote backend."""

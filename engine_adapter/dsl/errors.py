"""DSL errors carry a line, a column and a caret snippet of the source."""

from __future__ import annotations

from kvstore.errors import InvalidInputError, KVSieveError


class ProgramError(InvalidInputError):
    """A program that does not parse or does not pass the planner's checks."""

    def __init__(self, message: str, source: str = "", line: int = 0, column: int = 0) -> None:
        self.message, self.line, self.column = message, line, column
        super().__init__(_render(message, source, line, column))


class ProgramRuntimeError(KVSieveError):
    """A program that failed while running (deadline, engine error); everything was released."""


def _render(message: str, source: str, line: int, column: int) -> str:
    if not line:
        return message
    lines = source.splitlines()
    text = lines[line - 1] if 0 < line <= len(lines) else ""
    return f"line {line}, column {column}: {message}\n  {text}\n  {' ' * max(column - 1, 0)}^"

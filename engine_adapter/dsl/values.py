"""Values at run time: frames of slots, fork handles, and the text of values.

A frame holds one branch's variables at the slots the planner resolved; a fork
handle is the `Branch` it started (read as its value once it ends).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from engine_adapter.dsl.context import Context
from engine_adapter.dsl.ops import Slot, Template

_UNSET = object()


@dataclass
class Branch:
    """A running branch (the program's body or a fork); a fork handle in a frame is its Branch."""

    name: str
    ctx: Context
    steps: Generator[Any, Any, Any] | None = None
    request: Any = None  # what it waits for: a decode step or other branches
    send: Any = None  # what it gets when it resumes
    done: bool = False
    killed: bool = False
    value: Any = None


class Frame:
    """One branch's variables, indexed by the slots the planner resolved."""

    def __init__(self, size: int) -> None:
        self._values: list[Any] = [_UNSET] * size

    def __getitem__(self, slot: Slot) -> Any:
        value = self._values[slot.index]
        if value is _UNSET:  # only a plan the planner did not check can read an unset name
            raise KeyError(slot.name)
        return value

    def __setitem__(self, slot: Slot, value: Any) -> None:
        self._values[slot.index] = value

    def child(self, size: int, captures: tuple[tuple[int, int], ...]) -> Frame:
        """A fork body's frame: the values it may read copied from this one."""
        frame = Frame(size)
        for parent, child in captures:
            frame._values[child] = self._values[parent]
        return frame

    def render(self, template: Template) -> str:
        """A message's text, variables interpolated (lists join by newline)."""
        return "".join(p if isinstance(p, str) else as_text(value_of(self[p])) for p in template.parts)


def ready(entry: Any) -> bool:
    """Whether a frame entry can be yielded now: a value, or a fork that ended."""
    return not isinstance(entry, Branch) or entry.done or entry.killed


def value_of(entry: Any) -> Any:
    """The value of a frame entry: a fork handle reads as what its branch returned."""
    return entry.value if isinstance(entry, Branch) else entry


def as_text(value: Any) -> str:
    """A value as message text: a list joins by newline, nothing is empty."""
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return "" if value is None else str(value)


def list_items(text: str, complete_only: bool = False) -> list[str]:
    """Lines of a generated list, bullets and numbering removed."""
    lines = text.split("\n")
    if complete_only:
        lines = lines[:-1]  # the last line may still be growing
    items = []
    for line in lines:
        item = line.strip().lstrip("-*•").strip()
        item = item.split(". ", 1)[1] if item[:1].isdigit() and ". " in item[:4] else item
        if item:
            items.append(item)
    return items


class ListItems:
    """Items on the finished lines of a list being generated, counted as its text grows.

    Each stable line is read once, so counting stays linear in the answer's length.
    """

    def __init__(self) -> None:
        self.done = 0  # items on finished stable lines
        self._line: list[str] = []  # the stable text after the last newline

    def complete(self, stable: str, pending: str) -> int:
        """Items on finished lines once `stable` is appended (`pending` may still change)."""
        if "\n" in stable:
            first, *rest = stable.split("\n")
            self.done += len(list_items("\n".join(["".join(self._line) + first, *rest[:-1]])))
            self._line = [rest[-1]]
        else:
            self._line.append(stable)
        if "\n" not in pending:
            return self.done
        return self.done + len(list_items("".join(self._line) + pending, complete_only=True))

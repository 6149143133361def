"""The plan's operations: what the executor runs, with every name resolved to a slot.

The planner (`plan.py`) checks the syntax tree and lowers it to these frozen
dataclasses; the executor (`run.py`) matches on their types and never sees syntax.
A branch (the program's body, or a fork's) runs on a frame: a list of values indexed
by `Slot.index`. A fork's body has a frame of its own, which starts with copies of
the values it may read from its parent (`Fork.captures`) and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from engine_adapter.runner import Sampling


@dataclass(frozen=True)
class Slot:
    """A name resolved to its place in the frame of the branch that uses it."""

    name: str
    index: int


@dataclass(frozen=True)
class Template:
    """Message text: literal pieces and the variables interpolated between them, in order."""

    parts: tuple[str | Slot, ...]


@dataclass(frozen=True)
class Say:
    """Append a message (`system`, `user` or `assistant`) to the branch's conversation."""

    role: str
    text: Template


@dataclass(frozen=True)
class Gen:
    """Generate an assistant turn into `target` (a list of lines when `as_list`)."""

    target: Slot
    sampling: Sampling
    as_list: bool
    max_items: int


@dataclass(frozen=True)
class Select:
    """Put into `target` the option the model scores highest as the assistant's turn."""

    target: Slot
    options: tuple[str, ...]


@dataclass(frozen=True)
class Fork:
    """Start `body` as a branch on the current context; its handle goes into `target`.

    Attributes:
        captures: (parent slot index, child slot index) of each value the body may read.
        frame_size: slots of the body's frame.
    """

    target: Slot
    body: tuple[Op, ...]
    captures: tuple[tuple[int, int], ...]
    frame_size: int


@dataclass(frozen=True)
class Wait:
    """Block until the branches of these handles end."""

    handles: tuple[Slot, ...]


@dataclass(frozen=True)
class Yield:
    """Stream these values (a handle: when its branch ends), in order of readiness."""

    values: tuple[Slot, ...]


@dataclass(frozen=True)
class Kill:
    """Cancel the branch of `handle` before its next decode step."""

    handle: Slot


@dataclass(frozen=True)
class Return:
    """End the fork's branch with `value` as its value."""

    value: Slot


@dataclass(frozen=True)
class Cond:
    """`value == text` (kind "equals", value stripped) or `contains(value, text)`; maybe negated."""

    kind: str
    value: Slot
    text: str
    negated: bool


@dataclass(frozen=True)
class If:
    """Run `then` if `cond` holds, else `otherwise` (both in the same frame)."""

    cond: Cond
    then: tuple[Op, ...]
    otherwise: tuple[Op, ...]


Op: TypeAlias = Say | Gen | Select | Fork | Wait | Yield | Kill | Return | If

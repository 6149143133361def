"""The decoder DSL: whole multi-call workflows in one request.

Parse (`syntax`) -> plan (`plan`: names, types, limits) -> execute (`run`), as
separate typed stages. A program is text, parsed on the server; never Python,
never `exec`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from engine_adapter.dsl.errors import ProgramError, ProgramRuntimeError
from engine_adapter.dsl.plan import Limits, Plan, plan

if TYPE_CHECKING:
    from engine_adapter.dsl.run import Event
    from engine_adapter.runner import Engine

__all__ = ["Limits", "Plan", "ProgramError", "ProgramRuntimeError", "plan", "run_program"]


def run_program(
    engine: Engine, source: str, args: dict[str, Any], limits: Limits | None = None, keep: bool = False
) -> Iterator[Event]:
    """Plan and run a program on `engine`, streaming its events (yields, then done or error).

    Raises ProgramError before anything runs if the program or its arguments are wrong.
    """
    from engine_adapter.dsl.run import ProgramRun

    return ProgramRun(engine, plan(source, limits), args, keep=keep).events()

"""Plan: check a parsed program against names, types and limits before anything runs.

The planner knows no model and no threads. Because the language has no loops,
the number of calls and the tokens they may generate are bounded statically.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from engine_adapter.dsl.errors import ProgramError
from engine_adapter.dsl.syntax import (
    Fork,
    Gen,
    If,
    Kill,
    Message,
    Node,
    ProgramSyntax,
    Return,
    Select,
    Text,
    Wait,
    Yield,
    parse,
)
from engine_adapter.sampling import Sampling

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
GEN_ARGS = {"max_tokens", "stop", "temperature", "top_p", "seed", "type", "max_items"}
DEFAULT_GEN_TOKENS = 256


@dataclass(frozen=True)
class Limits:
    """Bounds checked before a program runs (all configurable).

    Attributes:
        max_source_bytes: program text size.
        max_calls: gen and select calls in the whole program.
        max_live_branches: forks running at the same time.
        max_fork_depth: forks nested in forks.
        max_total_tokens: sum of every gen's max_tokens.
        deadline_s: wall-clock time a run may take.
    """

    max_source_bytes: int = 64 << 10
    max_calls: int = 64
    max_live_branches: int = 16
    max_fork_depth: int = 4
    max_total_tokens: int = 16384
    deadline_s: float = 300.0


@dataclass(frozen=True)
class GenOp:
    """A checked gen call."""

    node: Gen
    sampling: Sampling
    as_list: bool
    max_items: int


@dataclass(frozen=True)
class Plan:
    """A program ready to execute: its syntax, checked gen settings, and its static cost."""

    syntax: ProgramSyntax
    gens: dict[int, GenOp]
    calls: int
    total_tokens: int
    limits: Limits

    def gen(self, node: Gen) -> GenOp:
        """The checked settings of a gen node."""
        return self.gens[id(node)]


@dataclass
class _Scope:
    """Names visible at one point of a branch.

    `partial` holds names defined on only some paths through an `if` (so not
    readable after it); it exists to make the error message say why.
    """

    values: set[str]
    handles: set[str]
    live: set[str] = field(default_factory=set)
    waited: set[str] = field(default_factory=set)
    partial: set[str] = field(default_factory=set)

    def child(self) -> _Scope:
        return _Scope(set(self.values) | self.waited, set(), set(), set())

    def copy(self) -> _Scope:
        return _Scope(
            set(self.values), set(self.handles), set(self.live), set(self.waited), set(self.partial)
        )

    def join(self, then: _Scope, otherwise: _Scope) -> None:
        """After an `if`: a name is defined only if both branches define it.

        Live branches are the union (a fork started on either path may still run),
        which keeps max_live_branches an upper bound.
        """
        both = (then.values | then.handles | then.waited) & (
            otherwise.values | otherwise.handles | otherwise.waited
        )
        either = (
            then.values | then.handles | then.waited | otherwise.values | otherwise.handles | otherwise.waited
        )
        self.values = then.values & otherwise.values
        self.handles = then.handles & otherwise.handles
        self.waited = then.waited & otherwise.waited
        self.live = then.live | otherwise.live
        self.partial = (
            (then.partial | otherwise.partial | (either - both)) - self.values - self.handles - self.waited
        )


class _Checker:
    def __init__(self, syntax: ProgramSyntax, limits: Limits) -> None:
        self.source, self.limits = syntax.source, limits
        self.gens: dict[int, GenOp] = {}
        self.calls = self.tokens = 0
        self.peak_live = 0

    def fail(self, node: Node, message: str) -> ProgramError:
        return ProgramError(message, self.source, node.line, node.column)

    def block(self, body: list[Node], scope: _Scope, depth: int, in_fork: bool) -> None:
        for node in body:
            self.stmt(node, scope, depth, in_fork)

    def stmt(self, node: Node, scope: _Scope, depth: int, in_fork: bool) -> None:
        if isinstance(node, Message):
            self.text(node.text, scope)
        elif isinstance(node, Gen):
            self.gen(node, scope)
        elif isinstance(node, Select):
            self.select(node, scope)
        elif isinstance(node, Fork):
            self.fork(node, scope, depth)
        elif isinstance(node, Wait):
            self.wait(node, scope)
        elif isinstance(node, Yield):
            for name in node.names:
                if not (self.readable(name, scope) or name in scope.handles):
                    raise self.fail(node, f"yield of unknown name {name!r}{_why(name, scope)}")
        elif isinstance(node, Kill):
            if node.name not in scope.handles:
                raise self.fail(
                    node, f"kill needs a fork handle; {node.name!r} is not one{_why(node.name, scope)}"
                )
            scope.live.discard(node.name)
        elif isinstance(node, Return):
            if not in_fork:
                raise self.fail(node, "return is only allowed inside a fork")
            if not self.readable(node.name, scope):
                raise self.fail(node, f"return of unknown name {node.name!r}{_why(node.name, scope)}")
        elif isinstance(node, If):
            self.if_(node, scope, depth, in_fork)

    def if_(self, node: If, scope: _Scope, depth: int, in_fork: bool) -> None:
        """Each branch in its own copy of the scope; after the `if`, only what both define."""
        name = node.cond.name
        if not self.readable(name, scope):
            raise self.fail(node.cond, f"if on unknown name {name!r}{_why(name, scope)}")
        then, otherwise = scope.copy(), scope.copy()
        self.block(node.then, then, depth, in_fork)
        self.block(node.otherwise, otherwise, depth, in_fork)
        scope.join(then, otherwise)

    def readable(self, name: str, scope: _Scope) -> bool:
        return name in scope.values or name in scope.waited

    def text(self, text: Text, scope: _Scope) -> None:
        names = [text.value] if text.is_param else PLACEHOLDER.findall(text.value)
        for name in names:
            if not self.readable(name, scope):
                kind = "parameter" if text.is_param else "variable"
                raise self.fail(text, f"undefined {kind} {name!r}{_why(name, scope)}")

    def define(self, node: Node, name: str, scope: _Scope) -> None:
        if name in scope.handles:
            raise self.fail(node, f"{name!r} is a fork handle and cannot be reassigned")
        scope.values.add(name)

    def count_call(self, node: Node, tokens: int) -> None:
        self.calls += 1
        self.tokens += tokens
        if self.calls > self.limits.max_calls:
            raise self.fail(node, f"more than {self.limits.max_calls} gen/select calls (max_calls)")
        if self.tokens > self.limits.max_total_tokens:
            raise self.fail(
                node, f"total max_tokens exceeds {self.limits.max_total_tokens} (max_total_tokens)"
            )

    def gen(self, node: Gen, scope: _Scope) -> None:
        unknown = sorted(set(node.kwargs) - GEN_ARGS)
        if unknown:
            raise self.fail(node, f"gen does not take {unknown}; allowed: {sorted(GEN_ARGS)}")
        op = self.gen_op(node)
        self.count_call(node, op.sampling.max_tokens)
        self.gens[id(node)] = op
        self.define(node, node.target, scope)

    def gen_op(self, node: Gen) -> GenOp:
        kw = node.kwargs
        stop = kw.get("stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        checks: list[tuple[str, bool, str]] = [
            ("max_tokens", isinstance(kw.get("max_tokens", 1), int), "an integer"),
            (
                "stop",
                isinstance(stop, list) and all(isinstance(s, str) and s for s in stop),
                "non-empty strings",
            ),
            ("temperature", isinstance(kw.get("temperature", 0.0), int | float), "a number"),
            ("top_p", isinstance(kw.get("top_p", 1.0), int | float), "a number"),
            ("seed", isinstance(kw.get("seed", 0), int), "an integer"),
            ("type", kw.get("type", "text") in ("text", "list"), '"text" or "list"'),
            (
                "max_items",
                isinstance(kw.get("max_items", 1), int) and kw.get("max_items", 1) >= 1,
                "an integer >= 1",
            ),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise self.fail(node, f"gen argument {name} must be {expected}, got {kw.get(name)!r}")
        if "max_items" in kw and kw.get("type") != "list":
            raise self.fail(node, 'max_items needs type="list"')
        try:
            sampling = Sampling(
                max_tokens=kw.get("max_tokens", DEFAULT_GEN_TOKENS),
                temperature=float(kw.get("temperature", 0.0)),
                top_p=float(kw.get("top_p", 1.0)),
                seed=kw.get("seed"),
                stop=tuple(stop),
            )
        except ValueError as exc:
            raise self.fail(node, str(exc)) from None
        return GenOp(node, sampling, kw.get("type") == "list", int(kw.get("max_items", 1 << 30)))

    def select(self, node: Select, scope: _Scope) -> None:
        if node.kwargs:
            raise self.fail(node, f"select takes only a list of options, got {sorted(node.kwargs)}")
        options = node.options
        if (
            not options
            or not all(isinstance(o, str) and o for o in options)
            or len(set(options)) != len(options)
        ):
            raise self.fail(node, "select needs a list of distinct, non-empty strings")
        self.count_call(node, 0)
        self.define(node, node.target, scope)

    def fork(self, node: Fork, scope: _Scope, depth: int) -> None:
        if depth + 1 > self.limits.max_fork_depth:
            raise self.fail(node, f"forks nested deeper than {self.limits.max_fork_depth} (max_fork_depth)")
        if node.target in scope.values or node.target in scope.handles:
            raise self.fail(node, f"{node.target!r} is already defined")
        self.block(node.body, scope.child(), depth + 1, in_fork=True)
        scope.handles.add(node.target)
        scope.live.add(node.target)
        if len(scope.live) > self.limits.max_live_branches:
            raise self.fail(
                node, f"more than {self.limits.max_live_branches} live branches (max_live_branches)"
            )

    def wait(self, node: Wait, scope: _Scope) -> None:
        for name in node.names:
            if name not in scope.handles:
                raise self.fail(node, f"wait needs fork handles; {name!r} is not one{_why(name, scope)}")
            scope.live.discard(name)
            scope.waited.add(name)


def _why(name: str, scope: _Scope) -> str:
    if name in scope.partial:
        return " (it is defined in only one branch of an if: define it in both, or use it inside)"
    return ""


def plan(source: str, limits: Limits | None = None) -> Plan:
    """Parse and check a program. Raises ProgramError (line, column, caret) on any problem."""
    limits = limits or Limits()
    size = len(source.encode())
    if size > limits.max_source_bytes:
        raise ProgramError(
            f"program text is {size} bytes; the limit is {limits.max_source_bytes} (max_source_bytes)"
        )
    syntax = parse(source)
    if len(set(syntax.params)) != len(syntax.params):
        raise ProgramError("program parameters must be distinct", source, 1, 1)
    checker = _Checker(syntax, limits)
    checker.block(syntax.body, _Scope(set(syntax.params), set()), 0, in_fork=False)
    return Plan(syntax, checker.gens, checker.calls, checker.tokens, limits)


def check_args(plan_: Plan, args: dict[str, Any]) -> dict[str, str]:
    """The program's arguments as strings; ProgramError for missing or unknown ones."""
    params = plan_.syntax.params
    missing = [p for p in params if p not in args]
    unknown = sorted(set(args) - set(params))
    if missing or unknown:
        signature = f"{plan_.syntax.name}({', '.join(params)})"
        raise ProgramError(f"program {signature}: missing arguments {missing}, unknown arguments {unknown}")
    return {k: str(v) for k, v in args.items()}

"""Plan: check a parsed program against names, types and limits, and lower it to typed ops.

The planner knows no model and no threads. Because the language has no loops,
the number of calls and the tokens they may generate are bounded statically.
What it returns is a tree of `ops` with every name resolved to a frame slot, so
the executor needs neither the syntax tree nor a table on the side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from engine_adapter.dsl import ops
from engine_adapter.dsl import syntax as syn
from engine_adapter.dsl.errors import ProgramError
from engine_adapter.dsl.ops import Slot
from engine_adapter.runner import Sampling

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
class Plan:
    """A program ready to execute: its operations, its static cost, and its limits.

    Attributes:
        syntax: the parsed program it was made from (name, parameters, source).
        params: the parameters' slots in the program body's frame.
        body: the program body's operations.
        frame_size: slots of the program body's frame.
        calls: gen and select calls in the whole program.
        total_tokens: sum of every gen's max_tokens.
        limits: the bounds it was checked against (the run's deadline among them).
    """

    syntax: syn.ProgramSyntax
    params: tuple[Slot, ...]
    body: tuple[ops.Op, ...]
    frame_size: int
    calls: int
    total_tokens: int
    limits: Limits

    @property
    def gens(self) -> dict[int, ops.Gen]:
        """Every gen operation of the program, numbered in program order."""
        return dict(enumerate(_gens(self.body)))


def _gens(body: tuple[ops.Op, ...]) -> list[ops.Gen]:
    found: list[ops.Gen] = []
    for op in body:
        match op:
            case ops.Gen():
                found.append(op)
            case ops.Fork(body=inner):
                found += _gens(inner)
            case ops.If(then=then, otherwise=otherwise):
                found += _gens(then) + _gens(otherwise)
    return found


@dataclass
class _Slots:
    """Slots of one branch's frame by name (the two arms of an `if` share their branch's)."""

    table: dict[str, Slot] = field(default_factory=dict)

    def __call__(self, name: str) -> Slot:
        if name not in self.table:
            self.table[name] = Slot(name, len(self.table))
        return self.table[name]


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
    slots: _Slots = field(default_factory=_Slots)  # of the branch's frame: shared by an if's arms

    def child(self) -> _Scope:
        """A fork body's scope: it reads its parent's values (copied into its own frame)."""
        return _Scope(set(self.values) | self.waited, set(), set(), set())

    def copy(self) -> _Scope:
        return _Scope(
            set(self.values), set(self.handles), set(self.live), set(self.waited), set(self.partial),
            self.slots,
        )  # fmt: skip

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
    """Checks statements in their scope and lowers each to its operation."""

    def __init__(self, syntax: syn.ProgramSyntax, limits: Limits) -> None:
        self.source, self.limits = syntax.source, limits
        self.calls = self.tokens = 0

    def fail(self, node: syn.Node, message: str) -> ProgramError:
        return ProgramError(message, self.source, node.line, node.column)

    def block(self, body: list[syn.Node], scope: _Scope, depth: int, in_fork: bool) -> tuple[ops.Op, ...]:
        return tuple(self.stmt(node, scope, depth, in_fork) for node in body)

    def stmt(self, node: syn.Node, scope: _Scope, depth: int, in_fork: bool) -> ops.Op:
        match node:
            case syn.Message(role=role, text=text):
                return ops.Say(role, self.text(text, scope))
            case syn.Gen():
                return self.gen(node, scope)
            case syn.Select():
                return self.select(node, scope)
            case syn.Fork():
                return self.fork(node, scope, depth)
            case syn.Wait():
                return self.wait(node, scope)
            case syn.Yield():
                return self.yield_(node, scope)
            case syn.Kill():
                return self.kill(node, scope)
            case syn.Return():
                return self.return_(node, scope, in_fork)
            case syn.If():
                return self.if_(node, scope, depth, in_fork)
        raise self.fail(node, f"unknown statement {type(node).__name__}")

    def yield_(self, node: syn.Yield, scope: _Scope) -> ops.Yield:
        for name in node.names:
            if not (self.readable(name, scope) or name in scope.handles):
                raise self.fail(node, f"yield of unknown name {name!r}{_why(name, scope)}")
        return ops.Yield(tuple(scope.slots(name) for name in node.names))

    def kill(self, node: syn.Kill, scope: _Scope) -> ops.Kill:
        if node.name not in scope.handles:
            raise self.fail(
                node, f"kill needs a fork handle; {node.name!r} is not one{_why(node.name, scope)}"
            )
        scope.live.discard(node.name)
        return ops.Kill(scope.slots(node.name))

    def return_(self, node: syn.Return, scope: _Scope, in_fork: bool) -> ops.Return:
        if not in_fork:
            raise self.fail(node, "return is only allowed inside a fork")
        if not self.readable(node.name, scope):
            raise self.fail(node, f"return of unknown name {node.name!r}{_why(node.name, scope)}")
        return ops.Return(scope.slots(node.name))

    def if_(self, node: syn.If, scope: _Scope, depth: int, in_fork: bool) -> ops.If:
        """Each branch in its own copy of the scope; after the `if`, only what both define."""
        cond = node.cond
        if not self.readable(cond.name, scope):
            raise self.fail(cond, f"if on unknown name {cond.name!r}{_why(cond.name, scope)}")
        then, otherwise = scope.copy(), scope.copy()
        then_ops = self.block(node.then, then, depth, in_fork)
        otherwise_ops = self.block(node.otherwise, otherwise, depth, in_fork)
        scope.join(then, otherwise)
        resolved = ops.Cond(cond.kind, scope.slots(cond.name), cond.text, cond.negated)
        return ops.If(resolved, then_ops, otherwise_ops)

    def readable(self, name: str, scope: _Scope) -> bool:
        return name in scope.values or name in scope.waited

    def text(self, text: syn.Text, scope: _Scope) -> ops.Template:
        # literal, name, literal, name, ..., literal
        pieces = ["", text.value] if text.is_param else PLACEHOLDER.split(text.value)
        for name in pieces[1::2]:
            if not self.readable(name, scope):
                kind = "parameter" if text.is_param else "variable"
                raise self.fail(text, f"undefined {kind} {name!r}{_why(name, scope)}")
        parts = [scope.slots(p) if i % 2 else p for i, p in enumerate(pieces)]
        return ops.Template(tuple(p for p in parts if p != ""))

    def define(self, node: syn.Node, name: str, scope: _Scope) -> Slot:
        if name in scope.handles:
            raise self.fail(node, f"{name!r} is a fork handle and cannot be reassigned")
        scope.values.add(name)
        return scope.slots(name)

    def count_call(self, node: syn.Node, tokens: int) -> None:
        self.calls += 1
        self.tokens += tokens
        if self.calls > self.limits.max_calls:
            raise self.fail(node, f"more than {self.limits.max_calls} gen/select calls (max_calls)")
        if self.tokens > self.limits.max_total_tokens:
            raise self.fail(
                node, f"total max_tokens exceeds {self.limits.max_total_tokens} (max_total_tokens)"
            )

    def gen(self, node: syn.Gen, scope: _Scope) -> ops.Gen:
        unknown = sorted(set(node.kwargs) - GEN_ARGS)
        if unknown:
            raise self.fail(node, f"gen does not take {unknown}; allowed: {sorted(GEN_ARGS)}")
        self.check_gen_args(node)
        kw = node.kwargs
        stop = kw.get("stop", [])
        try:
            sampling = Sampling(
                max_tokens=kw.get("max_tokens", DEFAULT_GEN_TOKENS),
                temperature=float(kw.get("temperature", 0.0)),
                top_p=float(kw.get("top_p", 1.0)),
                seed=kw.get("seed"),
                stop=(stop,) if isinstance(stop, str) else tuple(stop),
            )
        except ValueError as exc:
            raise self.fail(node, str(exc)) from None
        self.count_call(node, sampling.max_tokens)
        target = self.define(node, node.target, scope)
        return ops.Gen(target, sampling, kw.get("type") == "list", int(kw.get("max_items", 1 << 30)))

    def check_gen_args(self, node: syn.Gen) -> None:
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

    def select(self, node: syn.Select, scope: _Scope) -> ops.Select:
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
        return ops.Select(self.define(node, node.target, scope), tuple(options))

    def fork(self, node: syn.Fork, scope: _Scope, depth: int) -> ops.Fork:
        if depth + 1 > self.limits.max_fork_depth:
            raise self.fail(node, f"forks nested deeper than {self.limits.max_fork_depth} (max_fork_depth)")
        if node.target in scope.values or node.target in scope.handles:
            raise self.fail(node, f"{node.target!r} is already defined")
        child = scope.child()
        captures = tuple((scope.slots(n).index, child.slots(n).index) for n in sorted(child.values))
        body = self.block(node.body, child, depth + 1, in_fork=True)
        scope.handles.add(node.target)
        scope.live.add(node.target)
        if len(scope.live) > self.limits.max_live_branches:
            raise self.fail(
                node, f"more than {self.limits.max_live_branches} live branches (max_live_branches)"
            )
        return ops.Fork(scope.slots(node.target), body, captures, len(child.slots.table))

    def wait(self, node: syn.Wait, scope: _Scope) -> ops.Wait:
        for name in node.names:
            if name not in scope.handles:
                raise self.fail(node, f"wait needs fork handles; {name!r} is not one{_why(name, scope)}")
            scope.live.discard(name)
            scope.waited.add(name)
        return ops.Wait(tuple(scope.slots(name) for name in node.names))


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
    syntax = syn.parse(source)
    if len(set(syntax.params)) != len(syntax.params):
        raise ProgramError("program parameters must be distinct", source, 1, 1)
    checker = _Checker(syntax, limits)
    scope = _Scope(set(syntax.params), set())
    params = tuple(scope.slots(name) for name in syntax.params)
    body = checker.block(syntax.body, scope, 0, in_fork=False)
    return Plan(syntax, params, body, len(scope.slots.table), checker.calls, checker.tokens, limits)


def check_args(plan_: Plan, args: dict[str, Any]) -> dict[str, str]:
    """The program's arguments as strings; ProgramError for missing or unknown ones."""
    params = plan_.syntax.params
    missing = [p for p in params if p not in args]
    unknown = sorted(set(args) - set(params))
    if missing or unknown:
        signature = f"{plan_.syntax.name}({', '.join(params)})"
        raise ProgramError(f"program {signature}: missing arguments {missing}, unknown arguments {unknown}")
    return {k: str(v) for k, v in args.items()}

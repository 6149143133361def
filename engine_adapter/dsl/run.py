"""Execute: run a checked plan on the engine. Knows no syntax beyond the plan's nodes.

Each branch (the program's main body and every fork) is a generator that yields
requests to a scheduler: a decode step, or a wait for other branches. The
scheduler runs the decode steps of all live branches as one batch, so parallel
branches decode together; forks start from their parent's KV without
recomputing it (including text generated earlier in the program); `kill` drops a
branch before its next step and frees its KV. The program's prefix blocks are
pinned in the store while it runs and released at the end, on error, and when
the consumer stops reading (client disconnect).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_adapter.cache import share_cache
from engine_adapter.dsl.context import Context, batched_step
from engine_adapter.dsl.errors import ProgramRuntimeError
from engine_adapter.dsl.plan import PLACEHOLDER, GenOp, Plan, check_args
from engine_adapter.dsl.syntax import (
    Cond,
    Fork,
    Gen,
    If,
    Kill,
    Message,
    Node,
    Return,
    Select,
    Text,
    Wait,
    Yield,
)
from engine_adapter.engine import Engine
from engine_adapter.sampling import cut_at_stop, next_tokens


@dataclass(frozen=True)
class Event:
    """What a running program streams: a yielded value, an error, or the end."""

    kind: str  # "yield" | "error" | "done"
    name: str = ""
    value: Any = None
    elapsed_s: float = 0.0


@dataclass
class RunStats:
    """Work done by one run (for tests and benchmarks)."""

    prefill_tokens: int = 0
    decode_steps: int = 0
    max_batch: int = 0
    branch_tokens: dict[str, int] = field(default_factory=dict)
    killed_branches: list[str] = field(default_factory=list)  # stopped by `kill` while running


@dataclass
class _Decode:
    token: int
    position: int


@dataclass
class _WaitFor:
    branches: list[_Branch]
    any_of: bool = False


@dataclass
class _Returned:
    value: Any


@dataclass
class _Branch:
    name: str
    ctx: Context
    steps: Generator[Any, Any, Any] | None = None
    request: Any = None
    send: Any = None
    done: bool = False
    killed: bool = False
    value: Any = None


class ProgramRun:
    """One execution of a plan. Iterate `events()` to run it."""

    def __init__(
        self,
        engine: Engine,
        plan: Plan,
        args: dict[str, Any],
        keep: bool = False,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        self.engine, self.plan, self.keep = engine, plan, keep
        self._cancelled = cancelled or (lambda: False)
        self.args = check_args(plan, args)
        self.stats = RunStats()
        # Every branch ever started, in start order. Programs refer to a fork by the
        # handle in their scope (a _Branch), never by name: two forks may share a name
        # in different scopes (sibling forks' children, the two arms of an if).
        self._branches: list[_Branch] = []
        self._events: list[Event] = []
        self._started = time.perf_counter()
        self._lease: str | None = None
        tok = engine.lm.tokenizer
        self._assistant = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self._end = tok.encode("<|im_end|>\n", add_special_tokens=False)
        self._eos = engine.lm.eos_token_ids

    # -- the scheduler ------------------------------------------------------------

    def events(self) -> Iterator[Event]:
        """Run the program, streaming its events; releases everything however it ends."""
        main = _Branch("main", Context())
        main.steps = self._block(main, self.plan.syntax.body, dict(self.args), in_fork=False)
        self._branches.append(main)
        try:
            while not main.done:
                self._check_deadline()
                self._advance_runnable()
                yield from self._drain()
                if main.done:
                    break
                self._decode_round()
            yield from self._drain()
            ending = Event("done", elapsed_s=self._elapsed())
        except Exception as exc:  # any failure ends the stream with one error event, never a raise
            ending = Event("error", value=_describe(exc), elapsed_s=self._elapsed())
        finally:
            self._release()
        yield ending

    def _advance_runnable(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for branch in list(self._branches):
                if branch.done or branch.killed or isinstance(branch.request, _Decode):
                    continue
                if isinstance(branch.request, _WaitFor) and not self._satisfied(branch.request):
                    continue
                self._resume(branch)
                progressed = True

    def _resume(self, branch: _Branch) -> None:
        assert branch.steps is not None
        try:
            branch.request = branch.steps.send(branch.send)
            branch.send = None
        except StopIteration as stop:
            branch.done, branch.request = True, None
            branch.value = stop.value.value if isinstance(stop.value, _Returned) else stop.value

    def _decode_round(self) -> None:
        decoding = [b for b in self._branches if isinstance(b.request, _Decode) and not b.killed]
        if not decoding:
            waiting = [b.name for b in self._branches if isinstance(b.request, _WaitFor)]
            if waiting:
                raise ProgramRuntimeError(f"branches {waiting} wait on each other")
            return
        requests = [b.request for b in decoding]
        if len(decoding) == 1:
            ctx = decoding[0].ctx
            logits = self.engine.extend([requests[0].token], requests[0].position, ctx.cache)[-1:]
            caches = [ctx.cache]
        else:
            logits, caches = batched_step(
                self.engine.lm.model, [b.ctx.cache for b in decoding],
                [r.token for r in requests], [r.position for r in requests],
            )  # fmt: skip
        self.stats.decode_steps += 1
        self.stats.max_batch = max(self.stats.max_batch, len(decoding))
        for row, (branch, request) in enumerate(zip(decoding, requests, strict=True)):
            branch.ctx.cache = caches[row]
            branch.ctx.tokens.append(request.token)
            branch.send, branch.request = logits[row], None
            self.stats.branch_tokens[branch.name] = self.stats.branch_tokens.get(branch.name, 0) + 1

    def _satisfied(self, wait: _WaitFor) -> bool:
        finished = [b.done or b.killed for b in wait.branches]
        return any(finished) if wait.any_of else all(finished)

    # -- statements ---------------------------------------------------------------

    def _block(
        self, branch: _Branch, body: list[Node], scope: dict[str, Any], in_fork: bool
    ) -> Generator[Any, Any, Any]:
        for node in body:
            result = yield from self._stmt(branch, node, scope, in_fork)
            if isinstance(result, _Returned):
                return result
        return None

    def _stmt(
        self, branch: _Branch, node: Node, scope: dict[str, Any], in_fork: bool
    ) -> Generator[Any, Any, Any]:
        ctx = branch.ctx
        if isinstance(node, Message):
            ctx.pending += self._message(node.role, self._render(node.text, scope))
        elif isinstance(node, Gen):
            scope[node.target] = yield from self._gen(branch, self.plan.gen(node))
        elif isinstance(node, Select):
            scope[node.target] = self._select(ctx, node.options)
        elif isinstance(node, Fork):
            scope[node.target] = self._fork(branch, node, scope)
        elif isinstance(node, Wait):
            yield _WaitFor([scope[n] for n in node.names])
        elif isinstance(node, Yield):
            yield from self._yield(node, scope)
        elif isinstance(node, Kill):
            self._kill(scope[node.name])
        elif isinstance(node, If):
            chosen = node.then if self._holds(node.cond, scope) else node.otherwise
            return (yield from self._block(branch, chosen, scope, in_fork))
        elif isinstance(node, Return):
            return _Returned(_value(scope[node.name]))
        return None

    def _gen(self, branch: _Branch, op: GenOp) -> Generator[Any, Any, Any]:
        ctx = branch.ctx
        ctx.pending += self._assistant
        self._flush(ctx)
        generator = op.sampling.generator()
        logits, tokens = ctx.logits, []
        assert logits is not None
        while True:
            token = int(next_tokens(logits.unsqueeze(0), op.sampling, generator)[0])
            if token in self._eos:
                ctx.pending += [token, *self._end[1:]]
                break
            tokens.append(token)
            text, stopped = cut_at_stop(self._text(tokens), op.sampling.stop)
            full = op.as_list and len(_list_items(text, complete_only=True)) >= op.max_items
            if stopped or full or len(tokens) == op.sampling.max_tokens:
                ctx.pending += [token, *self._end]
                break
            logits = yield _Decode(token, ctx.next_position)
        text = cut_at_stop(self._text(tokens), op.sampling.stop)[0]
        return _list_items(text)[: op.max_items] if op.as_list else text.strip()

    def _select(self, ctx: Context, options: list[str]) -> str:
        """The option with the highest mean log-likelihood per token (never anything else)."""
        ctx.pending += self._assistant
        self._flush(ctx)
        assert ctx.logits is not None
        best, best_score = options[0], float("-inf")
        for option in options:
            ids = self.engine.lm.tokenizer.encode(option, add_special_tokens=False)
            rows = [ctx.logits.unsqueeze(0)]
            if len(ids) > 1:
                cache = share_cache(ctx.cache, self.engine.lm.model.config)
                rows.append(self.engine.extend(ids[:-1], ctx.next_position, cache))
                self.stats.prefill_tokens += len(ids) - 1
            logprobs = torch.log_softmax(torch.cat(rows).float(), dim=-1)
            score = float(logprobs[torch.arange(len(ids)), torch.tensor(ids)].mean())
            if score > best_score:
                best, best_score = option, score
        ctx.pending += self.engine.lm.tokenizer.encode(best, add_special_tokens=False) + self._end
        return best

    def _fork(self, parent: _Branch, node: Fork, scope: dict[str, Any]) -> _Branch:
        self._flush(parent.ctx)  # the shared context is computed once, here, for every child
        ctx = parent.ctx
        child = _Branch(
            node.target,
            Context(list(ctx.tokens), [], share_cache(ctx.cache, self.engine.lm.model.config), ctx.logits),
        )
        child.steps = self._block(child, node.body, dict(scope), in_fork=True)
        self._branches.append(child)
        return child

    def _yield(self, node: Yield, scope: dict[str, Any]) -> Generator[Any, Any, None]:
        remaining = list(node.names)
        while remaining:  # in order of readiness
            for name in [n for n in remaining if _ready(scope[n])]:
                self._events.append(Event("yield", name, _value(scope[name]), self._elapsed()))
                remaining.remove(name)
            if remaining:
                yield _WaitFor([scope[n] for n in remaining], any_of=True)

    def _kill(self, branch: _Branch) -> None:
        if branch.done or branch.killed:
            return
        self.stats.killed_branches.append(branch.name)
        branch.killed, branch.request = True, None
        if branch.steps is not None:
            branch.steps.close()
        branch.ctx = Context()  # drop its KV now

    # -- helpers ------------------------------------------------------------------

    def _flush(self, ctx: Context) -> None:
        """Compute pending tokens: through the store for the program's first prompt."""
        if not ctx.pending:
            return
        ids = ctx.tokens + ctx.pending
        if ctx.cache is None:
            state = self.engine.prefill(ids)
            ctx.cache, ctx.logits = state.cache, state.logits
            self.stats.prefill_tokens += state.computed_tokens
            self._pin(ids)
        else:
            ctx.logits = self.engine.extend(ctx.pending, len(ctx.tokens), ctx.cache)[-1]
            self.stats.prefill_tokens += len(ctx.pending)
        ctx.tokens, ctx.pending = ids, []

    def _pin(self, ids: list[int]) -> None:
        store = self.engine.store
        if store is None or self._lease is not None:
            return
        ttl = self.plan.limits.deadline_s + 60
        lease = store.pin(ids, model=self.engine.lm.spec, namespace=self.engine.namespace, ttl_s=ttl)
        self._lease = lease.lease_id

    def _release(self) -> None:
        for branch in self._branches:
            if branch.steps is not None:
                branch.steps.close()
            branch.ctx = Context()
        if self._lease is not None and self.engine.store is not None and not self.keep:
            # Already expired (KeyError), or the store is gone (a sidecar killed mid-run):
            # the lease then ends by its TTL, and the run must still end its stream.
            with contextlib.suppress(Exception):
                self.engine.store.unpin(self._lease)
            self._lease = None

    def _message(self, role: str, text: str) -> list[int]:
        return list(
            self.engine.lm.tokenizer.encode(
                f"<|im_start|>{role}\n{text}<|im_end|>\n", add_special_tokens=False
            )
        )

    def _render(self, text: Text, scope: dict[str, Any]) -> str:
        if text.is_param:
            return _as_text(_value(scope[text.value]))
        return PLACEHOLDER.sub(lambda m: _as_text(_value(scope[m.group(1)])), text.value)

    def _holds(self, cond: Cond, scope: dict[str, Any]) -> bool:
        value = _as_text(_value(scope[cond.name]))
        result = value.strip() == cond.text if cond.kind == "equals" else cond.text in value
        return result != cond.negated

    def _text(self, tokens: list[int]) -> str:
        return str(self.engine.lm.tokenizer.decode(tokens, skip_special_tokens=True))

    def _elapsed(self) -> float:
        return round(time.perf_counter() - self._started, 4)

    def _check_deadline(self) -> None:
        if self._cancelled():
            raise ProgramRuntimeError("cancelled by the client")
        if self._elapsed() > self.plan.limits.deadline_s:
            raise ProgramRuntimeError(f"deadline of {self.plan.limits.deadline_s} s exceeded")

    def _drain(self) -> Iterator[Event]:
        events, self._events = self._events, []
        yield from events


def _ready(entry: Any) -> bool:
    """Whether a scope entry can be yielded now: a value, or a fork that ended."""
    return not isinstance(entry, _Branch) or entry.done or entry.killed


def _value(entry: Any) -> Any:
    """The value of a scope entry: a fork handle reads as what its branch returned."""
    return entry.value if isinstance(entry, _Branch) else entry


def _describe(exc: Exception) -> str:
    """One line for an error event: the run's own errors as they are, others with their type."""
    text = str(exc) if isinstance(exc, ProgramRuntimeError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def _as_text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return "" if value is None else str(value)


def _list_items(text: str, complete_only: bool = False) -> list[str]:
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

"""Execute: run a checked plan on the engine, matching on its typed operations (no syntax).

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
from collections.abc import Callable, Generator, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_adapter.dsl import ops
from engine_adapter.dsl.context import Context
from engine_adapter.dsl.errors import ProgramRuntimeError
from engine_adapter.dsl.plan import Plan, check_args
from engine_adapter.dsl.values import Branch, Frame, ListItems, as_text, list_items, ready, value_of
from engine_adapter.runner import BatchCache, Completion, Engine, Sampler, share_cache


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
    batch_sizes: list[int] = field(default_factory=list)  # rows in the batch at each decode step
    branch_tokens: dict[str, int] = field(default_factory=dict)
    killed_branches: list[str] = field(default_factory=list)  # stopped by `kill` while running


@dataclass
class _Decode:
    token: int
    position: int
    reserve: int  # steps the branch may still take (room to leave for it in the batch)


@dataclass
class _WaitFor:
    branches: list[Branch]
    any_of: bool = False


@dataclass
class _Returned:
    value: Any


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
        # handle in their scope (a Branch), never by name: two forks may share a name
        # in different scopes (sibling forks' children, the two arms of an if).
        self._branches: list[Branch] = []
        self._events: list[Event] = []
        self._started = time.perf_counter()
        self._lease: str | None = None
        self._eos = engine.lm.eos_token_ids
        # The KV of every decoding branch, one row each (keyed by id(branch)), kept
        # between steps: a branch enters when its answer starts and leaves when it ends.
        self.batch = BatchCache(engine.lm.model.config, engine.lm.dtype)

    # -- the scheduler ------------------------------------------------------------

    def events(self) -> Iterator[Event]:
        """Run the program, streaming its events; releases everything however it ends."""
        main = Branch("main", Context())
        frame = Frame(self.plan.frame_size)
        for slot in self.plan.params:
            frame[slot] = self.args[slot.name]
        main.steps = self._block(main, self.plan.body, frame)
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

    def _resume(self, branch: Branch) -> None:
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
        self._enter_batch([b for b in decoding if id(b) not in self.batch])
        by_key: dict[Hashable, Branch] = {id(b): b for b in decoding}
        if set(by_key) != set(self.batch.keys):  # every row decodes at every step
            raise RuntimeError("the decode batch holds rows of branches that are not decoding")
        rows = [by_key[key] for key in self.batch.keys]
        requests: list[_Decode] = [b.request for b in rows]
        logits = self.batch.step(
            self.engine.lm.model, [r.token for r in requests], [r.position for r in requests]
        )
        self.stats.decode_steps += 1
        self.stats.max_batch = max(self.stats.max_batch, len(rows))
        self.stats.batch_sizes.append(len(self.batch))
        for row, (branch, request) in enumerate(zip(rows, requests, strict=True)):
            branch.ctx.tokens.append(request.token)
            branch.send, branch.request = logits[row], None
            self.stats.branch_tokens[branch.name] = self.stats.branch_tokens.get(branch.name, 0) + 1

    def _enter_batch(self, branches: list[Branch]) -> None:
        """Copy starting answers' KV into the batch, once for the whole answer."""
        if not branches:
            return
        reserve = max(b.request.reserve for b in branches)
        self.batch.add([(id(b), b.ctx.cache) for b in branches], reserve)
        for branch in branches:
            branch.ctx.cache = None  # the batch row holds it until the answer ends

    def _leave_batch(self, branch: Branch) -> None:
        """An answer ended: the branch's KV (its row) becomes its own cache again."""
        if id(branch) in self.batch:
            branch.ctx.cache = self.batch.take(id(branch))

    def _satisfied(self, wait: _WaitFor) -> bool:
        finished = [b.done or b.killed for b in wait.branches]
        return any(finished) if wait.any_of else all(finished)

    # -- operations ---------------------------------------------------------------

    def _block(self, branch: Branch, body: tuple[ops.Op, ...], frame: Frame) -> Generator[Any, Any, Any]:
        for op in body:
            result = yield from self._op(branch, op, frame)
            if isinstance(result, _Returned):
                return result
        return None

    def _op(self, branch: Branch, op: ops.Op, frame: Frame) -> Generator[Any, Any, Any]:
        ctx = branch.ctx
        match op:
            case ops.Say(role=role, text=text):
                ctx.pending += self.engine.chat.append(ctx.conversation, role, frame.render(text))
            case ops.Gen(target=target):
                frame[target] = yield from self._gen(branch, op)
            case ops.Select(target=target, options=options):
                frame[target] = self._select(ctx, options)
            case ops.Fork(target=target):
                frame[target] = self._fork(branch, op, frame)
            case ops.Wait(handles=handles):
                yield _WaitFor([frame[h] for h in handles])
            case ops.Yield():
                yield from self._yield(op, frame)
            case ops.Kill(handle=handle):
                self._kill(frame[handle])
            case ops.If(cond=cond, then=then, otherwise=otherwise):
                return (yield from self._block(branch, then if _holds(cond, frame) else otherwise, frame))
            case ops.Return(value=value):
                return _Returned(value_of(frame[value]))
        return None

    def _gen(self, branch: Branch, op: ops.Gen) -> Generator[Any, Any, Any]:
        ctx = branch.ctx
        ctx.pending += self.engine.chat.reply(ctx.conversation)
        self._flush(ctx)
        sampler = Sampler(op.sampling)
        answer = Completion(self.engine.lm.tokenizer, op.sampling, self._eos)
        items = ListItems()
        logits = ctx.logits
        assert logits is not None
        while True:
            token = int(sampler(logits.unsqueeze(0))[0])
            if answer.add(token) is not None:
                break
            if op.as_list and items.complete(answer.stable, answer.pending) >= op.max_items:
                break
            logits = yield _Decode(token, ctx.next_position, op.sampling.max_tokens - len(answer.tokens))
        self._leave_batch(branch)
        closing = self.engine.chat.answered(ctx.conversation, answer.text)
        # The model's own end-of-turn token, when it wrote one, stands in for the template's.
        ctx.pending += [token, *closing[1:]] if answer.ended_by_eos else [token, *closing]
        return list_items(answer.text)[: op.max_items] if op.as_list else answer.text.strip()

    def _select(self, ctx: Context, options: tuple[str, ...]) -> str:
        """The option with the highest mean log-likelihood per token (never anything else)."""
        ctx.pending += self.engine.chat.reply(ctx.conversation)
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
            rows_at = torch.arange(len(ids), device=logprobs.device)
            score = float(logprobs[rows_at, torch.tensor(ids, device=logprobs.device)].mean())
            if score > best_score:
                best, best_score = option, score
        closing = self.engine.chat.answered(ctx.conversation, best)
        ctx.pending += self.engine.lm.tokenizer.encode(best, add_special_tokens=False) + closing
        return best

    def _fork(self, parent: Branch, op: ops.Fork, frame: Frame) -> Branch:
        self._flush(parent.ctx)  # the shared context is computed once, here, for every child
        child = Branch(op.target.name, parent.ctx.fork(self.engine.lm.model.config))
        child.steps = self._block(child, op.body, frame.child(op.frame_size, op.captures))
        self._branches.append(child)
        return child

    def _yield(self, op: ops.Yield, frame: Frame) -> Generator[Any, Any, None]:
        remaining = list(op.values)
        while remaining:  # in order of readiness
            for slot in [s for s in remaining if ready(frame[s])]:
                self._events.append(Event("yield", slot.name, value_of(frame[slot]), self._elapsed()))
                remaining.remove(slot)
            if remaining:
                yield _WaitFor([frame[s] for s in remaining], any_of=True)

    def _kill(self, branch: Branch) -> None:
        if branch.done or branch.killed:
            return
        self.stats.killed_branches.append(branch.name)
        branch.killed, branch.request = True, None
        if branch.steps is not None:
            branch.steps.close()
        if id(branch) in self.batch:
            self.batch.drop(id(branch))  # its row leaves the batch before the next step
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
            ctx.logits = self.engine.extend(ctx.pending, len(ctx.tokens), ctx.cache, last_only=True)[-1]
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
        self.batch.clear()
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


def _describe(exc: Exception) -> str:
    """One line for an error event: the run's own errors as they are, others with their type."""
    text = str(exc) if isinstance(exc, ProgramRuntimeError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def _holds(cond: ops.Cond, frame: Frame) -> bool:
    value = as_text(value_of(frame[cond.value]))
    result = value.strip() == cond.text if cond.kind == "equals" else cond.text in value
    return result != cond.negated

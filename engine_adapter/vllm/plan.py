"""Scheduler-side bookkeeping of the vLLM connector: which tokens to load and store, where.

Pure Python, no vLLM import: the connector feeds it the scheduler's events
(a lookup answered, blocks allocated, a step scheduled) and ships the resulting
`StepPlan` to the worker, which moves the bytes.

Two block sizes meet here. kvsieve matches and stores whole blocks of its own
(256 tokens by default); vLLM pages its cache in smaller blocks (`block_size`).
A load must end on a vLLM block boundary (vLLM counts loaded tokens in whole
blocks), so a sidecar hit is cut down to a multiple of `block_size`; a store
sends whole kvsieve blocks only, read from whichever vLLM blocks hold them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadOp:
    """Load `tokens`' KV from the sidecar and write positions [start, end) into the cache.

    Attributes:
        req_id: the vLLM request.
        tokens: the prefix to ask for (its length is the sidecar's hit, whole kvsieve blocks).
        start: first position to write (vLLM's own cache already holds the ones before).
        end: one past the last position to write; a multiple of the vLLM block size.
        block_table: vLLM block ids holding positions [0, end).
    """

    req_id: str
    tokens: tuple[int, ...]
    start: int
    end: int
    block_table: tuple[int, ...]


@dataclass(frozen=True)
class SaveOp:
    """Read positions [kv_start, len(tokens)) from the cache and store them with `tokens`.

    Attributes:
        req_id: the vLLM request.
        tokens: the prefix to store: whole kvsieve blocks of the prompt.
        kv_start: first position whose KV is sent (the sidecar already holds the ones before).
        block_table: vLLM block ids holding positions [0, len(tokens)).
    """

    req_id: str
    tokens: tuple[int, ...]
    kv_start: int
    block_table: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    """What the worker does in one engine step: loads before the forward, saves after."""

    loads: tuple[LoadOp, ...] = ()
    saves: tuple[SaveOp, ...] = ()


@dataclass
class _Request:
    prompt: list[int]
    sidecar_tokens: int  # the sidecar's hit for this prompt (whole kvsieve blocks)
    sidecar_up: bool  # False if the lookup failed: saving would fail too
    block_table: list[int] = field(default_factory=list)
    saved: bool = False
    saved_end: int = 0  # end of the prefix a SaveOp sent (0: none)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request of a scheduler step, as the tracker needs it.

    Attributes:
        req_id: the vLLM request.
        computed_tokens: tokens whose KV was in the cache before this step.
        scheduled_tokens: tokens computed by this step.
        new_blocks: block ids allocated since the previous step (all of them if `replace`).
        replace: the request was (re)scheduled with a complete block table.
    """

    req_id: str
    computed_tokens: int
    scheduled_tokens: int
    new_blocks: tuple[int, ...]
    replace: bool


class RequestTracker:
    """Per-request state from the first lookup until `forget`. Single-threaded (the scheduler's).

    Args:
        vllm_block_size: tokens per vLLM cache block.
        kvsieve_block_tokens: tokens per sidecar block.
        loads: read prefixes from the sidecar.
        saves: write new full blocks to the sidecar.
    """

    def __init__(self, vllm_block_size: int, kvsieve_block_tokens: int, loads: bool, saves: bool) -> None:
        self.vllm_block_size = vllm_block_size
        self.kvsieve_block_tokens = kvsieve_block_tokens
        self.loads = loads
        self.saves = saves
        self._requests: dict[str, _Request] = {}
        self._pending_loads: dict[str, tuple[int, int]] = {}  # req_id -> (start, end)

    def known(self, req_id: str) -> bool:
        """Whether the sidecar was already asked about this request."""
        return req_id in self._requests

    def on_lookup(self, req_id: str, prompt: list[int], sidecar_tokens: int | None) -> None:
        """Record the sidecar's answer for a prompt (None: the sidecar did not answer)."""
        self._requests[req_id] = _Request(list(prompt), sidecar_tokens or 0, sidecar_tokens is not None)

    def loadable_tokens(self, req_id: str, computed_tokens: int) -> int:
        """Tokens beyond `computed_tokens` that a load can supply, in whole vLLM blocks."""
        request = self._requests.get(req_id)
        if request is None or not self.loads:
            return 0
        end = request.sidecar_tokens // self.vllm_block_size * self.vllm_block_size
        return max(0, end - computed_tokens)

    def on_alloc(self, req_id: str, external_tokens: int) -> None:
        """vLLM allocated blocks for the last `external_tokens` tokens that `loadable_tokens` offered."""
        request = self._requests.get(req_id)
        if external_tokens > 0 and request is not None:
            end = request.sidecar_tokens // self.vllm_block_size * self.vllm_block_size
            self._pending_loads[req_id] = (end - external_tokens, end)

    def plan(self, scheduled: list[ScheduledRequest]) -> StepPlan:
        """The step's loads and saves; pending loads are consumed."""
        loads: list[LoadOp] = []
        saves: list[SaveOp] = []
        for item in scheduled:
            request = self._requests.get(item.req_id)
            if request is None:
                continue
            if item.replace:
                request.block_table = list(item.new_blocks)
            else:
                request.block_table.extend(item.new_blocks)
            span = self._pending_loads.pop(item.req_id, None)
            if span is not None:
                loads.append(self._load_op(item.req_id, request, *span))
            save = self._save_op(item, request)
            if save is not None:
                saves.append(save)
        self._pending_loads.clear()  # a load not scheduled this step is asked for again
        return StepPlan(tuple(loads), tuple(saves))

    def saved_span(self, req_id: str) -> tuple[int, int] | None:
        """Token positions [start, end) that a SaveOp of this request sent; None if none did."""
        request = self._requests.get(req_id)
        if request is None or not request.saved_end:
            return None
        return request.sidecar_tokens, request.saved_end

    def forget(self, req_id: str) -> None:
        """The request finished: drop its state."""
        self._requests.pop(req_id, None)
        self._pending_loads.pop(req_id, None)

    def _load_op(self, req_id: str, request: _Request, start: int, end: int) -> LoadOp:
        blocks = -(-end // self.vllm_block_size)
        return LoadOp(
            req_id,
            tuple(request.prompt[: request.sidecar_tokens]),
            start,
            end,
            tuple(request.block_table[:blocks]),
        )

    def _save_op(self, item: ScheduledRequest, request: _Request) -> SaveOp | None:
        prompt_done = item.computed_tokens + item.scheduled_tokens >= len(request.prompt)
        if not self.saves or request.saved or not request.sidecar_up or not prompt_done:
            return None
        request.saved = True
        full = len(request.prompt) // self.kvsieve_block_tokens * self.kvsieve_block_tokens
        if full <= request.sidecar_tokens:
            return None  # no new whole block: nothing to send
        request.saved_end = full
        blocks = -(-full // self.vllm_block_size)
        return SaveOp(
            item.req_id,
            tuple(request.prompt[:full]),
            request.sidecar_tokens,
            tuple(request.block_table[:blocks]),
        )

"""KV events for the blocks kvsieve holds, in vLLM's own hash space, for vLLM's event stream.

vLLM publishes `BlockStored` / `BlockRemoved` events for its GPU blocks, and drains a
connector's events into the same stream once per scheduler step (`take_events`). This
queue turns "kvsieve holds vLLM blocks [start, end) of this request" into `BlockStored`
events keyed by the request's `block_hashes` as vLLM computed them, so a router that
subscribes to vLLM alone sees the GPU blocks and kvsieve's tier with the same hashes,
and can match either.

Bounded: vLLM drains it every step, but a scheduler that stops stepping (or a
connector used outside vLLM's scheduler) must not let it grow: past `capacity` events
the oldest are dropped and counted (`dropped`), since a newer announcement is the
more useful one to a router.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvsieve")

#: kvsieve's tier as docs/integrations.md labels a durable tier (disk, Redis): Dynamo weighs it
#: as its `disk` tier, below vLLM's `GPU` blocks. The connector cannot see the sidecar's memory
#: cache, so it never claims `CPU`.
KVSIEVE_MEDIUM = MEDIUM_STORAGE
#: Default bound on undrained events (vLLM drains every step; this covers a long stall).
DEFAULT_EVENT_CAPACITY = 10_000


class HeldBlockEvents:
    """A bounded queue of `BlockStored` events for vLLM blocks that kvsieve holds.

    Args:
        block_size: vLLM's cache block size (tokens), the size the events describe.
        hash_block_size: the block size vLLM hashed requests at (`KVCacheConfig.hash_block_size`;
            None: the same as `block_size`).
        capacity: most events kept until `take`; older ones are dropped past it and counted.
        medium: the tier label of the events.
    """

    def __init__(
        self,
        block_size: int,
        hash_block_size: int | None = None,
        capacity: int = DEFAULT_EVENT_CAPACITY,
        medium: str = KVSIEVE_MEDIUM,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"event capacity must be at least 1, got {capacity}")
        self.block_size = block_size
        self.hash_block_size = hash_block_size or block_size
        self.capacity = capacity
        self.medium = medium
        self.dropped = 0
        self._queue: deque[BlockStored] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def announce(self, request: Request, start_block: int, end_block: int) -> None:
        """Queue a `BlockStored` for vLLM blocks [start_block, end_block) of `request`.

        Blocks beyond those vLLM has hashes for (never a full prompt block) are left out.
        """
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, self.block_size)
        end_block = min(end_block, len(hashes))
        if start_block >= end_block:
            return
        size = self.block_size
        parent = maybe_convert_block_hash(hashes[start_block - 1]) if start_block > 0 else None
        lora = request.lora_request
        event = BlockStored(
            block_hashes=[maybe_convert_block_hash(hashes[i]) for i in range(start_block, end_block)],
            parent_block_hash=parent,
            token_ids=list(request.all_token_ids[start_block * size : end_block * size]),
            block_size=size,
            lora_id=lora.adapter_id if lora else None,
            medium=self.medium,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(self._extra_keys(request, start_block, end_block)),
            group_idx=0,  # the connector serves single-group (full attention) models only
            session_id=getattr(request, "session_id", None),
        )
        if len(self._queue) >= self.capacity:
            self._queue.popleft()
            self.dropped += 1
            if self.dropped == 1:
                logger.warning(
                    "KVSieveConnector: %d KV events waited undrained; dropping the oldest (counted)",
                    self.capacity,
                )
        self._queue.append(event)

    def take(self) -> list[KVCacheEvent]:
        """Every queued event, oldest first; the queue is empty afterwards."""
        events: list[KVCacheEvent] = list(self._queue)
        self._queue.clear()
        return events

    def _extra_keys(self, request: Request, start_block: int, end_block: int) -> list[Any]:
        # vLLM's own per-block keys (LoRA name, cache salt on block 0, multimodal offsets): the
        # multimodal index runs from block 0, so the walk starts there.
        keys: list[Any] = []
        mm_index = 0
        for block in range(end_block):
            start = block * self.block_size
            block_keys, mm_index = generate_block_hash_extra_keys(
                request, start, start + self.block_size, mm_index
            )
            if block >= start_block:
                keys.append(block_keys)
        return keys

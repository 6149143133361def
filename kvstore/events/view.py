"""What subscribers were told the store holds, and the events that change it (no I/O, no threads).

`RouterView` turns the index's news (kvstore/index/listener.py) into vLLM KV events and keeps
what they announced, so that it announces a block once however often it hears of it, and can
describe everything at once (a snapshot) that is exact at the sequence number it is sent with.

A listed block is announced on the store's durable tier (`medium`); a block held whole in a
memory tier that caches a durable one is announced on `CPU` as well, and removed from `CPU`
when memory gives up one of its chunks (routers weigh the faster tier higher). Router blocks
shared by two stored blocks (same parent, same first tokens: kvstore/events/hashing.py) are
counted per tier, announced once and removed with their last holder.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvstore.events import hashing, wire
from kvstore.format.block_meta import BlockMeta

MEMORY_MEDIUM = "CPU"


class TierView:
    """The router blocks announced on one tier, with how many announced blocks hold each."""

    def __init__(self, medium: str, router_tokens: int) -> None:
        self.medium = medium
        self._router_tokens = router_tokens
        self._holders: dict[int, int] = {}  # router hash -> blocks holding it
        self._hashes: dict[bytes, list[int]] = {}  # block key -> its router hashes

    def holds(self, key: bytes) -> bool:
        return key in self._hashes

    def hold(self, meta: BlockMeta) -> wire.BlockStored | None:
        """Count `meta` as a holder of its router blocks; the event for those not held before.
        The ones held before lead (a router block's holders hold its parents), so the event
        starts where they end."""
        r = self._router_tokens
        hashes = hashing.router_hashes(meta, r)
        self._hashes[meta.key] = hashes
        holders = self._holders
        if hashes[0] not in holders:  # the usual case: nothing shared, one C call
            holders.update(dict.fromkeys(hashes, 1))
            new_from = 0
        else:
            new_from = len(hashes)
            for index, h in enumerate(hashes):
                held = holders.get(h, 0)
                holders[h] = held + 1
                if not held and index < new_from:
                    new_from = index
            if new_from == len(hashes):
                return None
        parent = hashing.parent_hash(meta) if new_from == 0 else hashes[new_from - 1]
        return wire.BlockStored(
            block_hashes=hashes[new_from:], parent_block_hash=parent,
            token_ids=meta.tokens[new_from * r :].tolist(), block_size=r, lora_id=None,
            medium=self.medium, lora_name=None, extra_keys=hashing.extra_keys(meta, len(hashes) - new_from),
        )  # fmt: skip

    def release(self, key: bytes) -> list[int]:
        """Uncount the block `key` as a holder; the router blocks it was the last holder of."""
        gone = []
        holders = self._holders
        for h in self._hashes.pop(key, ()):
            held = holders.pop(h, 0) - 1
            if held > 0:
                holders[h] = held
            else:
                gone.append(h)
        return gone


class RouterView:
    """Every tier's announcements, fed with the index's news; each method returns its events."""

    def __init__(self, medium: str, router_tokens: int) -> None:
        self._medium, self._router_tokens = medium, router_tokens
        self._announced: dict[bytes, BlockMeta] = {}  # listed blocks, parents first
        self._in_memory: set[bytes] = set()  # blocks the index says are whole in memory
        self._durable = TierView(medium, router_tokens)
        self._memory = TierView(MEMORY_MEDIUM, router_tokens)

    def reset(self, listed: Iterable[BlockMeta], in_memory: Iterable[bytes]) -> list[wire.Event]:
        """Start afresh (a snapshot): a clear, then every block on every tier that holds it."""
        self._announced = {meta.key: meta for meta in listed}
        self._in_memory = set(in_memory)
        return self.snapshot()

    def snapshot(self) -> list[wire.Event]:
        """A clear, then a stored event for every announced block, parents first, per tier."""
        self._durable = TierView(self._medium, self._router_tokens)
        self._memory = TierView(MEMORY_MEDIUM, self._router_tokens)
        events: list[wire.Event] = [wire.AllBlocksCleared()]
        metas = list(self._announced.values())
        events += _present(self._durable.hold(m) for m in metas)
        events += _present(self._memory.hold(m) for m in metas if self._memory_counts(m.key))
        return events

    def listed(self, metas: Iterable[BlockMeta]) -> Iterator[wire.Event]:
        for meta in metas:
            if meta.key in self._announced:
                continue
            self._announced[meta.key] = meta
            yield from _present([self._durable.hold(meta)])
            if self._memory_counts(meta.key):
                yield from _present([self._memory.hold(meta)])

    def unlisted(self, metas: Iterable[BlockMeta]) -> Iterator[wire.Event]:
        durable: list[int] = []
        memory: list[int] = []
        for meta in metas:
            if self._announced.pop(meta.key, None) is not None:
                durable += self._durable.release(meta.key)
                memory += self._memory.release(meta.key)
            self._in_memory.discard(meta.key)
        yield from self._removed(self._durable, durable)
        yield from self._removed(self._memory, memory)

    def in_memory(self, metas: Iterable[BlockMeta]) -> Iterator[wire.Event]:
        for meta in metas:
            self._in_memory.add(meta.key)
            announced = self._announced.get(meta.key)
            if announced is not None and self._memory_counts(meta.key) and not self._memory.holds(meta.key):
                yield from _present([self._memory.hold(announced)])

    def out_of_memory(self, keys: Iterable[bytes]) -> Iterator[wire.Event]:
        gone: list[int] = []
        for key in keys:
            self._in_memory.discard(key)
            gone += self._memory.release(key)
        yield from self._removed(self._memory, gone)

    def _memory_counts(self, key: bytes) -> bool:
        """Memory is announced apart only where it caches another tier (else it is `medium`)."""
        return self._medium != MEMORY_MEDIUM and key in self._in_memory

    def _removed(self, tier: TierView, hashes: list[int]) -> Iterator[wire.Event]:
        if hashes:
            yield wire.BlockRemoved(block_hashes=hashes, medium=tier.medium)


def _present(events: Iterable[wire.BlockStored | None]) -> list[wire.Event]:
    return [event for event in events if event is not None]

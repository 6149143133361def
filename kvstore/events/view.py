"""What subscribers were told the store holds, and the events that change it (no I/O, no threads).

`RouterView` turns the index's news (kvstore/index/listener.py) into vLLM KV events and keeps
what they announced, so that it announces a block once however often it hears of it, and can
describe everything at once (a snapshot) that is exact at the sequence number it is sent with.

A listed block is announced on the store's durable tier (`medium`); a block held whole in a
memory tier that caches a durable one is announced on `CPU` as well, and removed from `CPU`
when memory gives up one of its chunks (routers weigh the faster tier higher). Router blocks
shared by two stored blocks (same parent, same first tokens: kvstore/events/hashing.py) are
counted per tier, announced once and removed with their last holder.

This runs on the publisher's thread for every stored block, where its Python takes the GIL
from the storing threads: a block's router hashes are computed once (kept, shared by both
tiers, reused by snapshots) and the usual case (nothing shared) is a few C calls.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstore.events import hashing, wire
from kvstore.format.block_meta import BlockMeta

MEMORY_MEDIUM = "CPU"


class TierView:
    """The router blocks announced on one tier, and which announced blocks hold each.

    Router hashes chain (kvstore/events/hashing.py), so two stored blocks share a router block
    only if they share every one before it in the block, the first included: the blocks are
    grouped by their first router hash, and a router block is held while a block of its group
    has the same hashes up to it. The usual group is one block: announcing it is two dict
    entries, not one per router block (a count per router hash cost the publisher's thread a
    16-key dict update per stored block)."""

    def __init__(self, medium: str, router_tokens: int, token_lists: dict[bytes, list[int]]) -> None:
        self.medium = medium
        self._router_tokens = router_tokens
        self._groups: dict[int, list[bytes]] = {}  # first router hash -> keys of the blocks holding it
        self._hashes: dict[bytes, list[int]] = {}  # block key -> its router hashes
        self._token_lists = token_lists  # shared by the tiers: a block's list is made once a batch

    def holds(self, key: bytes) -> bool:
        return key in self._hashes

    def hashes_of(self, key: bytes) -> list[int] | None:
        """The router hashes of a block this tier holds (None: not held)."""
        return self._hashes.get(key)

    def hold(self, meta: BlockMeta, hashes: list[int]) -> wire.BlockStored | None:
        """Count `meta` (whose router hashes are `hashes`) as a holder of its router blocks; the
        event for those not held before. The ones held before lead (a router block's holders
        hold its parents), so the event starts where they end."""
        key = meta.key
        if key in self._hashes:
            return None
        self._hashes[key] = hashes
        group = self._groups.get(hashes[0])
        if group is None:  # the usual case: nothing shared
            self._groups[hashes[0]] = [key]
            return self._stored(meta, hashes, 0)
        new_from = self._shared(hashes, group)
        group.append(key)
        return None if new_from == len(hashes) else self._stored(meta, hashes, new_from)

    def release(self, key: bytes) -> list[int]:
        """Uncount the block `key` as a holder; the router blocks it was the last holder of."""
        hashes = self._hashes.pop(key, None)
        if hashes is None:
            return []
        group = self._groups[hashes[0]]
        group.remove(key)
        if not group:
            del self._groups[hashes[0]]
            return list(hashes)
        return hashes[self._shared(hashes, group) :]

    def _shared(self, hashes: list[int], group: list[bytes]) -> int:
        """How many of `hashes` lead the hashes of some block of `group` (held by another)."""
        longest = 0
        for other in group:
            common = 0
            for mine, theirs in zip(hashes, self._hashes[other], strict=False):
                if mine != theirs:
                    break
                common += 1
            longest = max(longest, common)
        return longest

    def describe(self, metas: Iterable[BlockMeta]) -> list[wire.Event]:
        """A stored event for every router block this tier holds, each once, parents first
        (`metas`: the held blocks in the order they were listed). Reads the kept hashes: no
        hashing, and the tier is left as it was."""
        seen: set[int] = set()
        events: list[wire.Event] = []
        for meta in metas:
            hashes = self._hashes[meta.key]
            new_from = 0
            while new_from < len(hashes) and hashes[new_from] in seen:
                new_from += 1
            if new_from < len(hashes):
                seen.update(hashes)
                events.append(self._stored(meta, hashes, new_from))
        return events

    def _stored(self, meta: BlockMeta, hashes: list[int], new_from: int) -> wire.BlockStored:
        r = self._router_tokens
        parent = hashing.parent_hash(meta) if new_from == 0 else hashes[new_from - 1]
        tokens = self._token_lists.get(meta.key)
        if tokens is None:
            tokens = self._token_lists[meta.key] = meta.tokens.tolist()
        # the default namespace (the usual case) has no salt: no call
        extra = (
            None
            if meta.namespace == hashing.DEFAULT_NAMESPACE_DIGEST
            else hashing.extra_keys(meta, len(hashes) - new_from)
        )
        return wire.BlockStored(  # positional (msgspec's keywords cost more): in field order
            hashes[new_from:] if new_from else hashes, parent,  # block_hashes, parent_block_hash
            tokens[new_from * r :] if new_from else tokens, r, None,  # token_ids, block_size, lora_id
            self.medium, None, extra,  # medium, lora_name, extra_keys
        )  # fmt: skip


class RouterView:
    """Every tier's announcements, fed with the index's news; each method returns its events."""

    def __init__(self, medium: str, router_tokens: int) -> None:
        self._medium, self._router_tokens = medium, router_tokens
        self._announced: dict[bytes, BlockMeta] = {}  # listed blocks, parents first
        self._in_memory: set[bytes] = set()  # blocks the index says are whole in memory
        # Token lists of the events made since `batch_done`: a block announced on both tiers
        # (listed, then whole in memory) makes its list once.
        self._token_lists: dict[bytes, list[int]] = {}
        self._durable = TierView(medium, router_tokens, self._token_lists)
        self._memory = TierView(MEMORY_MEDIUM, router_tokens, self._token_lists)

    def reset(self, listed: Iterable[BlockMeta], in_memory: Iterable[bytes]) -> list[wire.Event]:
        """Start afresh (a snapshot): a clear, then every block on every tier that holds it."""
        self._announced = {}
        self._in_memory = set(in_memory)
        self._durable = TierView(self._medium, self._router_tokens, self._token_lists)
        self._memory = TierView(MEMORY_MEDIUM, self._router_tokens, self._token_lists)
        return [wire.AllBlocksCleared(), *self.listed(listed)]

    def batch_done(self) -> None:
        """The events made so far were encoded: their token lists are not needed any more."""
        self._token_lists.clear()

    def snapshot(self) -> list[wire.Event]:
        """A clear, then a stored event for every announced block, parents first, per tier;
        the view itself does not change."""
        metas = list(self._announced.values())
        events: list[wire.Event] = [wire.AllBlocksCleared()]
        events += self._durable.describe(metas)
        events += self._memory.describe(m for m in metas if self._memory.holds(m.key))
        return events

    @property
    def num_blocks(self) -> int:
        """Blocks announced (what a snapshot describes)."""
        return len(self._announced)

    def listed(self, metas: Iterable[BlockMeta]) -> list[wire.Event]:
        events: list[wire.Event] = []
        announced, r, durable = self._announced, self._router_tokens, self._durable
        # memory is announced apart only where it caches another tier (`_memory_counts`)
        in_memory = self._in_memory if self._medium != MEMORY_MEDIUM else frozenset()
        router_hashes = hashing.router_hashes
        for meta in metas:  # per stored block, on the publisher's thread: kept to a few calls
            key = meta.key
            if key in announced:
                continue
            announced[key] = meta
            hashes = router_hashes(meta, r)
            if (event := durable.hold(meta, hashes)) is not None:
                events.append(event)
            if key in in_memory and (event := self._memory.hold(meta, hashes)) is not None:
                events.append(event)
        return events

    def unlisted(self, metas: Iterable[BlockMeta]) -> list[wire.Event]:
        durable: list[int] = []
        memory: list[int] = []
        for meta in metas:
            if self._announced.pop(meta.key, None) is not None:
                durable += self._durable.release(meta.key)
                memory += self._memory.release(meta.key)
            self._in_memory.discard(meta.key)
        return self._removed(self._durable, durable) + self._removed(self._memory, memory)

    def in_memory(self, metas: Iterable[BlockMeta]) -> list[wire.Event]:
        events: list[wire.Event] = []
        for meta in metas:
            self._in_memory.add(meta.key)
            announced = self._announced.get(meta.key)
            if announced is None or not self._memory_counts(meta.key) or self._memory.holds(meta.key):
                continue
            hashes = self._durable.hashes_of(meta.key)  # every announced block is held there
            if hashes is None:
                hashes = hashing.router_hashes(announced, self._router_tokens)
            if (event := self._memory.hold(announced, hashes)) is not None:
                events.append(event)
        return events

    def out_of_memory(self, keys: Iterable[bytes]) -> list[wire.Event]:
        gone: list[int] = []
        for key in keys:
            self._in_memory.discard(key)
            gone += self._memory.release(key)
        return self._removed(self._memory, gone)

    def _memory_counts(self, key: bytes) -> bool:
        """Memory is announced apart only where it caches another tier (else it is `medium`)."""
        return self._medium != MEMORY_MEDIUM and key in self._in_memory

    @staticmethod
    def _removed(tier: TierView, hashes: list[int]) -> list[wire.Event]:
        return [wire.BlockRemoved(block_hashes=hashes, medium=tier.medium)] if hashes else []

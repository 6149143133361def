"""BlockListener: who is told when the index lists or unlists a block, or when a block becomes
held whole in memory or stops being (KV events for routers).

The index calls a listener while it holds the lock that orders its changes, so the calls reach
the listener in the order the changes happened (a block is never reported gone before it is
reported listed). A listener must therefore return at once: queue the news, never do I/O here
(kvstore/events/publisher.py queues a reference and publishes from a thread of its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvstore.format.block_meta import BlockMeta


class BlockListener(Protocol):
    """Told of every change to the set of listed blocks. Both calls must not block or raise."""

    def blocks_listed(self, metas: Sequence[BlockMeta]) -> None:
        """These blocks were listed (their data is held); parents come before children."""

    def blocks_unlisted(self, metas: Sequence[BlockMeta]) -> None:
        """These blocks left the store (evicted, dropped as lost or corrupt)."""

    def blocks_in_memory(self, metas: Sequence[BlockMeta]) -> None:
        """These blocks are now held whole in memory (told only where memory caches a durable
        tier; they may be told before they are listed: a block enters memory before the tree)."""

    def blocks_out_of_memory(self, keys: Sequence[bytes]) -> None:
        """These blocks, held whole in memory before, lost chunks or left it."""

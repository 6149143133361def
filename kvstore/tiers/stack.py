"""The tiers one store reads and writes, fastest first: what readers and writers are given.

Readers (the block reader, the layer-record fetcher) and the writer need the tiers and
which of them is the shared remote one (whose bad values are misses, not errors); they
need nothing else of each other, so they share this small value instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.tiers.base import Tier
from kvstore.tiers.memory import MemoryTier

if TYPE_CHECKING:  # the remote link imports redis: only a store with a remote tier loads it
    from kvstore.tiers.remote.link import RemoteLink


@dataclass(frozen=True)
class TierStack:
    """Memory, then the durable tiers of this machine, then the shared remote tier (if any).

    Attributes:
        memory: the memory tier.
        local_durable: durable tiers on this machine (LMDB), written before anything else.
        remote: the shared remote tier with its breaker and write-behind queue, if configured.
    """

    memory: MemoryTier
    local_durable: tuple[Tier, ...]
    remote: RemoteLink | None = None
    durable: tuple[Tier, ...] = field(init=False)

    def __post_init__(self) -> None:
        remote = () if self.remote is None else (self.remote.tier,)
        object.__setattr__(self, "durable", (*self.local_durable, *remote))

    @property
    def all(self) -> tuple[Tier, ...]:
        """Every tier, fastest first."""
        return (self.memory, *self.durable)

    def is_remote(self, tier: Tier) -> bool:
        """Whether `tier` is the shared remote tier (its values may be another sidecar's)."""
        return self.remote is not None and tier is self.remote.tier

"""Storage tiers behind one interface, created by name with lazy imports."""

from __future__ import annotations

from typing import Any

from kvstore.tiers.base import Tier


def create_tier(kind: str, **options: Any) -> Tier:
    """Create a tier by name: "memory", "lmdb" or "redis".

    Imports the backend module only when asked, so that `import kvstore` needs
    neither lmdb nor redis.
    """
    if kind == "memory":
        from kvstore.tiers.memory import MemoryTier

        return MemoryTier(**options)
    if kind == "lmdb":
        from kvstore.tiers.disk.lmdb import LmdbTier

        return LmdbTier(**options)
    if kind == "redis":
        from kvstore.tiers.remote.redis import RedisTier

        return RedisTier(**options)
    raise ValueError(f"tier kind must be one of 'memory', 'lmdb', 'redis', got {kind!r}")

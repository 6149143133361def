"""Remote tier on Redis or Valkey, shared by many sidecars.

Keys are content hashes (docs/keys.md), so a sidecar finds blocks that another
one stored. A block's chunks and metadata are written in one MULTI/EXEC
transaction. The server's own eviction (`maxmemory-policy allkeys-lru`) bounds
its size: a chunk that vanished is a miss, never an error, and every chunk is
checksummed and identity-checked by the reader anyway.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import redis

from kvstore.errors import ChecksumError, KVSieveError
from kvstore.meta import BlockMeta
from kvstore.tiers.base import TierFullError, TierUsage, chunk_key


class RemoteUnavailableError(KVSieveError):
    """The Redis/Valkey server cannot be reached."""


class RedisTier:
    """Blocks in Redis/Valkey; see module docstring."""

    name = "redis"

    def __init__(self, url: str, prefix: str = "kvsieve", ttl_s: int | None = None) -> None:
        self._client: Any = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        self._prefix = prefix.encode()
        self._ttl = ttl_s
        try:
            self._client.ping()
        except redis.RedisError as exc:
            raise RemoteUnavailableError(f"cannot reach the remote tier at {url}: {exc}") from exc

    def put_block(self, meta: BlockMeta, chunks: Sequence[bytes]) -> None:
        old = self.get_meta(meta.key)
        pipe = self._client.pipeline(transaction=True)
        if old is not None and old.layout_version != meta.layout_version:
            pipe.delete(*self._chunk_keys(old))
        for index, data in enumerate(chunks):
            pipe.set(self._ckey(meta.key, meta.layout_version, index), data, ex=self._ttl)
        pipe.set(self._mkey(meta.key), meta.to_bytes(), ex=self._ttl)
        self._count(pipe, meta.nbytes - (old.nbytes if old else 0), 0 if old else 1,
                    meta.num_chunks - (old.num_chunks if old else 0))  # fmt: skip
        try:
            pipe.execute()
        except redis.ResponseError as exc:
            if "OOM" in str(exc):
                raise TierFullError(f"remote tier is out of memory: {exc}") from exc
            raise
        except redis.RedisError as exc:
            raise RemoteUnavailableError(f"remote tier write failed: {exc}") from exc

    def put_meta(self, meta: BlockMeta) -> bool:
        # XX: only if the block is still there; the remote may have evicted it.
        return bool(self._client.set(self._mkey(meta.key), meta.to_bytes(), xx=True, ex=self._ttl))

    def get_chunks(self, meta: BlockMeta, indices: Sequence[int]) -> list[memoryview | None]:
        if not indices:
            return []
        keys = [self._ckey(meta.key, meta.layout_version, i) for i in indices]
        try:
            values = self._client.mget(keys)
        except redis.RedisError:
            return [None] * len(indices)  # an unreachable remote is a miss, not a failure
        return [None if v is None else memoryview(v) for v in values]

    def get_meta(self, key: bytes) -> BlockMeta | None:
        return self.get_metas([key])[0]

    def get_metas(self, keys: Sequence[bytes]) -> list[BlockMeta | None]:
        """Metadata of several blocks in one round trip; None where missing or malformed."""
        if not keys:
            return []
        try:
            values = self._client.mget([self._mkey(k) for k in keys])
        except redis.RedisError:
            return [None] * len(keys)
        out: list[BlockMeta | None] = []
        for value in values:
            try:
                out.append(None if value is None else BlockMeta.from_bytes(value))
            except ChecksumError:
                out.append(None)
        return out

    def contains(self, key: bytes) -> bool:
        return bool(self._client.exists(self._mkey(key)))

    def delete_block(self, key: bytes) -> int:
        meta = self.get_meta(key)
        if meta is None:
            return 0
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._mkey(key), *self._chunk_keys(meta))
        self._count(pipe, -meta.nbytes, -1, -meta.num_chunks)
        pipe.execute()
        return meta.nbytes

    def iter_meta(self) -> Iterator[BlockMeta]:
        for mkey in self._client.scan_iter(match=self._prefix + b":m:*", count=1000):
            meta = self.get_meta(bytes(mkey)[len(self._prefix) + 3 :])
            if meta is not None:
                yield meta

    def usage(self) -> TierUsage:
        """Counters kept beside the data (approximate once Redis evicts on its own)."""
        names = [self._prefix + s for s in (b":used", b":blocks", b":chunks")]
        used, blocks, chunks = (max(int(v or 0), 0) for v in self._client.mget(names))
        return TierUsage(used, None, blocks, chunks)

    def close(self) -> None:
        self._client.close()

    def _count(self, pipe: Any, used: int, blocks: int, chunks: int) -> None:
        pipe.incrby(self._prefix + b":used", used)
        pipe.incrby(self._prefix + b":blocks", blocks)
        pipe.incrby(self._prefix + b":chunks", chunks)

    def _mkey(self, key: bytes) -> bytes:
        return self._prefix + b":m:" + key

    def _ckey(self, key: bytes, layout: int, index: int) -> bytes:
        return self._prefix + b":c:" + chunk_key(key, layout, index)

    def _chunk_keys(self, meta: BlockMeta) -> list[bytes]:
        return [self._ckey(meta.key, meta.layout_version, i) for i in range(meta.num_chunks)]

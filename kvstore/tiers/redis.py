"""Remote tier on Redis or Valkey (one server or a cluster), shared by many sidecars.

Keys are content hashes (docs/keys.md), so a sidecar finds blocks that another
one stored. Every key of one block carries the block key as a hash tag,
`<prefix>:{<block key hex>}:m` (metadata) and `<prefix>:{<hex>}:c:<layout>:<index>`
(chunks), so that in a cluster all of a block lives in one slot: it is written in
one MULTI/EXEC transaction and its chunks are read with one MGET. Reads of several
blocks go out as one pipeline, which the cluster client splits per node.

The remote tier is a cache that may be slow, down or evicting on its own
(`maxmemory-policy allkeys-lru`): every call has a short socket timeout and goes
through a circuit breaker (kvstore/tiers/breaker.py). A read that fails, times
out, is refused by the open breaker, or finds a value missing or malformed is a
miss, counted, never an error; a write that fails raises `RemoteUnavailableError`
(the store's write-behind worker counts and drops it). Usage counters live in one
hash, updated in the block's transaction on a single server and right after it in
a cluster (the hash sits in another slot).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvstore.errors import ChecksumError, KVSieveError
from kvstore.meta import BlockMeta
from kvstore.tiers.base import TierFullError, TierUsage
from kvstore.tiers.breaker import CircuitBreaker

T = TypeVar("T")
_FAILURES = (redis.RedisError, RedisClusterException, OSError)


class RemoteUnavailableError(KVSieveError):
    """The Redis/Valkey server cannot be reached, timed out, or the breaker is open."""


def parse_node(node: str) -> tuple[str, int]:
    """ "host:port" (or "redis://host:port") -> (host, port); ValueError naming the node if malformed."""
    text = node.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"remote node must be HOST:PORT, got {node!r}")
    return host, int(port)


class RedisTier:
    """Blocks in Redis/Valkey; see module docstring.

    Args:
        url: redis:// URL of one server (ignored when `nodes` is given).
        nodes: HOST:PORT of cluster nodes; non-empty selects cluster mode (any one
            reachable node is enough to discover the rest).
        prefix: namespace of every key, so that several deployments can share a server.
        ttl_s: expiry of every key; None keeps keys until the server evicts them.
        timeout_s: socket connect and read timeout of every call.
        breaker: the circuit breaker; a default one (3 failures, 1 s, up to 30 s) if None.
    """

    name = "redis"

    def __init__(
        self,
        url: str | None = None,
        nodes: Sequence[str] = (),
        prefix: str = "kvsieve",
        ttl_s: int | None = None,
        timeout_s: float = 0.5,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        if url is None and not nodes:
            raise ValueError("the remote tier needs a url or a list of cluster nodes")
        self.cluster = bool(nodes)
        self.breaker = breaker or CircuitBreaker()
        self._where = ",".join(nodes) if nodes else str(url)
        self._nodes = [parse_node(n) for n in nodes]
        self._url = url
        self._timeout_s = timeout_s
        self._prefix = prefix.encode()
        self._ttl = ttl_s
        self._counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self._client_lock = threading.Lock()
        self._client: Any = None
        # Reach the server once now, so that a typo shows at start-up; a server that is
        # merely down is not fatal: the breaker keeps the sidecar serving locally.
        self._call(lambda c: c.ping(), None)

    # -- Tier protocol ------------------------------------------------------------

    def put_block(self, meta: BlockMeta, chunks: Sequence[bytes]) -> None:
        self._call_or_raise(lambda c: self._put(c, meta, chunks), "write")

    def put_meta(self, meta: BlockMeta) -> bool:
        # XX: only if the block is still there; the remote may have evicted it.
        data = meta.to_bytes()
        return bool(self._call(lambda c: c.set(self._mkey(meta.key), data, xx=True, ex=self._ttl), False))

    def get_chunks(self, meta: BlockMeta, indices: Sequence[int]) -> list[memoryview | None]:
        return self.get_many([(meta, indices)])[0]

    def get_many(
        self, requests: Sequence[tuple[BlockMeta, Sequence[int]]]
    ) -> list[list[memoryview | None]]:
        """Chunks of several blocks in one pipeline (one MGET per block, grouped per node).

        A block whose read failed comes back as all None.
        """
        wanted = [(meta, list(indices)) for meta, indices in requests if indices]
        misses = [[None] * len(indices) for _, indices in requests]
        if not wanted:
            return misses  # type: ignore[return-value]

        def read(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for meta, indices in wanted:
                # MGET by name: redis-py's cluster pipeline refuses .mget(), but one block's
                # keys share a hash tag, so the node can answer them in one command.
                pipe.execute_command("MGET", *[self._ckey(meta.key, meta.layout_version, i) for i in indices])
            return list(pipe.execute())

        replies = iter(self._call(read, [[None] * len(ix) for _, ix in wanted]))
        out: list[list[memoryview | None]] = []
        for _meta, indices in requests:
            values = next(replies) if indices else []
            out.append([None if v is None else memoryview(v) for v in values])
        return out

    def get_meta(self, key: bytes) -> BlockMeta | None:
        return self.get_metas([key])[0]

    def get_metas(self, keys: Sequence[bytes]) -> list[BlockMeta | None]:
        """Metadata of several blocks in one round trip per node; None where missing or malformed."""
        if not keys:
            return []
        values = self._call(lambda c: self._read_metas(c, keys), [None] * len(keys))
        out: list[BlockMeta | None] = []
        for value in values:
            try:
                out.append(None if value is None else BlockMeta.from_bytes(value))
            except ChecksumError:
                self._add("corrupt")
                out.append(None)
        return out

    def contains(self, key: bytes) -> bool:
        return bool(self._call(lambda c: c.exists(self._mkey(key)), 0))

    def delete_block(self, key: bytes) -> int:
        meta = self.get_meta(key)
        if meta is None:
            return 0

        def delete(client: Any) -> None:
            pipe = client.pipeline(transaction=True)
            pipe.delete(self._mkey(key), *self._chunk_keys(meta))
            self._count_usage(client, pipe, -meta.nbytes, -1, -meta.num_chunks)

        self._call_or_raise(delete, "delete")
        return meta.nbytes

    def iter_meta(self) -> Iterator[BlockMeta]:
        pattern = self._prefix + b":{*}:m"
        mkeys = self._call(lambda c: list(c.scan_iter(match=pattern, count=1000)), [])
        for mkey in mkeys:
            tag = bytes(mkey)[len(self._prefix) + 2 : -3]
            meta = self.get_meta(bytes.fromhex(tag.decode()))
            if meta is not None:
                yield meta

    def usage(self) -> TierUsage:
        """Counters kept beside the data (approximate once Redis evicts on its own)."""
        fields = (b"used", b"blocks", b"chunks")
        values = self._call(lambda c: c.hmget(self._usage_key, fields), [0, 0, 0])
        used, blocks, chunks = (max(int(v or 0), 0) for v in values)
        return TierUsage(used, None, blocks, chunks)

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # -- health -------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """Failures seen so far: `errors`, `timeouts`, `refused` (breaker open), `corrupt`."""
        with self._count_lock:
            return dict(self._counts)

    def count_corrupt(self) -> None:
        """Count a value that a reader found malformed (a chunk failing its checksum)."""
        self._add("corrupt")

    # -- internals ----------------------------------------------------------------

    def _put(self, client: Any, meta: BlockMeta, chunks: Sequence[bytes]) -> None:
        old = self._read_metas(client, [meta.key])[0]
        old_meta = _parse_or_none(old)
        pipe = client.pipeline(transaction=True)
        if old_meta is not None and old_meta.layout_version != meta.layout_version:
            pipe.delete(*self._chunk_keys(old_meta))
        for index, data in enumerate(chunks):
            pipe.set(self._ckey(meta.key, meta.layout_version, index), data, ex=self._ttl)
        pipe.set(self._mkey(meta.key), meta.to_bytes(), ex=self._ttl)
        if old_meta is None:
            self._count_usage(client, pipe, meta.nbytes, 1, meta.num_chunks)
        else:
            self._count_usage(client, pipe, meta.nbytes - old_meta.nbytes, 0,
                              meta.num_chunks - old_meta.num_chunks)  # fmt: skip

    def _count_usage(self, client: Any, pipe: Any, used: int, blocks: int, chunks: int) -> None:
        """Queue the usage update and run `pipe`; in a cluster the counters go after it."""
        counts = pipe if not self.cluster else None
        if counts is not None:
            self._hincr(counts, used, blocks, chunks)
        try:
            pipe.execute()
        except redis.ResponseError as exc:
            if "OOM" in str(exc):
                raise TierFullError(f"remote tier is out of memory: {exc}") from exc
            raise
        if counts is None:
            after = client.pipeline(transaction=False)
            self._hincr(after, used, blocks, chunks)
            after.execute()

    def _hincr(self, pipe: Any, used: int, blocks: int, chunks: int) -> None:
        pipe.hincrby(self._usage_key, "used", used)
        pipe.hincrby(self._usage_key, "blocks", blocks)
        pipe.hincrby(self._usage_key, "chunks", chunks)

    def _read_metas(self, client: Any, keys: Sequence[bytes]) -> list[Any]:
        if not self.cluster:
            return list(client.mget([self._mkey(k) for k in keys]))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._mkey(key))
        return list(pipe.execute())

    def _call(self, op: Callable[[Any], T], miss: T) -> T:
        """Run `op(client)` under the breaker; `miss` when refused or failed (counted)."""
        try:
            return self._call_or_raise(op, "read")
        except RemoteUnavailableError:
            return miss

    def _call_or_raise(self, op: Callable[[Any], T], what: str) -> T:
        if not self.breaker.allow():
            self._add("refused")
            raise RemoteUnavailableError(f"remote tier {self._where}: circuit breaker open")
        try:
            result = op(self._connected())
        except TierFullError:
            self.breaker.success()  # the server answered: it is up, only full
            raise
        except _FAILURES as exc:
            self.breaker.failure()
            self._add("timeouts" if isinstance(exc, redis.TimeoutError | TimeoutError) else "errors")
            self._reset_client_if_cluster()
            raise RemoteUnavailableError(f"remote tier {self._where} {what} failed: {exc}") from exc
        except BaseException:
            self.breaker.failure()  # a probe must always report, or half-open never ends
            raise
        self.breaker.success()
        return result

    def _connected(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> Any:
        # No retries inside redis-py: the breaker decides when to try again (with backoff).
        options: dict[str, Any] = {
            "socket_timeout": self._timeout_s,
            "socket_connect_timeout": self._timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }
        if not self.cluster:
            return redis.Redis.from_url(str(self._url), **options)
        from redis.cluster import ClusterNode, RedisCluster

        startup = [ClusterNode(host, port) for host, port in self._nodes]
        # A cluster with a node down still serves the other nodes' slots.
        return RedisCluster(startup_nodes=startup, require_full_coverage=False, **options)

    def _reset_client_if_cluster(self) -> None:
        # After a node failure the slot map may be stale; rebuilding the client later
        # rediscovers the topology from whichever node answers.
        if self.cluster:
            self.close()

    def _add(self, name: str) -> None:
        with self._count_lock:
            self._counts[name] += 1

    @property
    def _usage_key(self) -> bytes:
        return self._prefix + b":usage"

    def _tag(self, key: bytes) -> bytes:
        return self._prefix + b":{" + key.hex().encode() + b"}"

    def _mkey(self, key: bytes) -> bytes:
        return self._tag(key) + b":m"

    def _ckey(self, key: bytes, layout: int, index: int) -> bytes:
        return self._tag(key) + b":c:%d:%d" % (layout, index)

    def _chunk_keys(self, meta: BlockMeta) -> list[bytes]:
        return [self._ckey(meta.key, meta.layout_version, i) for i in range(meta.num_chunks)]


def _parse_or_none(value: Any) -> BlockMeta | None:
    try:
        return None if value is None else BlockMeta.from_bytes(value)
    except ChecksumError:
        return None

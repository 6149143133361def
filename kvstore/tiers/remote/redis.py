"""Remote tier on Redis or Valkey (one server or a cluster), shared by many sidecars.

Keys are content hashes (docs/keys.md), so a sidecar finds blocks that another
one stored. Every key of one block carries the block key as a hash tag,
`<prefix>:{<block key hex>}:m` (metadata) and `<prefix>:{<hex>}:c:<layout>:<index>`
(chunks), so that in a cluster all of a block lives in one slot: it is written in
one MULTI/EXEC transaction and its chunks are read with one MGET (byte ranges of one
with GETRANGE). Reads of several blocks go out as one pipeline, split per node.

The remote tier is a cache that may be slow, down or evicting on its own
(`maxmemory-policy allkeys-lru`): every call has a short socket timeout and goes
through a circuit breaker (kvstore/tiers/remote/breaker.py). A read that fails, times
out, is refused by the open breaker, or finds a value missing or malformed is a
miss, counted, never an error; a write that fails raises `RemoteUnavailableError`
whatever the client library raised (the store's write-behind worker counts and drops
it). Usage counters live in one hash, updated in the block's transaction on a single
server and right after it in a cluster (the hash sits in another slot).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvstore.errors import ChecksumError, RemoteUnavailableError, TierFullError
from kvstore.format.block_meta import BlockMeta
from kvstore.stats import TierUsage
from kvstore.tiers.base import Span
from kvstore.tiers.remote.breaker import BreakerSnapshot, BreakerState, CircuitBreaker

T = TypeVar("T")
_FAILURES = (redis.RedisError, RedisClusterException, OSError)
_MISS: Any = object()  # a command whose node failed or was skipped (distinct from a nil reply)


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
        new_breaker: makes the circuit breaker of each node (one per cluster node, so
            that a dead node does not cut off the others); default 3 failures, 1 s.
    """

    name = "redis"

    def __init__(
        self,
        url: str | None = None,
        nodes: Sequence[str] = (),
        prefix: str = "kvsieve",
        ttl_s: int | None = None,
        timeout_s: float = 0.5,
        new_breaker: Callable[[], CircuitBreaker] = CircuitBreaker,
    ) -> None:
        if url is None and not nodes:
            raise ValueError("the remote tier needs a url or a list of cluster nodes")
        self.cluster = bool(nodes)
        self.new_breaker = new_breaker
        self.breakers: dict[str, CircuitBreaker] = {}
        self._where = ",".join(nodes) if nodes else str(url)
        self._nodes = [parse_node(n) for n in nodes]
        self._url = url
        self._timeout_s = timeout_s
        self._prefix = prefix.encode()
        self._ttl = ttl_s
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._client: Any = None
        self._stale_topology = False
        # Reach the server once now, so that a typo shows in the counters at start-up; a
        # server that is merely down is not fatal: the breaker keeps the sidecar serving locally.
        self._pipelined([(self._usage_key, ("PING",))])

    # -- Tier protocol ------------------------------------------------------------

    def put_block(self, meta: BlockMeta, chunks: Sequence[bytes | memoryview]) -> None:
        old = _parse_or_none(self._read_metas([meta.key], raise_errors=True)[0])
        commands: list[tuple[Any, ...]] = []
        if old is not None and old.layout_version != meta.layout_version:
            commands.append(("DEL", *self._chunk_keys(old)))
        for index, data in enumerate(chunks):
            commands.append(self._set(self._ckey(meta.key, meta.layout_version, index), data))
        commands.append(self._set(self._mkey(meta.key), meta.to_bytes()))
        if old is None:
            self._transaction(meta.key, commands, (meta.nbytes, 1, meta.num_chunks))
        else:
            self._transaction(
                meta.key, commands, (meta.nbytes - old.nbytes, 0, meta.num_chunks - old.num_chunks)
            )

    def put_blocks(self, blocks: Sequence[tuple[BlockMeta, Sequence[bytes | memoryview]]]) -> None:
        written: list[bytes] = []
        try:
            for meta, chunks in blocks:
                self.put_block(meta, chunks)
                written.append(meta.key)
        except BaseException:
            for key in written:  # best effort: the remote tier is a cache, a leftover is only a hit
                with contextlib.suppress(RemoteUnavailableError, TierFullError):
                    self.delete_block(key)
            raise

    def put_meta(self, meta: BlockMeta) -> bool:
        # XX: only if the block is still there; the remote may have evicted it.
        command = (*self._set(self._mkey(meta.key), meta.to_bytes()), "XX")
        reply = self._pipelined([(meta.key, command)])[0]
        return reply is not _MISS and bool(reply)

    def get_chunks(self, meta: BlockMeta, indices: Sequence[int]) -> list[memoryview | None]:
        return self.get_many([(meta, indices)])[0]

    def get_many(self, requests: Sequence[tuple[BlockMeta, Sequence[int]]]) -> list[list[memoryview | None]]:
        """Chunks of several blocks: one MGET per block, in one pipeline per node.

        A block whose node failed comes back as all None (the other nodes still answer).
        """
        commands = [
            (meta.key, ("MGET", *[self._ckey(meta.key, meta.layout_version, i) for i in indices]))
            for meta, indices in requests
            if indices
        ]
        replies = iter(self._pipelined(commands))
        out: list[list[memoryview | None]] = []
        for _meta, indices in requests:
            values = next(replies) if indices else []
            if values is _MISS:
                values = [None] * len(indices)
            out.append([None if v is None else memoryview(v) for v in values])
        return out

    def get_ranges(self, meta: BlockMeta, index: int, ranges: Sequence[Span]) -> list[memoryview] | None:
        key = self._ckey(meta.key, meta.layout_version, index)  # (GETRANGE of an absent key reads "")
        reads: list[tuple[Any, ...]] = [("EXISTS", key)]
        reads += [("GETRANGE", key, a, b - 1) for a, b in ranges if b > a]
        replies = self._pipelined([(meta.key, command) for command in reads])
        if any(r is _MISS for r in replies) or not replies[0]:
            return None
        values = iter(replies[1:])  # (an empty range sent no command)
        return [memoryview(next(values) if end > start else b"") for start, end in ranges]

    def get_meta(self, key: bytes) -> BlockMeta | None:
        return self.get_metas([key])[0]

    def get_metas(self, keys: Sequence[bytes]) -> list[BlockMeta | None]:
        """Metadata of several blocks, one pipeline per node; None where missing or malformed."""
        out: list[BlockMeta | None] = []
        for value in self._read_metas(keys):
            try:
                out.append(None if value is None else BlockMeta.from_bytes(value))
            except ChecksumError:
                self._add("corrupt")
                out.append(None)
        return out

    def contains(self, key: bytes) -> bool:
        reply = self._pipelined([(key, ("EXISTS", self._mkey(key)))])[0]
        return reply is not _MISS and bool(reply)

    def delete_block(self, key: bytes) -> int:
        meta = _parse_or_none(self._read_metas([key], raise_errors=True)[0])
        if meta is None:
            return 0
        self._transaction(key, [("DEL", self._mkey(key), *self._chunk_keys(meta))],
                          (-meta.nbytes, -1, -meta.num_chunks))  # fmt: skip
        return meta.nbytes

    def iter_meta(self) -> Iterator[BlockMeta]:
        pattern = self._prefix + b":{*}:m"
        try:
            mkeys = self._guard("scan", lambda: list(self._connected().scan_iter(match=pattern, count=1000)))
        except RemoteUnavailableError:
            return
        for mkey in mkeys:
            tag = bytes(mkey)[len(self._prefix) + 2 : -3]
            try:
                key = bytes.fromhex(tag.decode())
            except ValueError:  # a foreign key under our prefix: not a block of ours
                self._add("corrupt")
                continue
            meta = self.get_meta(key)
            if meta is not None:
                yield meta

    def usage(self) -> TierUsage:
        """Counters kept beside the data (approximate once Redis evicts on its own)."""
        reply = self._pipelined([(self._usage_key, ("HMGET", self._usage_key, "used", "blocks", "chunks"))])[
            0
        ]
        values = [0, 0, 0] if reply is _MISS else reply
        used, blocks, chunks = (max(int(v or 0), 0) for v in values)
        return TierUsage(used, None, blocks, chunks)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # -- health -------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """Failures seen so far: `errors`, `timeouts`, `refused` (breaker open), `corrupt`."""
        with self._lock:
            return dict(self._counts)

    def count_corrupt(self) -> None:
        """Count a value that a reader found malformed (a chunk failing its checksum)."""
        self._add("corrupt")

    def breaker_snapshot(self) -> BreakerSnapshot:
        """All nodes' breakers as one: the worst state, summed totals, the longest backoff."""
        with self._lock:
            snaps = [b.snapshot() for b in self.breakers.values()]
        if not snaps:
            return BreakerSnapshot(BreakerState.CLOSED, 0, 0, 0, 0.0)
        worst = max(snaps, key=lambda s: (s.state is BreakerState.OPEN, s.state))
        return BreakerSnapshot(worst.state, sum(s.opens for s in snaps), sum(s.closes for s in snaps),
                               sum(s.refused for s in snaps), max(s.backoff_s for s in snaps))  # fmt: skip

    # -- internals: routing, breakers, counting ---------------------------------------

    def _read_metas(self, keys: Sequence[bytes], raise_errors: bool = False) -> list[Any]:
        replies = self._pipelined([(k, ("GET", self._mkey(k))) for k in keys], raise_errors)
        return [None if r is _MISS else r for r in replies]

    def _pipelined(
        self, commands: Sequence[tuple[bytes, tuple[Any, ...]]], raise_errors: bool = False
    ) -> list[Any]:
        """Run (block key, command) pairs in one pipeline per node. A node that fails or whose
        breaker is open yields `_MISS` for its commands (or raises, with `raise_errors`)."""
        results: list[Any] = [_MISS] * len(commands)
        try:
            groups = self._by_node([key for key, _ in commands])
        except RemoteUnavailableError:
            if raise_errors:
                raise
            return results
        for node, (client, indices) in groups.items():

            def run(client: Any = client, indices: list[int] = indices) -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for i in indices:
                    pipe.execute_command(*commands[i][1])
                return list(pipe.execute())

            try:
                replies = self._guard(node, run)
            except RemoteUnavailableError:
                if raise_errors:
                    raise
                continue
            for i, reply in zip(indices, replies, strict=True):
                results[i] = reply
        return results

    def _transaction(self, key: bytes, commands: list[tuple[Any, ...]], usage: tuple[int, int, int]) -> None:
        """Run `commands` (all on `key`'s slot) in one MULTI/EXEC, then count `usage`."""
        ((node, (client, _)),) = self._by_node([key]).items()
        counts = [
            ("HINCRBY", self._usage_key, f, n)
            for f, n in zip(("used", "blocks", "chunks"), usage, strict=True)
        ]

        def run() -> None:
            pipe = client.pipeline(transaction=True)
            for command in commands + ([] if self.cluster else counts):
                pipe.execute_command(*command)
            pipe.execute()

        self._guard(node, run)
        if self.cluster:  # the usage hash lives in another slot: counted after, best effort
            self._pipelined([(self._usage_key, c) for c in counts])

    def _by_node(self, keys: Sequence[bytes]) -> dict[str, tuple[Any, list[int]]]:
        """Group key indices by the node that serves them: name -> (node client, indices)."""
        client = self._guard("topology", self._connected)
        if not self.cluster:
            return {"server": (client, list(range(len(keys))))}
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, key in enumerate(keys):
            tag = key if key == self._usage_key else self._tag(key)
            node = client.get_node_from_key(tag)
            groups.setdefault(node.name, (client.get_redis_connection(node), []))[1].append(i)
        return groups

    def _guard(self, node: str, op: Callable[[], T]) -> T:
        """Run `op` under `node`'s breaker; failures are counted and raised as RemoteUnavailableError."""
        breaker = self._breaker(node)
        if not breaker.allow():
            self._add("refused")
            raise RemoteUnavailableError(f"remote tier {self._where}: circuit breaker of {node} open")
        try:
            result = op()
        except redis.ResponseError as exc:
            if "OOM" in str(exc):
                breaker.success()  # the server answered: it is up, only full
                raise TierFullError(f"remote tier is out of memory: {exc}") from exc
            self._failed(breaker, exc)
            raise RemoteUnavailableError(f"remote tier {self._where} ({node}): {exc}") from exc
        except _FAILURES as exc:
            self._failed(breaker, exc)
            raise RemoteUnavailableError(f"remote tier {self._where} ({node}): {exc}") from exc
        except Exception as exc:  # the client library failed outside its own classes: still the remote's
            self._failed(breaker, exc)
            raise RemoteUnavailableError(
                f"remote tier {self._where} ({node}): {type(exc).__name__}: {exc}"
            ) from exc
        except BaseException:
            breaker.failure()  # a probe must always report, or half-open never ends
            raise
        breaker.success()
        return result

    def _failed(self, breaker: CircuitBreaker, exc: BaseException) -> None:
        breaker.failure()
        self._add("timeouts" if isinstance(exc, redis.TimeoutError | TimeoutError) else "errors")
        self._stale_topology = self.cluster  # a node died or slots moved: ask the cluster again

    def _breaker(self, node: str) -> CircuitBreaker:
        with self._lock:
            if node not in self.breakers:
                self.breakers[node] = self.new_breaker()
            return self.breakers[node]

    def _connected(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            elif self._stale_topology:
                self._stale_topology = False
                self._client.nodes_manager.initialize()
            return self._client

    def _make_client(self) -> Any:
        # No retries inside redis-py: the breakers decide when to try again (with backoff).
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

    def _add(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _set(self, key: bytes, value: bytes | memoryview) -> tuple[Any, ...]:
        return ("SET", key, value) if self._ttl is None else ("SET", key, value, "EX", self._ttl)

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

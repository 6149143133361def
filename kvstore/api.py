"""The store interface: `PrefixStore` and its `LoadStream`, with their typed values.

Two implementations: `kvstore.store.tiered.TieredStore` (embedded, in this process) and
`kvstore.client.kvclient.KVClient` (a sidecar over gRPC). The engine, the vLLM connector,
the DSL, tests and benchmarks hold a `PrefixStore` and switch between the two by
configuration. The docstrings here are the contract; the implementations do not
repeat them.

Units: token ids are uint32; `kv` arrays have shape (layers, 2, kv_heads, tokens,
head_dim) in `model.dtype`; sizes are bytes; times are seconds.

This module imports no grpc, lmdb, redis or torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvstore.budget import Budget
from kvstore.model import ModelSpec
from kvstore.stats import StoreStats
from kvstore.values import DEFAULT_NAMESPACE, Array, LoadedChunk, LookupResult, StoreResult

Tokens = Sequence[int] | Array


@dataclass(frozen=True)
class Lease:
    """A pin on the blocks of a cached prefix, released by `unpin` or when it expires.

    Attributes:
        lease_id: the id to pass to `unpin`.
        num_keys: blocks pinned (0 when nothing of the prefix was cached).
        ttl_s: the time to live granted, in seconds.
        expires_at: when it expires, in `time.monotonic()` seconds of the process
            holding this object (the client computes it from `ttl_s` on receipt, so it
            is never later than the server's own deadline).
    """

    lease_id: str
    num_keys: int
    ttl_s: float
    expires_at: float


@dataclass(frozen=True)
class StoreInfo:
    """How a store cuts prefixes into blocks and chunks.

    Attributes:
        block_tokens: tokens per block; only whole blocks are stored. None when the
            store is behind a sidecar that does not say (the sidecar drops a trailing
            partial block itself).
        chunk_tokens: tokens per chunk (the unit a budgeted load selects); None as above.
    """

    block_tokens: int | None
    chunk_tokens: int | None


@runtime_checkable
class LoadStream(Protocol):
    """Iterator of `LoadedChunk`, fastest tier first, block by block; close it when done.

    Each block's chunks are read and verified before any of them is yielded, so a
    consumer never sees part of a corrupt block; a block that is corrupt or gone ends
    the stream there. Use it as a context manager: after `close` the chunks' `kv`
    may be views of memory that is reused, so copy what must outlive the stream.

    Attributes (final once the stream is exhausted):
        matched_tokens: prefix length the lookup promised.
        num_tokens: prefix length actually delivered (shorter if a block was lost).
        selected_tokens: tokens of the chunks the budget selected (whole chunks).
        delivered_tokens: tokens in the delivered chunks (== selected unless a block was lost).
        bytes_read: encoded bytes read from all tiers.
        read_amplification: bytes read / bytes of the selected tokens (1.0 if none).
        delivered_fraction: delivered tokens / matched tokens (0.0 if none matched): what
            a budget really delivered.
        read_fraction: bytes read / encoded bytes of the matched prefix (0.0 if none).
        estimated_coverage: share of the estimated attention mass (the blocks'
            normalised scores) in the selected chunks; 1.0 at budget 1.0.
    """

    matched_tokens: int
    num_tokens: int
    selected_tokens: int
    delivered_tokens: int
    bytes_read: int
    estimated_coverage: float

    @property
    def read_amplification(self) -> float: ...

    @property
    def delivered_fraction(self) -> float: ...

    @property
    def read_fraction(self) -> float: ...

    def __iter__(self) -> Iterator[LoadedChunk]: ...

    def __next__(self) -> LoadedChunk: ...

    def gather(self, model: ModelSpec) -> tuple[Array, Array]:
        """Read the rest of the stream into (positions (n,), kv (layers, 2, heads, n, dim))."""
        ...

    def close(self) -> None:
        """Stop reading (cancelling an unfinished stream) and release its buffers. Idempotent."""
        ...

    def __enter__(self) -> LoadStream: ...

    def __exit__(self, *exc: object) -> None: ...


@dataclass(frozen=True)
class LayerSlice:
    """The chunks of one layer that a `LayeredLoad` read.

    Attributes:
        positions: (n,) int64 true positions in the prompt, ascending.
        kv: (2, kv_heads, n, head_dim) keys (post-RoPE, as computed) and values, in
            `model.dtype`; may be a read-only view valid until the load is closed.
    """

    positions: Array
    kv: Array


@runtime_checkable
class LayeredLoad(Protocol):
    """A prefix load that proceeds layer by layer, for query-aware chunk selection.

    Only blocks stored in the layered layout (docs/importance.md: per layer, chunks of
    `chunk_tokens` consecutive tokens in prompt order, with one key summary per block
    and layer) can be read this way; `matched_tokens` covers the leading run of such
    blocks (0 when the first matched block is not layered: use `PrefixStore.load`).
    Chunk `c` of a layer holds positions [c * chunk_tokens, (c + 1) * chunk_tokens) of
    the matched prefix. The blocks stay readable until `close` (the load pins them).

    Attributes (counters grow as layers are read):
        matched_tokens: prefix length readable layer by layer.
        chunk_tokens: tokens per per-layer chunk.
        num_layers: layers of the model.
        prefix_bytes: encoded bytes of the matched blocks, summaries included.
        summary_bytes: encoded bytes of all summaries of the matched blocks.
        bytes_read: encoded bytes read so far (summaries and chunks).
        delivered_tokens: tokens delivered so far, summed over layers.
    """

    matched_tokens: int
    chunk_tokens: int
    num_layers: int
    prefix_bytes: int
    summary_bytes: int
    bytes_read: int
    delivered_tokens: int

    @property
    def delivered_fraction(self) -> float:
        """Delivered tokens / (matched tokens x layers read); 0.0 before any layer."""
        ...

    @property
    def read_fraction(self) -> float:
        """Bytes read / `prefix_bytes` (0.0 if nothing matched)."""
        ...

    def key_summary(self, layer: int) -> Array:
        """Approximate keys of `layer` over the matched prefix, from its summaries.

        Returns float32 (kv_heads, matched_tokens, head_dim), post-RoPE like the keys.
        Reads the layer's summaries on first use (counted in `bytes_read`); an implementation
        may read the next layers' ahead, while the caller computes (counted when read).

        Raises:
            InvalidInputError: layer out of range.
            ChecksumError: a summary failed its checksum (the block is forgotten).
        """
        ...

    def read_layer(self, layer: int, chunks: Sequence[int]) -> LayerSlice:
        """Read chunks `chunks` (indices into the matched prefix's chunks) of `layer`.

        Raises:
            InvalidInputError: layer or a chunk index out of range, or repeated.
            ChecksumError: a chunk failed its checksum (the block is forgotten): the
                caller must not use what it read of this prefix (recompute instead).
        """
        ...

    def close(self) -> None:
        """Release the pin and buffers. Idempotent."""
        ...

    def __enter__(self) -> LayeredLoad: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class PrefixStore(Protocol):
    """KV of token prefixes, shared across requests. Thread-safe.

    Blocks are keyed by a hash chain over (namespace, model fingerprint, tokens), so
    a prefix is found only under the same namespace and model. Every method raises
    `InvalidInputError` (naming the field) on bad input before touching stored data.
    """

    @property
    def info(self) -> StoreInfo:
        """Block and chunk size. Reads nothing stored."""
        ...

    def lookup(self, tokens: Tokens, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE) -> LookupResult:
        """Longest cached block-aligned prefix of `tokens` and how much of it is in memory.

        Reads no KV; refreshes the blocks' recency. A block that another sidecar put in
        the shared remote tier counts as cached.
        """
        ...

    def store(
        self,
        tokens: Tokens,
        kv: Array,
        *,
        model: ModelSpec,
        namespace: str = DEFAULT_NAMESPACE,
        scores: Array | None = None,
        kv_start: int = 0,
    ) -> StoreResult:
        """Store the new whole blocks of a prefix; blocks already cached are skipped. Mutates.

        Args:
            tokens: token ids of the prefix (a trailing partial block is not stored).
            kv: KV of tokens[kv_start:], shape `model.kv_shape(len(tokens) - kv_start)`,
                dtype `model.dtype`.
            scores: optional per-token importance of the same tokens as `kv`; each new
                block is laid out in descending score order (what a budgeted load reads).
            kv_start: first token `kv` covers, a multiple of the block size. A caller
                that loaded the prefix's first blocks sends only the KV it computed; if
                one of those first blocks is no longer cached, nothing is stored.

        All new blocks are written or none; on an error nothing of this call is kept.

        Raises:
            InvalidInputError: bad tokens, shape, dtype, kv_start or scores.
            StoreFullError: the budget is held by pinned blocks, or the disk is full.
            StorageUnavailableError: an I/O error, or the data file was deleted under us.
        """
        ...

    def load(
        self,
        tokens: Tokens,
        *,
        model: ModelSpec,
        namespace: str = DEFAULT_NAMESPACE,
        budget: Budget = 1.0,
        budget_tokens: int | None = None,
        coverage: float | None = None,
    ) -> LoadStream:
        """Stream the cached prefix of `tokens`, or its most important share.

        Args:
            budget: fraction of the matched prefix's tokens to deliver, in (0, 1]: whole
                chunks, best mean score first, at most one partial chunk over the
                fraction; or "auto" / an `AutoBudget`: the fewest chunks holding
                `coverage` of the estimated attention mass, within its fractions.
            budget_tokens: a token count instead of a fraction (overrides `budget`).
            coverage: the coverage target of budget="auto" (default 0.9), in (0, 1].

        Raises:
            InvalidInputError: a bad budget, word or coverage (before anything is read).

        Reads chunks from the fastest tier holding them and promotes them to memory.
        A block that fails its checksum or is gone from every tier ends the stream
        (`LoadStream.num_tokens` says how far it got) and is forgotten.
        """
        ...

    def open_layers(
        self, tokens: Tokens, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE
    ) -> LayeredLoad:
        """Open the cached prefix of `tokens` for reading layer by layer (see `LayeredLoad`).

        Reads no KV yet. Its `matched_tokens` is 0 when the prefix is not cached in the
        layered layout; close it in every case.
        """
        ...

    def pin(
        self, tokens: Tokens, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE, ttl_s: float = 60.0
    ) -> Lease:
        """Keep the cached prefix of `tokens` from eviction for `ttl_s` seconds. Mutates.

        Raises `InvalidInputError` for a TTL outside (0, 24 h]; a sidecar may refuse
        with `StoreFullError` past a tenant's lease or pinned-bytes quota.
        """
        ...

    def unpin(self, lease_id: str) -> None:
        """Release a lease. Mutates. `NotFoundError` if it is unknown, released or expired."""
        ...

    def report_scores(
        self, tokens: Tokens, scores: Array, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE
    ) -> int:
        """Fold per-token importance (one finite float per token) into the cached blocks' scores.

        Each block's scores become decay * old + reported (see importance.history); the
        stored layout changes only at the next re-layout. Mutates metadata in every tier.
        Returns the number of blocks updated.
        """
        ...

    def stats(self) -> StoreStats:
        """Counters and occupancy of every tier (a sidecar scopes them to the caller's token)."""
        ...

    def close(self) -> None:
        """Release tiers, files, connections and shared memory. Idempotent."""
        ...

"""Configuration of the store (one frozen dataclass, validated on construction)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import InvalidInputError

# The chunk codecs a store can write (kvstore/format/chunk.py gives each its id on disk).
CODECS = ("raw", "shuffle-zstd")

#: The file LMDB keeps its data in, inside its environment directory.
LMDB_DATA_FILE = "data.mdb"
#: Block layouts a store can write (kvstore.format.block_meta.BlockMeta.layout records which one a block has).
LAYOUTS = ("importance", "layered")
#: What reads a layer-by-layer load's scattered spans from disk (kvstore/tiers/disk/spans.py).
DISK_READERS = ("threads", "io_uring")


@dataclass(frozen=True)
class StoreConfig:
    """How a `TieredStore` is laid out.

    Attributes:
        data_dir: directory of the disk tier (LMDB under `data_dir/lmdb`); None = memory only.
        block_tokens: tokens per block, the unit of matching (1..65535, a multiple of chunk_tokens).
        chunk_tokens: tokens per chunk, the unit of I/O.
        memory_bytes: byte budget of the memory tier.
        disk_bytes: byte budget of the disk tier; None = limited only by the filesystem.
        codec: "raw" or "shuffle-zstd" for chunks on disk and in the remote tier.
        zstd_level: zstd level for "shuffle-zstd" (1..19; level 1 compresses KV as well as 3).
        remote_url: redis:// URL of one Redis/Valkey server shared by sidecars; None = no remote tier.
        remote_nodes: HOST:PORT of Redis/Valkey Cluster nodes, comma-separated; any one that
            answers is enough to find the rest. Set instead of remote_url for cluster mode.
        remote_prefix: prefix of every remote key (deployments sharing a server use distinct ones).
        remote_timeout_s: socket timeout of every remote call, in seconds (0 < t <= 60).
        remote_write_behind: queue remote writes on a background worker; false writes each
            block where it is handed over. Either way after the local disk has it: by the disk
            writer after its group commit (a Store has returned by then), or, where a Store
            writes the disk itself (`sync_stores`, no disk, blocks memory cannot hold), by the
            Store, which with false then returns after Redis has the block.
        remote_queue_bytes: bytes of blocks waiting for the remote tier; beyond, blocks are
            dropped (counted in remote.queue_drops), never waited for.
        remote_drain_s: seconds closing the store waits for queued remote writes.
        remote_breaker_failures: consecutive remote failures that open the circuit breaker.
        remote_breaker_reset_s: seconds the open breaker waits before a probe (doubles after
            each failed probe, up to 30 s).
        pin_host_memory: page-lock memory-tier buffers when CUDA is available.
        host_arena: carve memory-tier records out of large segments of host memory
            (kvstore/tiers/arena.py): None (the default) where CUDA is, page-locked once per
            segment; True also on the CPU (unpinned: the tests run the GPU's memory layout there).
        score_half_life_reports: reported query scores halve in weight after this many reports.
        memory_policy: what leaves memory first: "score" (lowest access frequency x importance
            mass) or "lru".
        layout: how new blocks are laid out: "importance" (chunks of chunk_tokens in
            descending score order) or "layered" (per layer, chunks of layer_chunk_tokens in
            prompt order plus a 2-bit key summary per layer; docs/importance.md).
        layer_chunk_tokens: tokens per per-layer chunk of the layered layout (divides block_tokens).
        layered_pack: write a layered block's layer records as one value, a pack (layout v3:
            a full load reads one value per block). False writes layout v2, a value per layer
            record, which stores older than v3 read: for a remote tier shared with them during
            an upgrade. Both are read whatever this says.
        read_in_place: a full load into a co-located client's shared-memory arena copies a packed
            block from where it lies (memory's copy, or LMDB's map when the page cache holds all
            of it, checked there and not promoted) straight into the arena: each byte copied
            once. False reads such a block from disk with pread first and promotes it, as before
            (docs/performance.md, issue 47 item 4).
        sync_stores: write each Store's blocks to disk before acknowledging it (one synced LMDB
            transaction per Store). False: a Store is acknowledged once memory holds its blocks
            and lookups see them; the disk gets them behind, in group commits, and a crash loses
            the blocks not yet committed (misses, never wrong KV; docs/reliability.md).
        commit_blocks: most blocks in one group commit (one LMDB transaction) of the disk write-behind.
        commit_ms: milliseconds the disk writer waits after a block for more before it commits.
        disk_backlog_bytes: acknowledged bytes not yet on disk; past it a Store waits for the disk
            (backlog_wait_s), then is refused (RESOURCE_EXHAUSTED), never dropped silently.
        backlog_wait_s: seconds a Store waits for room under disk_backlog_bytes before it is
            refused; 0 refuses at once.
        warm_read_ahead_bytes: memory kept made ahead of need, on a low-priority thread, for
            cold loads' reads from disk to land in (the memory tier keeps what they read, and
            fresh pages cost more than the read here: docs/performance.md); made from the store's
            start where the memory tier has an arena (`host_arena`), else from `kvsieve serve`'s;
            where the arena is page-locked (CUDA), at least 1 GiB. 0: reads land in fresh memory,
            and an arena grows on the thread that needs room, as before.
        disk_reader: what reads the many scattered spans of a layer-by-layer load from disk:
            "threads" (a pool of 8 threads of preadv) or "io_uring" (one ring, 128 reads in flight;
            needs `pip install 'kvsieve[uring]'` and a kernel that allows io_uring, else refused).
            Measured against each other on this project's CPU machine (docs/performance.md, issue
            46's second round), neither wins everywhere: try both on yours.
    """

    data_dir: Path | None = None
    block_tokens: int = 256
    chunk_tokens: int = 16
    memory_bytes: int = 2 << 30
    disk_bytes: int | None = None
    codec: str = "raw"
    zstd_level: int = 1
    remote_url: str | None = None
    remote_nodes: tuple[str, ...] = ()
    remote_prefix: str = "kvsieve"
    remote_timeout_s: float = 0.5
    remote_write_behind: bool = True
    remote_queue_bytes: int = 256 << 20
    remote_drain_s: float = 5.0
    remote_breaker_failures: int = 3
    remote_breaker_reset_s: float = 1.0
    pin_host_memory: bool = True
    host_arena: bool | None = None
    score_half_life_reports: float = 64.0
    memory_policy: str = "score"
    layout: str = "layered"
    layer_chunk_tokens: int = 8
    layered_pack: bool = True
    read_in_place: bool = True
    sync_stores: bool = False
    commit_blocks: int = 64
    commit_ms: float = 5.0
    disk_backlog_bytes: int = 256 << 20
    backlog_wait_s: float = 5.0
    warm_read_ahead_bytes: int = 128 << 20
    disk_reader: str = "threads"

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_tokens <= 4096:
            raise InvalidInputError(f"chunk_tokens must be in [1, 4096], got {self.chunk_tokens}")
        if not 1 <= self.block_tokens <= 65535 or self.block_tokens % self.chunk_tokens:
            raise InvalidInputError(
                f"block_tokens must be in [1, 65535] and a multiple of chunk_tokens "
                f"({self.chunk_tokens}), got {self.block_tokens}"
            )
        if self.memory_bytes < 0:
            raise InvalidInputError(f"memory_bytes must be >= 0, got {self.memory_bytes}")
        if self.disk_bytes is not None and self.disk_bytes <= 0:
            raise InvalidInputError(f"disk_bytes must be > 0 or None, got {self.disk_bytes}")
        if self.codec not in CODECS:
            raise InvalidInputError(f"codec must be one of {sorted(CODECS)}, got {self.codec!r}")
        if not 1 <= self.zstd_level <= 19:
            raise InvalidInputError(f"zstd_level must be in [1, 19], got {self.zstd_level}")
        if self.memory_policy not in ("score", "lru"):
            raise InvalidInputError(f"memory_policy must be 'score' or 'lru', got {self.memory_policy!r}")
        if self.score_half_life_reports <= 0:
            raise InvalidInputError(
                f"score_half_life_reports must be > 0, got {self.score_half_life_reports}"
            )
        w = self.warm_read_ahead_bytes
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise InvalidInputError(f"warm_read_ahead_bytes must be an integer >= 0, got {w!r}")
        if self.disk_reader not in DISK_READERS:
            raise InvalidInputError(
                f"disk_reader must be one of {', '.join(DISK_READERS)}, got {self.disk_reader!r}"
            )
        self._check_layout()
        self._check_write_behind()
        self._check_remote()
        if self.data_dir is None and not self.has_remote and self.memory_bytes == 0:
            raise InvalidInputError("memory_bytes must be > 0 when there is no data_dir nor remote_url")

    def _check_layout(self) -> None:
        if self.layout not in LAYOUTS:
            raise InvalidInputError(f"layout must be one of {list(LAYOUTS)}, got {self.layout!r}")
        c, b = self.layer_chunk_tokens, self.block_tokens
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= b or b % c:
            raise InvalidInputError(
                f"layer_chunk_tokens must be an integer dividing block_tokens ({b}), got {c!r}"
            )

    def _check_write_behind(self) -> None:
        for name, integral, low in (("commit_blocks", True, 1), ("disk_backlog_bytes", True, 1),
                                    ("commit_ms", False, 0), ("backlog_wait_s", False, 0)):  # fmt: skip
            value: object = getattr(self, name)
            kinds = (int,) if integral else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds) or float(value) < low:
                kind = "an integer" if integral else "a number"
                raise InvalidInputError(f"{name} must be {kind} >= {low}, got {value!r}")

    def _check_remote(self) -> None:
        nodes = (self.remote_nodes.split(",") if isinstance(self.remote_nodes, str)
                 else self.remote_nodes)  # fmt: skip
        object.__setattr__(self, "remote_nodes", tuple(n.strip() for n in nodes if n.strip()))
        if self.remote_url is not None and self.remote_nodes:
            raise InvalidInputError("set remote_url (one server) or remote_nodes (a cluster), not both")
        if self.remote_url is not None and not self.remote_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise InvalidInputError(
                f"remote_url must be redis://, rediss:// or unix://, got {self.remote_url!r}"
            )
        for node in self.remote_nodes:
            host, _, port = node.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise InvalidInputError(f"remote_nodes entries must be HOST:PORT, got {node!r}")
        if not self.remote_prefix or any(c in self.remote_prefix for c in "{}*?[] "):
            raise InvalidInputError(
                f"remote_prefix must be non-empty without braces, glob characters or spaces, "
                f"got {self.remote_prefix!r}"
            )
        if not 0 < self.remote_timeout_s <= 60:
            raise InvalidInputError(f"remote_timeout_s must be in (0, 60], got {self.remote_timeout_s}")
        if self.remote_queue_bytes <= 0:
            raise InvalidInputError(f"remote_queue_bytes must be > 0, got {self.remote_queue_bytes}")
        if self.remote_drain_s < 0:
            raise InvalidInputError(f"remote_drain_s must be >= 0, got {self.remote_drain_s}")
        if self.remote_breaker_failures < 1:
            raise InvalidInputError(
                f"remote_breaker_failures must be >= 1, got {self.remote_breaker_failures}"
            )
        if not 0 < self.remote_breaker_reset_s <= 30:
            raise InvalidInputError(
                f"remote_breaker_reset_s must be in (0, 30], got {self.remote_breaker_reset_s}"
            )

    @property
    def has_remote(self) -> bool:
        """Whether a remote tier (one server or a cluster) is configured."""
        return self.remote_url is not None or bool(self.remote_nodes)

    @property
    def chunks_per_block(self) -> int:
        """Chunks in one block."""
        return self.block_tokens // self.chunk_tokens

    @property
    def lmdb_dir(self) -> Path | None:
        """Directory of the LMDB environment."""
        return None if self.data_dir is None else store_lmdb_dir(self.data_dir)


def store_lmdb_dir(data_dir: str | os.PathLike[str]) -> Path:
    """The LMDB environment of a store's data directory."""
    return Path(data_dir) / "lmdb"


def store_data_file(data_dir: str | os.PathLike[str]) -> Path:
    """The LMDB data file of a store's data directory (what fsck and relayout look for)."""
    return store_lmdb_dir(data_dir) / LMDB_DATA_FILE

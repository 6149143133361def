"""Configuration of the store (one frozen dataclass, validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvstore.codec import CODEC_IDS
from kvstore.errors import InvalidInputError


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
        remote_url: redis:// or valkey URL of the shared remote tier; None = no remote tier.
        pin_host_memory: page-lock memory-tier buffers when CUDA is available.
        score_half_life_reports: reported query scores halve in weight after this many reports.
        memory_policy: what leaves memory first: "score" (lowest access frequency x importance
            mass) or "lru".
    """

    data_dir: Path | None = None
    block_tokens: int = 256
    chunk_tokens: int = 16
    memory_bytes: int = 2 << 30
    disk_bytes: int | None = None
    codec: str = "raw"
    zstd_level: int = 1
    remote_url: str | None = None
    pin_host_memory: bool = True
    score_half_life_reports: float = 64.0
    memory_policy: str = "score"

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
        if self.codec not in CODEC_IDS:
            raise InvalidInputError(f"codec must be one of {sorted(CODEC_IDS)}, got {self.codec!r}")
        if not 1 <= self.zstd_level <= 19:
            raise InvalidInputError(f"zstd_level must be in [1, 19], got {self.zstd_level}")
        if self.memory_policy not in ("score", "lru"):
            raise InvalidInputError(f"memory_policy must be 'score' or 'lru', got {self.memory_policy!r}")
        if self.score_half_life_reports <= 0:
            raise InvalidInputError(
                f"score_half_life_reports must be > 0, got {self.score_half_life_reports}"
            )
        if self.data_dir is None and self.remote_url is None and self.memory_bytes == 0:
            raise InvalidInputError("memory_bytes must be > 0 when there is no data_dir nor remote_url")

    @property
    def chunks_per_block(self) -> int:
        """Chunks in one block."""
        return self.block_tokens // self.chunk_tokens

    @property
    def lmdb_dir(self) -> Path | None:
        """Directory of the LMDB environment."""
        return None if self.data_dir is None else Path(self.data_dir) / "lmdb"

"""Block metadata: what a tier keeps beside a block's chunks.

Serialised as a small binary record so that the radix tree can be rebuilt from the
disk tier at start-up without decoding any chunk.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvstore.errors import ChecksumError

_FIXED = struct.Struct("<4sH16s16s16sIIHIQdI")  # see BlockMeta.to_bytes
_MAGIC = b"KVSM"
_VERSION = 1


@dataclass(frozen=True)
class BlockMeta:
    """Metadata of one stored block.

    Attributes:
        key: the block key (docs/keys.md).
        parent: the previous block's key, or the root key for the first block.
        fingerprint: model fingerprint.
        namespace: namespace digest.
        depth: index of the block in its prefix (0 = first block).
        tokens: the block's token ids (uint32), in prompt order.
        chunk_tokens: tokens per chunk.
        layout_version: bumped by every re-layout; part of every chunk key.
        permutation: stored slot -> offset within the block (int array, block_tokens long).
        scores: per-token importance by offset within the block, or None if never scored.
        nbytes: encoded bytes of all chunks of the block.
        created: unix time the block was stored.
        namespace_name: the namespace in clear (kept for stats and fsck reports).
    """

    key: bytes
    parent: bytes
    fingerprint: bytes
    namespace: bytes
    depth: int
    tokens: np.ndarray[Any, Any]
    chunk_tokens: int
    layout_version: int
    permutation: np.ndarray[Any, Any]
    scores: np.ndarray[Any, Any] | None
    nbytes: int
    created: float
    namespace_name: str = ""

    @property
    def num_tokens(self) -> int:
        """Tokens in the block."""
        return len(self.tokens)

    @property
    def num_chunks(self) -> int:
        """Chunks in the block."""
        return -(-self.num_tokens // self.chunk_tokens)

    @property
    def start(self) -> int:
        """Position in the prompt of the block's first token."""
        return self.depth * self.num_tokens

    def chunk_offsets(self, chunk_index: int) -> np.ndarray[Any, Any]:
        """Offsets within the block of the tokens stored in chunk `chunk_index`."""
        lo = chunk_index * self.chunk_tokens
        return self.permutation[lo : lo + self.chunk_tokens]

    def with_layout(self, layout_version: int, permutation: np.ndarray[Any, Any], nbytes: int) -> BlockMeta:
        """A copy with a new layout (used by re-layout)."""
        return replace(self, layout_version=layout_version, permutation=permutation, nbytes=nbytes)

    def to_bytes(self) -> bytes:
        """Binary record: fixed header, JSON extras, tokens, permutation, scores."""
        extras = json.dumps({"namespace_name": self.namespace_name}).encode()
        has_scores = self.scores is not None
        fixed = _FIXED.pack(
            _MAGIC, _VERSION, self.key, self.parent, self.fingerprint,
            self.depth, self.num_tokens, self.chunk_tokens, self.layout_version,
            self.nbytes, self.created, len(extras),
        )  # fmt: skip
        parts = [
            fixed,
            self.namespace,
            bytes([has_scores]),
            extras,
            np.asarray(self.tokens, dtype="<u4").tobytes(),
            np.asarray(self.permutation, dtype="<u2").tobytes(),
        ]
        if self.scores is not None:
            parts.append(np.asarray(self.scores, dtype="<f4").tobytes())
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> BlockMeta:
        """Inverse of `to_bytes`. Raises `ChecksumError` on a malformed record."""
        buf = bytes(data)
        try:
            (magic, version, key, parent, fp, depth, n, chunk_tokens, layout,
             nbytes, created, extras_len) = _FIXED.unpack_from(buf)  # fmt: skip
            if magic != _MAGIC or version != _VERSION:
                raise ChecksumError(f"not a block metadata record (magic {magic!r})")
            off = _FIXED.size
            namespace = buf[off : off + 16]
            has_scores = buf[off + 16]
            off += 17
            extras = json.loads(buf[off : off + extras_len])
            off += extras_len
            tokens = np.frombuffer(buf, dtype="<u4", count=n, offset=off).astype(np.uint32)
            off += 4 * n
            perm = np.frombuffer(buf, dtype="<u2", count=n, offset=off).astype(np.int64)
            off += 2 * n
            scores = None
            if has_scores:
                scores = np.frombuffer(buf, dtype="<f4", count=n, offset=off).astype(np.float32)
                off += 4 * n
        except (struct.error, ValueError, IndexError) as exc:
            raise ChecksumError(f"malformed block metadata: {exc}") from exc
        if off != len(buf):
            raise ChecksumError("block metadata has trailing bytes")
        return cls(
            key, parent, fp, namespace, depth, tokens, chunk_tokens, layout, perm, scores,
            nbytes, created, extras.get("namespace_name", ""),
        )  # fmt: skip

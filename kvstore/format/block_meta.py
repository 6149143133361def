"""Block metadata: what a tier keeps beside a block's chunks.

Serialised as a small binary record so that the radix tree can be rebuilt from the
disk tier at start-up without decoding any chunk. Record version 2 ends with an
xxh3-64 checksum over everything before it; version 1 (no checksum) is still read.
Every read of either version also checks the record's identity: its key must be
the hash of its parent, tokens, fingerprint and namespace (docs/keys.md), so a
flipped token id can never make one prompt's KV answer another prompt.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import xxhash

from kvstore.errors import ChecksumError
from kvstore.format.chunk import ChunkGeometry, ChunkId
from kvstore.keys import ROOT_KEY, block_key
from kvstore.model import ModelSpec

_FIXED = struct.Struct("<4sH16s16s16sIIHIQdI")  # see BlockMeta.to_bytes
_CHECKSUM = struct.Struct("<Q")
_MAGIC = b"KVSM"
_VERSION = 2  # written; 1 (no checksum) is still read
_READABLE_VERSIONS = (1, 2)
IMPORTANCE, LAYERED = "importance", "layered"  # the layout kinds (kvstore.config.LAYOUTS)
# A layered block's layout version carries its chunk size (docs/keys.md, "Chunk keys"): bit 31
# set, chunk tokens in the low 16 bits; bit 30 set when its layer records are in one pack
# (kvstore/format/layer_pack.py, layout v3). Importance-layout versions count re-layouts from 0.
LAYERED_VERSION_BIT = 1 << 31
PACKED_VERSION_BIT = 1 << 30
_CHUNK_TOKENS_MASK = 0xFFFF


def layered_layout_version(chunk_tokens: int, packed: bool = True) -> int:
    """The layout version a store writes a layered block of `chunk_tokens`-token chunks with.

    The chunk size changes every byte of a layer record, so it is part of the record's key and
    identity: stores of other chunk sizes sharing a remote tier write other keys, never each
    other's (docs/keys.md). So does packing (`packed=False`: the v2 layout of one value per
    layer record, still read).
    """
    if not 1 <= chunk_tokens <= _CHUNK_TOKENS_MASK:
        raise ValueError(f"chunk_tokens must be in [1, {_CHUNK_TOKENS_MASK}], got {chunk_tokens}")
    return LAYERED_VERSION_BIT | (PACKED_VERSION_BIT if packed else 0) | chunk_tokens


def version_chunk_tokens(layout_version: int) -> int | None:
    """The chunk size a layout version carries (`layered_layout_version`), or None for a version
    without one (importance-layout blocks, layered blocks written before versions carried it)."""
    if not layout_version & LAYERED_VERSION_BIT:
        return None
    return layout_version & ~(LAYERED_VERSION_BIT | PACKED_VERSION_BIT)


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
        layout: "importance" (chunks of all layers in `permutation` order) or "layered"
            (per layer, a key summary and chunks in prompt order; see `record_index`).
            Kept in the record's JSON extras; records without it are "importance".
        num_layers: model layers of a layered block (0 for the importance layout).
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
    layout: str = IMPORTANCE
    num_layers: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens in the block."""
        return len(self.tokens)

    @property
    def is_layered(self) -> bool:
        """Stored in the layered layout."""
        return self.layout == LAYERED

    @property
    def chunks_per_layer(self) -> int:
        """Chunks of `chunk_tokens` tokens in the block: the selectable units of a load."""
        return -(-self.num_tokens // self.chunk_tokens)

    @property
    def is_packed(self) -> bool:
        """A layered block whose layer records are in one pack (kvstore/format/layer_pack.py)."""
        return self.is_layered and bool(self.layout_version & PACKED_VERSION_BIT)

    @property
    def pack_index(self) -> int:
        """Record index of a packed block's layer pack (after its summaries)."""
        return self.num_layers

    @property
    def num_chunks(self) -> int:
        """Records in the block: its chunks, or for a layered block a summary per layer and a
        layer record per layer (kvstore/format/layer_record.py) or, packed, one pack of them."""
        if self.is_packed:
            return self.num_layers + 1
        if self.is_layered:
            return 2 * self.num_layers
        return self.chunks_per_layer

    def record_index(self, layer: int, chunk: int | None = None) -> int:
        """Record index of a layered block's summary of `layer` (chunk None) or of the layer record
        that holds its chunk `chunk` (any chunk: one record holds all of a layer's chunks).

        Summaries come first (index = layer), then one record per layer: index = num_layers + layer.
        In a packed block that index names the record inside the pack (its identity), and the
        pack itself is stored at `pack_index`.
        """
        if chunk is None:
            return layer
        return self.num_layers + layer

    @property
    def start(self) -> int:
        """Position in the prompt of the block's first token."""
        return self.depth * self.num_tokens

    def chunk_offsets(self, chunk_index: int) -> np.ndarray[Any, Any]:
        """Offsets within the block of the tokens stored in chunk `chunk_index`.

        For a layered block, `chunk_index` is a record index: a summary and a layer
        record both cover every offset.
        """
        if self.is_layered:
            return np.arange(self.num_tokens, dtype=np.int64)
        lo = chunk_index * self.chunk_tokens
        return self.permutation[lo : lo + self.chunk_tokens]

    def chunk_geometry(self, chunk_index: int, model: ModelSpec) -> ChunkGeometry:
        """What chunk `chunk_index` of an importance-layout block must hold (its header is checked
        against it): the positions of its slots, and `model`'s layers, heads, head dim, dtype."""
        positions = self.start + np.asarray(self.chunk_offsets(chunk_index), dtype=np.int64)
        return ChunkGeometry(positions, model.num_layers, model.num_kv_heads, model.head_dim, model.dtype)

    def chunk_id(self, chunk_index: int, layout_version: int | None = None) -> ChunkId:
        """Identity of chunk `chunk_index` in this block's layout (or in `layout_version`)."""
        version = self.layout_version if layout_version is None else layout_version
        return ChunkId(self.fingerprint, self.namespace, self.key, version, chunk_index)

    def with_layout(self, layout_version: int, permutation: np.ndarray[Any, Any], nbytes: int) -> BlockMeta:
        """A copy with a new layout (used by re-layout)."""
        return replace(self, layout_version=layout_version, permutation=permutation, nbytes=nbytes)

    def to_bytes(self, version: int = _VERSION) -> bytes:
        """Binary record: fixed header, JSON extras, tokens, permutation, scores, checksum.

        `version=1` writes the old record without a checksum (tests of backward reading).
        """
        fields: dict[str, Any] = {"namespace_name": self.namespace_name}
        if self.is_layered:  # absent for the importance layout: its records stay as before
            fields |= {"layout": self.layout, "layers": self.num_layers}
        extras = json.dumps(fields).encode()
        has_scores = self.scores is not None
        fixed = _FIXED.pack(
            _MAGIC, version, self.key, self.parent, self.fingerprint,
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
        body = b"".join(parts)
        return body if version == 1 else body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> BlockMeta:
        """Inverse of `to_bytes`, verified.

        Raises:
            ChecksumError: a malformed record, a checksum mismatch (version 2), or a
                record whose key is not the hash of its content (`identity_error`).
        """
        meta = cls._parse(_verified_body(bytes(data)))
        problem = identity_error(meta)
        if problem is not None:
            raise ChecksumError(f"block metadata {meta.key.hex()}: {problem}")
        return meta

    @classmethod
    def _parse(cls, buf: bytes) -> BlockMeta:
        try:
            (_magic, _version, key, parent, fp, depth, n, chunk_tokens, layout,
             nbytes, created, extras_len) = _FIXED.unpack_from(buf)  # fmt: skip
            off = _FIXED.size
            namespace = buf[off : off + 16]
            has_scores = buf[off + 16]
            off += 17
            extras = json.loads(buf[off : off + extras_len])
            if not isinstance(extras, dict):
                raise ValueError(f"extras are {type(extras).__name__}, not an object")
            kind, layers = str(extras.get("layout", IMPORTANCE)), int(extras.get("layers", 0))
            off += extras_len
            tokens = np.frombuffer(buf, dtype="<u4", count=n, offset=off).astype(np.uint32)
            off += 4 * n
            perm = np.frombuffer(buf, dtype="<u2", count=n, offset=off).astype(np.int64)
            off += 2 * n
            scores = None
            if has_scores:
                scores = np.frombuffer(buf, dtype="<f4", count=n, offset=off).astype(np.float32)
                off += 4 * n
        except (struct.error, ValueError, TypeError, IndexError) as exc:
            raise ChecksumError(f"malformed block metadata: {exc}") from exc
        if off != len(buf):
            raise ChecksumError("block metadata has trailing bytes")
        return cls(
            key, parent, fp, namespace, depth, tokens, chunk_tokens, layout, perm, scores,
            nbytes, created, extras.get("namespace_name", ""), kind, layers,
        )  # fmt: skip


def _verified_body(buf: bytes) -> bytes:
    """The record without its checksum, after checking magic, version and checksum."""
    if len(buf) < _FIXED.size or buf[:4] != _MAGIC:
        raise ChecksumError(f"not a block metadata record (starts {buf[:4]!r})")
    version = int.from_bytes(buf[4:6], "little")
    if version not in _READABLE_VERSIONS:
        raise ChecksumError(f"block metadata record version {version} is not one of {_READABLE_VERSIONS}")
    if version == 1:
        return buf
    body, tail = buf[: -_CHECKSUM.size], buf[-_CHECKSUM.size :]
    if _CHECKSUM.unpack(tail)[0] != xxhash.xxh3_64_intdigest(body):
        raise ChecksumError("block metadata checksum mismatch")
    return body


def identity_error(meta: BlockMeta) -> str | None:
    """Why `meta` cannot be the record of the block it names, or None if it can.

    Checks that the key is the hash of (parent, tokens, fingerprint, namespace) as in
    docs/keys.md, that only a first block hangs off the root, and that the chunk
    size and permutation describe the block's tokens.
    """
    if meta.num_tokens == 0 or meta.chunk_tokens < 1:
        return f"empty block or chunk size ({meta.num_tokens} tokens, {meta.chunk_tokens} per chunk)"
    if block_key(meta.parent, meta.tokens, meta.fingerprint, meta.namespace) != meta.key:
        return "key is not the hash of its parent, tokens, fingerprint and namespace"
    if (meta.depth == 0) != (meta.parent == ROOT_KEY):
        return f"depth {meta.depth} does not match its parent {meta.parent.hex()}"
    layered = _layered_error(meta)
    if layered is not None:
        return layered
    perm = np.asarray(meta.permutation)
    if perm.shape != (meta.num_tokens,) or not np.array_equal(np.sort(perm), np.arange(meta.num_tokens)):
        return "permutation is not an ordering of the block's tokens"
    return None


def _layered_error(meta: BlockMeta) -> str | None:
    """What is wrong with a block's layout kind (a layered block must be in prompt order)."""
    if meta.layout not in (IMPORTANCE, LAYERED):
        return f"unknown layout {meta.layout!r}"
    if not meta.is_layered:
        if version_chunk_tokens(meta.layout_version) is not None:
            return f"layout version {meta.layout_version:#x} is a layered block's, not an importance one's"
        return None
    if meta.num_layers < 1 or meta.num_tokens % meta.chunk_tokens:
        return f"layered block with {meta.num_layers} layers and {meta.chunk_tokens}-token chunks"
    carried = version_chunk_tokens(meta.layout_version)
    if carried is not None and carried != meta.chunk_tokens:
        version = f"{meta.layout_version:#x}"
        return f"layout version {version} is of {carried}-token chunks, not {meta.chunk_tokens}"
    if not np.array_equal(np.asarray(meta.permutation), np.arange(meta.num_tokens)):
        return "a layered block is not in prompt order"
    return None
